"""Packed documents that do not attend to each other: positions and loss targets of a window of several documents,
each closed by a separator token (the end-of-sequence token the data packed them with).

Packing concatenates documents into one stream cut into windows (GPT-3, Brown et al. 2020, section 2.3). Without
more, attention runs across a document boundary and positions keep counting from the document before. Here, as
Megatron-LM's ``--reset-position-ids --reset-attention-mask --eod-mask-loss`` and torchtitan's document masks do:

- positions restart at 0 on the token after each separator (and at the window's start);
- transformers turns positions that restart into a block-diagonal causal mask (its ``find_packed_sequence_indices``:
  every attention implementation, sdpa included), so a token attends to its own document only;
- the target of a separator (the next document's first token, which nothing in its own document predicts) takes no
  loss.

Everything is derived from the tokens alone, so it holds wherever the model's forward runs them: on every pipeline
stage (each gets the micro-batch's tokens), on every context-parallel rank (the mask of the whole sequence, cut by
the attention of each rank's chunks). Pure PyTorch: no lightning import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["DocumentPositions", "check_document_masking", "cross_document_targets", "document_positions"]

IGNORE_INDEX = -100  # Hugging Face's label for positions that take no loss


def document_positions(tokens: Tensor, separator: int) -> Tensor:
    """The position of every token (B, T) within its document: 0 at the window's start and after each
    ``separator``, counting up to and including the separator that closes the document."""
    _, length = tokens.shape
    index = torch.arange(length, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == separator
    start_of_document = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_of_document


def cross_document_targets(inputs: Tensor, targets: Tensor, separator: int) -> Tensor:
    """``targets`` with no loss where the input is a ``separator``: its target begins the next document."""
    return targets.masked_fill(inputs == separator, IGNORE_INDEX)


class DocumentPositions:
    """Forward pre-hook of a Hugging Face causal LM: ``position_ids`` from its ``input_ids`` by
    :func:`document_positions`, unless the caller gave some, and no key/value cache (transformers builds the masks of
    packed sequences only without one). A plain object, so that copies of the model carry it."""

    def __init__(self, separator: int) -> None:
        self.separator = separator

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if kwargs.get("position_ids") is not None or not isinstance(tokens, Tensor) or tokens.is_floating_point():
            return None
        return args, {**kwargs, "position_ids": document_positions(tokens, self.separator), "use_cache": False}


def check_document_masking(model: nn.Module) -> None:
    """Refuse a Hugging Face causal LM whose forward lets packed documents see each other when its positions restart
    (a family transformers builds no packed-sequence mask for): one forward of a small copy (one block, a few
    vocabulary rows, random weights) on two documents packed, whose second document must compute as it does alone."""
    from lightning_par.parallel.model_map import resolve_model_map
    from lightning_par.parallel.small_copy import Vocabulary, small_copy

    model_map = resolve_model_map(None, model)
    if model_map is None:
        raise ValueError(f"packed_documents=True: no map of {type(model).__name__}'s blocks was found to check that "
                         "it keeps packed documents apart")
    rows, separator = 16, 3
    copy = small_copy(model, model_map.blocks, torch.device("cpu"), torch.float32,
                      vocabulary=Vocabulary.to_cut(model, model_map.embedding, model_map.head, rows))
    first, second = torch.tensor([[5, 6, 7, separator]]), torch.tensor([[8, 9, 10, 11, separator]])
    packed = torch.cat([first, second], dim=1)
    with torch.no_grad():
        together = _logits(copy(input_ids=packed, position_ids=document_positions(packed, separator), use_cache=False))
        alone = _logits(copy(input_ids=second, use_cache=False))
    if not torch.allclose(together[:, first.shape[1]:], alone, rtol=1e-4, atol=1e-5):
        raise ValueError(f"packed_documents=True: {type(model).__name__} lets a packed document attend to the one "
                         "before it when positions restart (transformers builds no packed-sequence mask for this "
                         "model); pack with padding instead, or train without packed_documents")


def _logits(output: Any) -> Tensor:
    return output.logits if hasattr(output, "logits") else output[0]
