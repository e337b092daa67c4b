"""What a pipeline schedule runs of a LightningModule: ``split_batch(batch) -> (inputs, targets)``,
``forward(inputs) -> logits`` (one tensor from stage to stage) and ``loss_fn(logits, targets)`` on the last stage,
never ``training_step``. A module written for Lightning's own strategies rarely defines the first and the last; where
they can be derived they are:

- ``split_batch``: a batch of ``(inputs, targets)`` pairs (a tuple or list of two tensors) is its own split;
- ``loss_fn``: the module's own ``training_step``, run on ``(inputs, targets)`` with the last stage's logits standing
  for what ``self(inputs)`` returns (logging muted: the strategy logs the step's loss once). That is the loss the step
  computes, whatever it is written with (``F.cross_entropy``, a ``criterion`` attribute, a mask of its own), as long
  as the step reaches the network through ``self(inputs)`` once and uses its inputs for nothing else. The inputs it
  is handed are a stand-in: a step that reads them otherwise, reaches the network another way
  (``self.model(inputs)``) or calls ``self`` twice (R-drop, a consistency loss) fails on the last stage at the first
  step, saying what to define (the fault monitor then stops the other ranks), instead of training on other values.

A module whose step hands a Hugging Face causal LM its ``labels`` gets all three from the model's own loss
(``lightning_par.strategies.pipeline_labels``).

What cannot be derived is refused before step 0, with the lines to add as code (docs/models.md, "Bring your own
module"). Lightning side: it reads and sets attributes of a LightningModule.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_par.strategies.pipeline_labels import huggingface_causal_lm, learn_labels_path, logging_muted

__all__ = ["complete_pipeline_contract"]

# What a LightningModule adds for pipeline parallel, one line each: the schedule runs them itself.
_PIPELINE_LINES = {
    "split_batch": "def split_batch(self, batch): return batch[:, :-1], batch[:, 1:]  # -> (inputs, targets)",
    "forward": "def forward(self, inputs): return self.model(inputs)  # inputs -> logits, one tensor in",
    "loss_fn": "def loss_fn(self, logits, targets): return F.cross_entropy(logits.flatten(0, 1), targets.flatten())",
}


def complete_pipeline_contract(module: LightningModule) -> None:
    """Give ``module`` the ``split_batch`` and ``loss_fn`` that can be derived (module docstring), or raise
    ``TypeError`` showing, as code, what it lacks."""
    has_split, has_loss = (callable(getattr(module, name, None)) for name in ("split_batch", "loss_fn"))
    one_input = _forward_takes_one_input(module)
    derivable = one_input and not has_split and type(module).training_step is not LightningModule.training_step
    missing = [name for name, present in (("split_batch", has_split or derivable), ("forward", one_input),
                                          ("loss_fn", has_loss or derivable)) if not present]
    if missing and not (has_split or has_loss) and type(module).training_step is not LightningModule.training_step:
        network = huggingface_causal_lm(module)
        if network is not None:  # a Hugging Face model given its labels by the step: its own loss, learned
            learn_labels_path(module, network, _refusal(module, missing))
            return
    if missing:
        raise TypeError(_refusal(module, missing))
    if has_split:
        return
    # The split derived, and the loss unless the module has one: a loss taken from the step needs the step's own
    # batches, the pairs the split cuts.
    module.split_batch = _PairSplit(module, derive_loss=not has_loss)
    if not has_loss:
        module.loss_fn = _StepLoss(module)


def _forward_takes_one_input(module: LightningModule) -> bool:
    forward = type(module).forward
    if forward is LightningModule.forward:
        return False
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    return sum(p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in parameters) == 1


def _refusal(module: LightningModule, missing: list[str]) -> str:
    lines = "\n".join(f"    {_PIPELINE_LINES[name]}" for name in missing)
    described = [{"forward": "forward(inputs)", "split_batch": "split_batch()", "loss_fn": "loss_fn()"}[name]
                 for name in missing]
    listed = described[0] if len(described) == 1 else f"{', '.join(described[:-1])} and {described[-1]}"
    name = type(module).__name__
    return (f"pipeline parallel needs {name} to define {listed}; the schedule runs split_batch(batch) -> (inputs, "
            "targets), forward(inputs) -> logits and loss_fn(logits, targets) itself, never training_step (it takes "
            "them from batches of (inputs, targets) pairs and a training_step that calls self(inputs)). Add to "
            f"{name}, for example:\n{lines}\n(see docs/models.md, \"Bring your own module\")")


class _PairSplit:
    """``split_batch`` of a module whose batches are ``(inputs, targets)`` pairs; any other batch is refused with
    the lines to add."""

    def __init__(self, module: LightningModule, *, derive_loss: bool) -> None:
        self.module, self.derive_loss = module, derive_loss

    def __call__(self, batch: Any) -> tuple[Tensor, Tensor]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(b, Tensor) for b in batch):
            return batch[0], batch[1]
        kind = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list, dict))
                else f"a {type(batch).__name__}")
        missing = ["split_batch", "loss_fn"] if self.derive_loss else ["split_batch"]
        raise TypeError(f"{_refusal(self.module, missing)}\n(its batches are {kind}, not (inputs, targets) pairs)")


class _NotTheInputs:
    """What the step is given for its inputs when it is run for its loss: using it other than passing it to
    ``self(...)`` is refused."""

    def __init__(self, module: LightningModule) -> None:
        self._module_name = type(module).__name__

    def __getattr__(self, name: str) -> Any:
        raise TypeError(f"pipeline parallel computes {self._module_name}'s loss by running its training_step with the "
                        "last stage's logits standing for self(inputs), and the step uses its inputs otherwise "
                        f"(.{name}): define on the module {_PIPELINE_LINES['loss_fn']}")


class _StepLoss:
    """``loss_fn(logits, targets)``: the module's ``training_step`` on ``(inputs, targets)``, where ``self(inputs)``
    returns ``logits``."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        with _calls_return(self.module, logits) as calls, logging_muted(self.module):
            output = type(self.module).training_step(self.module, (_NotTheInputs(self.module), targets), 0)
        if len(calls) != 1:  # two passes (R-drop, a consistency loss) would each get the one pass's logits
            raise TypeError(f"{type(self.module).__name__}.training_step calls self(...) {len(calls)} times: pipeline "
                            "parallel runs the network once a micro-batch and takes the loss from a step that calls it "
                            f"once. Define {_PIPELINE_LINES['loss_fn']}")
        loss = output["loss"] if isinstance(output, dict) else output
        if not isinstance(loss, Tensor):
            raise TypeError(f"{type(self.module).__name__}.training_step returned {type(output).__name__}, not a loss: "
                            f"define {_PIPELINE_LINES['loss_fn']}")
        return loss


@contextmanager
def _calls_return(module: LightningModule, logits: Tensor) -> Iterator[list[None]]:
    """``self(...)`` returns ``logits`` until the step returns; yields the list of the calls made."""
    calls: list[None] = []

    def forward(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(None)
        return logits

    module.forward = forward  # an instance attribute: what self(...) calls
    try:
        yield calls
    finally:
        del module.forward
