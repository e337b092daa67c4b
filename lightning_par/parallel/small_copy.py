"""A small real copy of a model: the same modules, one block of each kind, random weights, no weight copied.

Checking a tensor-parallel split runs the model whole and split; tracing what a network does outside its
blocks runs it once. Neither needs the model's own weights or all of its blocks, and a model built on the
meta device (``Trainer.init_module(empty_init=True)``) has no weights to run. :func:`small_copy` deep-copies
the model with every parameter swapped for a meta tensor (so nothing is copied), keeps the first blocks that
hold one block of each structure (a dense and an MoE block, say), allocates it, and fills every parameter with
random values drawn from its name: every rank builds the same copy. It runs without the hooks users put on
the model, in evaluation mode (no dropout draws), and is never trained.

The vocabulary can be cut too (``vocabulary``): an embedding and a linear head of 128 K rows would make even one
block's copy gigabytes in float64, on every rank, at set-up; a few rows per rank split them the same way.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par.parallel.modules import clean_name
from lightning_par.parallel.modules import materialize_meta_parameters


def small_copy(module: nn.Module, blocks: str, device: torch.device, dtype: torch.dtype, *,
                  min_blocks: int = 1, vocabulary: Vocabulary | None = None) -> nn.Module:
    """``module`` rebuilt on ``device`` in ``dtype`` with the blocks under ``blocks`` (a dotted name) shortened to
    one of each kind, at least ``min_blocks`` of them, and random weights every rank draws alike; with
    ``vocabulary``, its embedding and head cut to ``vocabulary.rows`` rows (token ids must then be below it)."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, DeviceMesh):
                memo[id(value)] = None  # a LightningModule's device_mesh: not part of the computation
        for name, parameter in sub.named_parameters(recurse=False):
            if id(parameter) not in memo:
                memo[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device="meta"))
    model_copy = copy.deepcopy(module, memo)
    model_copy.eval()
    _drop_hooks(model_copy)
    _keep_one_block_of_each_kind(model_copy, blocks, min_blocks)
    if vocabulary is not None:
        vocabulary.cut(model_copy)
    if any(b.is_meta for b in model_copy.buffers()):
        # Built on the meta device: buffers (rotary tables, masks) are computed as training will compute them.
        materialize_meta_parameters(model_copy, device)
    else:
        _allocate(model_copy, device)
    model_copy.to(dtype=dtype)
    with torch.no_grad():
        seen: set[int] = set()
        for name, parameter in model_copy.named_parameters(remove_duplicate=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            if parameter.is_meta:  # a copy on the meta device (a dry run's set-up) has no values to draw
                parameter.requires_grad_(True)
                continue
            generator = torch.Generator(device="cpu").manual_seed(zlib.crc32(clean_name(name).encode()))
            values = torch.randn(parameter.shape, generator=generator, dtype=torch.float64).to(dtype)
            # Matrices scaled like a fan-in init; vectors (norm gains, biases) around one.
            values = values / max(parameter.shape[-1], 1) ** 0.5 if parameter.dim() >= 2 else 1.0 + 0.1 * values
            parameter.copy_(values.to(parameter.device))
            parameter.requires_grad_(True)
    return model_copy


def model_dtype(module: nn.Module) -> torch.dtype:
    """The floating-point dtype ``module`` computes in (its first floating-point parameter's, else torch's default):
    a copy run in another would meet the model's own tensors of this dtype (a table it builds in its forward)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())


@dataclass(frozen=True)
class Vocabulary:
    """The embedding (an ``nn.Embedding``) and the head (an ``nn.Linear`` with a row per token, or None) to cut to
    ``rows`` rows in a copy."""

    embedding: str
    head: str | None
    rows: int

    @classmethod
    def to_cut(cls, module: nn.Module, embedding: str | None, head: str | None, rows: int) -> Vocabulary | None:
        """What to cut in ``module`` to ``rows`` rows, or None where its embedding or head is of another kind (a
        ``Conv1D`` head, say) or no larger."""
        if embedding is None:
            return None
        table = module.get_submodule(embedding)
        if not isinstance(table, nn.Embedding) or table.num_embeddings <= rows:
            return None
        if head is not None:
            projection = module.get_submodule(head)
            if not isinstance(projection, nn.Linear) or projection.out_features != table.num_embeddings:
                return None
        return cls(embedding, head, rows)

    def cut(self, model_copy: nn.Module) -> None:
        """Swap the (meta) embedding and head parameters of ``copy`` for ones of ``rows`` rows, ties kept: every module
        that registers one of them (a head tied to the embedding, BERT's ``cls.predictions.bias`` beside its decoder's,
        T5's encoder and decoder tables beside ``shared``) gets the new one."""
        table = model_copy.get_submodule(self.embedding)
        old = table.weight
        _swap(model_copy, old, nn.Parameter(torch.empty(self.rows, table.embedding_dim, dtype=old.dtype,
                                                        device="meta")))
        table.num_embeddings = self.rows
        if table.padding_idx is not None and table.padding_idx >= self.rows:
            table.padding_idx = None
        if self.head is None:
            return
        projection = model_copy.get_submodule(self.head)
        if projection.weight is not table.weight:
            rows = torch.empty(self.rows, projection.in_features, dtype=projection.weight.dtype, device="meta")
            _swap(model_copy, projection.weight, nn.Parameter(rows))
        if projection.bias is not None:
            _swap(model_copy, projection.bias, nn.Parameter(torch.empty(self.rows, dtype=projection.bias.dtype,
                                                                        device="meta")))
        projection.out_features = self.rows


def _swap(model_copy: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Register ``new`` wherever ``model_copy`` registers ``old``."""
    for sub in model_copy.modules():
        for name, parameter in list(sub._parameters.items()):
            if parameter is old:
                sub._parameters[name] = new


def _drop_hooks(model_copy: nn.Module) -> None:
    """The copy runs without the hooks users put on the model (monitors that record or assume a layout), except
    those that compute a weight (``weight_norm``)."""
    from torch.nn.utils.weight_norm import WeightNorm

    for sub in model_copy.modules():
        kept = {k: h for k, h in sub._forward_pre_hooks.items() if isinstance(h, WeightNorm)}
        sub._forward_pre_hooks.clear()
        sub._forward_pre_hooks.update(kept)
        for hooks in (sub._forward_hooks, sub._backward_hooks, sub._backward_pre_hooks):
            hooks.clear()


def _allocate(model_copy: nn.Module, device: torch.device) -> None:
    """Real tensors for the meta parameters of ``copy`` (tied ones stay tied), its buffers moved as they are."""
    allocated: dict[int, nn.Parameter] = {}
    for sub in model_copy.modules():
        for name, parameter in list(sub._parameters.items()):
            if parameter is None:
                continue
            if id(parameter) not in allocated:
                allocated[id(parameter)] = nn.Parameter(torch.empty(parameter.shape, dtype=parameter.dtype,
                                                                    device=device))
            sub._parameters[name] = allocated[id(parameter)]
    for sub in model_copy.modules():
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = buffer.to(device)


def _keep_one_block_of_each_kind(model_copy: nn.Module, blocks: str, min_blocks: int) -> None:
    """Shorten the blocks to the first ones that contain one block of each structure (dense and MoE blocks)."""
    container = model_copy.get_submodule(blocks)
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        return
    kinds: dict[tuple, int] = {}
    for index, block in enumerate(container.children()):
        kind = tuple((name, type(sub).__name__, tuple(tuple(p.shape) for p in sub.parameters(recurse=False)))
                     for name, sub in block.named_modules())
        kinds.setdefault(kind, index)
    keep = max(max(kinds.values()) + 1, min_blocks)
    for key in list(container._modules)[keep:]:
        del container._modules[key]


__all__ = ["Vocabulary", "model_dtype", "small_copy"]
