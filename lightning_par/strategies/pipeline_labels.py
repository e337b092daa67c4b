"""The pipeline contract of a LightningModule that trains a Hugging Face causal LM the way its users write one: the
step hands the model its batch with ``labels`` and returns the loss the model computes (``self.model(**batch).loss``,
``self.model(input_ids=x, labels=x).loss``), and the module defines neither ``split_batch`` nor ``loss_fn`` nor a
one-input ``forward``.

Learned from the step itself, on the first batch: the step runs until it calls the model (stopped there, logging
muted), and the call says which of the batch's tensors are the model's ``input_ids`` and ``labels`` (and
``attention_mask``). Then:

- ``split_batch(batch)``: those two tensors of every batch;
- ``forward(inputs)``: the model called with ``input_ids=inputs`` (and the call's other, non-tensor arguments), its
  logits;
- ``loss_fn(logits, labels)``: the model's own loss (``model.loss_function``, shifting the labels and skipping
  -100) on the last stage's logits, handed back to the step as the output's ``loss`` so that the step returns what it
  returns from it. Each micro-batch's mean is weighted by its share of the rank's loss-taking tokens, so the
  micro-batches together give the mean over the rank's batch, as the step computes it whole.

Refused, saying what to define instead: a step that computes the model's inputs (not tensors of the batch), passes
other tensors (``position_ids``, ``pixel_values``), takes its loss without ``labels``, or calls the model twice; a
model whose loss is more than its cross-entropy (a router's auxiliary loss); an ``attention_mask`` that changes the
logits a loss is taken from (padding before real tokens, or labels on padded positions). Lightning side: it sets
attributes of a LightningModule.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_par.parallel.initialize import RandomState

__all__ = ["huggingface_causal_lm", "learn_labels_path", "logging_muted"]

IGNORE_INDEX = -100  # Hugging Face's label of a position that takes no loss
_INPUTS, _LABELS, _MASK = "input_ids", "labels", "attention_mask"


def huggingface_causal_lm(module: LightningModule) -> str | None:
    """The path of the outermost Hugging Face causal LM inside ``module`` (a ``PreTrainedModel`` whose class ends in
    ``ForCausalLM``), or None. Looks only where transformers is already imported."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    for name, part in module.named_modules():
        if isinstance(part, transformers.PreTrainedModel) and type(part).__name__.endswith("ForCausalLM"):
            return name
    return None


def learn_labels_path(module: LightningModule, path: str, define: str) -> None:
    """Give ``module`` the ``split_batch`` and ``loss_fn`` of the labels path of its model at ``path``; its
    ``forward`` follows at the first batch. ``define``: the refusal's lines to add, for what cannot be derived."""
    labels_path = _LabelsPath(module, path, define)
    module.split_batch = labels_path.split
    module.loss_fn = labels_path.loss


class _Caught(Exception):
    def __init__(self, arguments: dict[str, Any]) -> None:
        super().__init__()
        self.arguments = arguments


class _LabelsPath:
    def __init__(self, module: LightningModule, path: str, define: str) -> None:
        self.module, self.path, self.define = module, path, define
        self.network = module.get_submodule(path)
        self.name = type(module).__name__
        self.leaves: dict[str, int] | None = None  # argument -> index of its tensor among the batch's leaves
        self.stand_in: Any = None  # the batch's structure with a stand-in for each tensor, for the step's loss
        self.batch_tokens: Tensor | None = None  # the loss-taking tokens of the batch last split
        self.batch_rows = 0  # and its samples
        if getattr(self.network.config, "output_router_logits", False):
            self._refuse(f"{type(self.network).__name__} adds its router's auxiliary loss to the loss it returns "
                         "(output_router_logits=True), which the pipeline's last stage does not compute")

    def _refuse(self, reason: str) -> NoReturn:
        raise TypeError(f"pipeline parallel cannot take {self.name}'s loss from {type(self.network).__name__}'s "
                        f"labels: {reason}. {self.define}")

    # ------------------------------------------------------------------------ split_batch
    def split(self, batch: Any) -> tuple[Tensor, Tensor]:
        if self.leaves is None:
            self._learn(batch)
        leaves, _ = tree_flatten(batch)
        inputs, labels = leaves[self.leaves[_INPUTS]], leaves[self.leaves[_LABELS]]
        if _MASK in self.leaves:
            self._check_mask(leaves[self.leaves[_MASK]], labels)
        self.batch_tokens, self.batch_rows = (labels[..., 1:] != IGNORE_INDEX).sum(), labels.shape[0]
        return inputs, labels

    def _learn(self, batch: Any) -> None:
        """Run the step until it calls the model: which of the batch's tensors it hands the model as what."""
        arguments = self._caught_call(batch)
        leaves, spec = tree_flatten(batch)
        tensors = {name: value for name, value in arguments.items() if isinstance(value, Tensor)}
        if not isinstance(tensors.get(_LABELS), Tensor):
            self._refuse("its training_step calls the model without labels (the loss is taken from its output some "
                         "other way)")
        if not isinstance(tensors.get(_INPUTS), Tensor):
            self._refuse("its training_step calls the model without input_ids")
        other = sorted(set(tensors) - {_INPUTS, _LABELS, _MASK})
        if other:
            self._refuse(f"its training_step hands the model {', '.join(other)} beside input_ids, and a pipeline "
                         "stage receives one tensor")
        found = {}
        for name, value in tensors.items():
            index = next((i for i, leaf in enumerate(leaves) if leaf is value), None)
            if index is None:
                self._refuse(f"its training_step computes the model's {name} from the batch (not one of the batch's "
                             "tensors), which split_batch cannot repeat")
            found[name] = index
        self.leaves = found
        self.stand_in = tree_unflatten([_NotTheBatch(self.name, self.define) if isinstance(leaf, Tensor) else leaf
                                        for leaf in leaves], spec)
        _derive_forward(self.module, self.path, {name: value for name, value in arguments.items()
                                                 if not isinstance(value, Tensor) and name not in (_INPUTS, _LABELS)})

    def _caught_call(self, batch: Any) -> dict[str, Any]:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            bound = inspect.signature(self.network.forward).bind_partial(*args, **kwargs)
            raise _Caught({**{k: v for k, v in bound.arguments.items() if k != "kwargs"},
                           **bound.arguments.get("kwargs", {})})

        handle = self.network.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
        device = next((leaf.device for leaf in tree_flatten(batch)[0] if isinstance(leaf, Tensor)),
                      torch.device("cpu"))
        random_state = RandomState(device)  # the step's code before the call may draw: one process never runs it
        try:
            with torch.no_grad(), logging_muted(self.module):
                _run_step(self.module, batch)
        except _Caught as caught:
            return caught.arguments
        finally:
            handle.remove()
            random_state.restore()
        self._refuse(f"its training_step does not call {self.path or 'the model'}")

    def _check_mask(self, mask: Tensor, labels: Tensor) -> None:
        """The stages run input_ids alone, causally: the logits a loss is taken from must be those the mask gives."""
        if bool((mask[..., 1:] > mask[..., :-1]).any()):
            self._refuse("a batch's attention_mask pads before real tokens (left padding); pad on the right "
                         "(tokenizer.padding_side = 'right')")
        if bool(((labels[..., 1:] != IGNORE_INDEX) & (mask[..., :-1] == 0)).any()):
            self._refuse("a batch takes a loss at padded positions (labels other than -100 where attention_mask is "
                         "0); set those labels to -100, as DataCollatorForLanguageModeling does")

    # ------------------------------------------------------------------------ loss_fn
    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The step's loss of one micro-batch, weighted by its share of the rank's batch's loss-taking tokens, times
        the micro-batches (which the pipeline divides each micro-batch's loss by)."""
        tokens = (labels[..., 1:] != IGNORE_INDEX).sum()
        if int(tokens) == 0:
            return logits.sum() * 0.0  # a micro-batch without a loss-taking token weighs nothing
        mean = self.network.loss_function(logits=logits, labels=labels, vocab_size=self.network.config.vocab_size)
        microbatches = self.batch_rows // labels.shape[0]
        return self._step_loss(mean, logits) * (tokens / self.batch_tokens * microbatches)

    def _step_loss(self, mean: Tensor, logits: Tensor) -> Tensor:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        calls: list[None] = []

        def model(*args: Any, **kwargs: Any) -> Any:
            calls.append(None)
            return CausalLMOutputWithPast(loss=mean, logits=logits)

        with _attribute(self.module, self.path, model), logging_muted(self.module):
            output = _run_step(self.module, self.stand_in)
        if len(calls) != 1:
            raise TypeError(f"{self.name}.training_step calls {self.path} {len(calls)} times: pipeline parallel runs "
                            f"the model once a micro-batch. {self.define}")
        loss = output["loss"] if isinstance(output, dict) else output
        if not isinstance(loss, Tensor):
            raise TypeError(f"{self.name}.training_step returned {type(output).__name__}, not a loss. {self.define}")
        return loss


class _NotTheBatch:
    """What the step is given for the batch's tensors when it is run for its loss: passing them to the model is all
    it may do with them."""

    def __init__(self, name: str, define: str) -> None:
        self._name, self._define = name, define

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):  # what copy and pickle look for
            raise AttributeError(attribute)
        raise TypeError(f"pipeline parallel computes {self._name}'s loss by running its training_step with the last "
                        "stage's logits standing for the model's output, and the step uses the batch otherwise "
                        f"(.{attribute}). {self._define}")


def _derive_forward(module: LightningModule, path: str, constants: dict[str, Any]) -> None:
    """``module``'s class becomes a subclass (of the same name) whose ``forward(inputs)`` returns the logits of the
    model at ``path`` on ``input_ids=inputs``: what a pipeline stage runs, on its own view of the module (stages copy
    the module, so the forward must find the model through ``self``). Any other call goes to the module's own
    forward. A class, not an attribute, as PyTorch's ``fully_shard`` does."""
    cls = type(module)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], Tensor):
            return self.get_submodule(path)(input_ids=args[0], **constants).logits
        return cls.forward(self, *args, **kwargs)

    module.__class__ = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__})


def _run_step(module: LightningModule, batch: Any) -> Any:
    step = type(module).training_step
    takes_index = len(inspect.signature(step).parameters) > 2
    return step(module, batch, 0) if takes_index else step(module, batch)


@contextmanager
def _attribute(module: nn.Module, path: str, value: Any) -> Iterator[None]:
    """Within: ``module``'s attribute at ``path`` reads ``value`` (set in the instance's dictionary, ahead of the
    registered submodule, whose hooks then do not run)."""
    parent_path, _, name = path.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    parent.__dict__[name] = value
    try:
        yield
    finally:
        del parent.__dict__[name]


@contextmanager
def logging_muted(module: LightningModule) -> Iterator[None]:
    """Within: the module's ``log`` and ``log_dict`` do nothing (a step run for what it computes, not as a step)."""
    def muted(*args: Any, **kwargs: Any) -> None:
        return None

    module.log = module.log_dict = muted
    try:
        yield
    finally:
        del module.log, module.log_dict
