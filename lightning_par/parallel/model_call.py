"""How the training step calls the model, so that the set-up's runs of a small copy call it the same way.

The set-up runs a small copy of the model on one sample of the data: to check a tensor-parallel split, the layout's
forward, what runs outside the blocks. The model contract (``forward(inputs) -> logits``) makes that one call. A module
written for Lightning's own strategies need not meet it: its ``training_step`` may call a submodule (``self.model(x)``)
and have no ``forward`` of its own, or pass several inputs (``self(inputs, target)``, ``self.model(x,
attention_mask=mask)``). A :class:`ModelCall` records one such call, as the step made it (the strategy catches it on a
small copy: ``lightning_par.strategies.setup_checks``), and :func:`run_model` repeats it on any copy with other inputs
in place of the recorded ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

__all__ = ["ModelCall", "calling_as", "current_call", "run_model"]


@dataclass(frozen=True)
class ModelCall:
    """A call of the submodule at ``path`` (empty: the root) with ``args`` and ``kwargs``; ``inputs`` names the
    argument that holds the sample's inputs (a position, or a keyword)."""

    path: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: int | str = 0

    @classmethod
    def first_tensor_as_inputs(cls, path: str, args: tuple, kwargs: dict[str, Any]) -> ModelCall | None:
        """The call with its first tensor argument (positional, else keyword) as the inputs; None without one."""
        for index, value in enumerate(args):
            if isinstance(value, Tensor):
                return cls(path, tuple(args), dict(kwargs), index)
        for key, value in kwargs.items():
            if isinstance(value, Tensor):
                return cls(path, tuple(args), dict(kwargs), key)
        return None

    @property
    def sample(self) -> Tensor:
        """The recorded inputs."""
        return self.args[self.inputs] if isinstance(self.inputs, int) else self.kwargs[self.inputs]

    def run(self, root: nn.Module, inputs: Tensor) -> Any:
        """The recorded call on ``root``'s module at :attr:`path`, with ``inputs`` in place of the recorded ones. The
        other tensors follow it: cut to its first rows where they are batch-aligned with the recorded inputs, on its
        device, in its floating-point dtype where they are floating-point too."""
        batch = self.sample.shape[0] if self.sample.dim() else None

        def like(value: Any) -> Any:
            if not isinstance(value, Tensor):
                return value
            if batch is not None and value.dim() and value.shape[0] == batch and inputs.dim():
                value = value[: inputs.shape[0]]
            dtype = inputs.dtype if value.is_floating_point() and inputs.is_floating_point() else value.dtype
            return value.to(device=inputs.device, dtype=dtype)

        args = [inputs if i == self.inputs else like(a) for i, a in enumerate(self.args)]
        kwargs = {k: inputs if k == self.inputs else like(v) for k, v in self.kwargs.items()}
        module = root.get_submodule(self.path) if self.path else root
        return module(*args, **kwargs)


_CALL: ContextVar[ModelCall | None] = ContextVar("lightning_par_model_call", default=None)


@contextmanager
def calling_as(call: ModelCall | None) -> Iterator[None]:
    """Within: :func:`run_model` makes ``call`` (None: the model contract's ``model(inputs)``)."""
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)


def current_call() -> ModelCall | None:
    """The call :func:`run_model` makes now (None: the model contract's ``model(inputs)``)."""
    return _CALL.get()


def run_model(model: nn.Module, inputs: Tensor) -> Any:
    """``model`` (a small copy of the model the layout is for, or the model) run on ``inputs`` as the training step
    runs it: ``model(inputs)``, or the recorded :class:`ModelCall` where the set-up runs under :func:`calling_as`.
    An output that carries ``logits`` (a Hugging Face model given ``labels`` puts its loss first) gives those."""
    call = _CALL.get()
    output = model(inputs) if call is None else call.run(model, inputs)
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, Tensor) else output

