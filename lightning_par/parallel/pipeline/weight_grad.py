"""Deferred weight gradients: the weight-gradient half of backward under the zero-bubble pipeline schedules.

ZB-V and DualPipeV (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"; DeepSeek-AI 2024) split a stage's backward
into the input-gradient half (``I``), which the previous stage waits for, and the weight-gradient half (``W``),
which fills the bubble. PyTorch's generic split (``stage_backward_input`` / ``stage_backward_weight`` in
``torch.distributed.pipelining._backward``) finds, on every ``I``, where each parameter's gradient branches off the
input path by walking the stage's autograd graph in Python, keeps the graph, and on ``W`` runs one
``torch.autograd.grad`` per parameter group, each from a node of that graph. On the reference model (2 blocks per
stage, dim 128, CPU) its two halves together cost about 1.5x one whole backward (docs/performance.md).

Most of a transformer's weight gradients are those of its linear layers, dW = dY^T X, and those are simple to set
aside, as the paper's implementation (Megatron-LM's ``WeightGradStore``) does: :class:`DeferredWeightGradients`
makes the ``nn.Linear`` layers of a rank's stages compute only dX in backward and keep (X, dY); a stage's ``I`` is
then one ordinary backward (every other gradient, norms and embeddings included, computed as usual) and its ``W``
the kept products. It plugs into PyTorch's own hook for this, ``PipelineStage.dw_builder``: after each backward the
stage asks the builder for the micro-batch's weight-gradient work and runs it at that micro-batch's ``W``.

Left to PyTorch, whole: the first stage, which has no input gradient to compute (PyTorch runs its whole backward
at ``W``, unsplit). A compiled stage runs its whole backward at ``I`` (compiled code computes every gradient in one
node, which PyTorch's split would run twice). Left to PyTorch's split: a stage under FSDP2 (ZeRO-3: its gradients
are reduced in autograd hooks). Left to autograd, layer by layer: linear layers of another type (float8, LoRA), DTensor weights
or inputs (tensor parallel), frozen weights. A weight with gradient hooks (ZeRO-2's reduction to the owner) gets
its gradient at once, through autograd, so that its hooks run.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["DeferredLinear", "DeferredWeightGradients"]


def _weight_gradient(grad_output: Tensor, inputs: Tensor) -> Tensor:
    """dW = dY^T X over every leading dimension: (out, in)."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t().mm(inputs.reshape(-1, inputs.shape[-1]))


def _has_hooks(parameter: Tensor) -> bool:
    return bool(getattr(parameter, "_post_accumulate_grad_hooks", None) or getattr(parameter, "_backward_hooks", None))


class _LinearInputGradient(torch.autograd.Function):
    """``F.linear`` whose backward computes the input and bias gradients, and leaves the weight's to the store."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, store: DeferredWeightGradients) -> Tensor:
        ctx.parameter = weight  # the parameter itself, not autocast's copy
        ctx.store = store
        device = x.device.type
        if torch.is_autocast_enabled(device):  # compute as autocast would, in its dtype (casts kept for backward)
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
            with torch.autocast(device, enabled=False):
                output = F.linear(x, weight, bias)
        else:
            output = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        parameter = ctx.parameter
        grad_input = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            if ctx.store.armed and not _has_hooks(parameter):
                ctx.store.keep(parameter, x, grad)
            else:
                grad_weight = _weight_gradient(grad, x)
        return grad_input, grad_weight, grad_bias, None  # autograd casts them to the inputs' dtypes


class DeferredLinear(nn.Linear):
    """An ``nn.Linear`` of a pipeline stage whose weight gradient :class:`DeferredWeightGradients` defers (the
    layer's class is swapped in place, as FSDP2 does; parameters, names and state dict stay those of the layer)."""

    weight_gradients: DeferredWeightGradients

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if (self.weight_gradients.stepping and torch.is_grad_enabled() and weight.requires_grad
                and not isinstance(x, DTensor) and not isinstance(weight, DTensor)):
            return _LinearInputGradient.apply(x, weight, self.bias, self.weight_gradients)
        return F.linear(x, weight, self.bias)


class DeferredWeightGradients:
    """Defers the weight gradients of the plain ``nn.Linear`` layers of ``stages`` (one rank's ``PipelineStage``
    objects) to the stages' ``W`` actions.

    The layers take the deferring path only in the forwards of a training step (:attr:`stepping`, set by the
    caller around the schedule's step), and defer only in the backwards of the schedule's actions (:attr:`armed`,
    set around each stage's ``backward_one_chunk``): a backward outside them (PyTorch's shape inference on a
    schedule's first step) gets its weight gradients at once, as does evaluation, which never takes the path.
    ``layers`` is the number of layers it defers; ``stages`` the indices of the stages it took over (the others
    keep PyTorch's split).
    """

    def __init__(self, stages: list[Any]) -> None:
        self.stepping = False
        self.armed = False
        self._kept: list[tuple[Tensor, Tensor, Tensor]] = []
        self.stages: list[int] = []
        layers: set[int] = set()
        for stage in stages:
            if getattr(stage, "is_first", False):
                continue  # no input gradient to hurry: PyTorch runs its whole backward, unsplit, at W already
            modules = list(stage.submod.modules())
            if any(_compiled(m) for m in modules):
                # Compiled code runs its backward as one node for every gradient: PyTorch's split would run it twice
                # over a kept graph (refused by AOTAutograd's donated buffers, and wrong without them: 1e-3 after 8
                # steps). The whole backward runs at I, and W has nothing left.
                stage.dw_builder = _nothing_left
                continue
            if any(_keeps_own_backward(m) for m in modules):
                continue
            linears = [m for m in modules if isinstance(m, DeferredLinear) or _deferrable(m)]
            if not linears:
                continue
            for layer in linears:
                layer.__class__ = DeferredLinear
                layer.weight_gradients = self
                layers.add(id(layer))
            stage.dw_builder = self.builder
            stage.backward_one_chunk = self._armed(stage.backward_one_chunk)
            self.stages.append(stage.stage_index)
        self.layers = len(layers)

    def _armed(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def armed(*args: Any, **kwargs: Any) -> Any:
            self.armed = True
            try:
                return backward(*args, **kwargs)
            finally:
                self.armed = False

        return armed

    def keep(self, parameter: Tensor, x: Tensor, grad: Tensor) -> None:
        self._kept.append((parameter, x, grad))

    def builder(self) -> Callable[[], None]:
        """``PipelineStage.dw_builder``: called right after a micro-batch's backward, returns its weight-gradient
        work (what that backward kept), which the stage runs at the micro-batch's ``W``."""
        kept, self._kept = self._kept, []

        def weight_gradients() -> None:
            with torch.no_grad():
                for parameter, x, grad in kept:
                    grad_weight = _weight_gradient(grad, x).to(parameter.dtype)
                    if parameter.grad is None:
                        parameter.grad = grad_weight
                    else:
                        parameter.grad += grad_weight

        return weight_gradients

    def flush(self) -> None:
        """Computes whatever a backward kept and no ``W`` took (none after a complete schedule step)."""
        self.builder()()


def _deferrable(module: nn.Module) -> bool:
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and "forward" not in module.__dict__ and not isinstance(module.weight, DTensor)
            and module.weight.requires_grad)


def _keeps_own_backward(module: nn.Module) -> bool:
    """FSDP2 reduces gradients in autograd hooks."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _compiled(module: nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def _nothing_left() -> Callable[[], None]:
    """A ``dw_builder`` for a stage whose backward computed every gradient already."""
    return lambda: None
