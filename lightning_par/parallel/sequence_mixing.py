"""Which module of a block mixes the tokens of the sequence other than through ``F.scaled_dot_product_attention``.

Context parallel (Liu et al. 2023, "Ring Attention"; torch's ``context_parallel``) gives each rank a chunk of the
sequence and routes one call over the ranks, ``F.scaled_dot_product_attention``, so that attention sees every
chunk. A block that mixes tokens some other way sees its rank's chunk alone: attention written out (eager, a softmax
over a mask of the whole sequence), which the model may offer to run through SDPA instead, or a convolution or
recurrence along the sequence (Mamba, Gu & Dao 2023; RWKV, Peng et al. 2023; the gated short convolutions of
hybrid models such as LFM2), which no setting turns into attention. The refusal names which.

:func:`sequence_mixers` finds the module by what it computes, on one forward of a small copy: the first module, in
the order modules finish, whose output at one position depends on its own input at another position (read off the
autograd graph: the gradient of the output at the first and last position), and which neither calls SDPA nor runs
inside a module that does. Whether it computes a softmax tells written-out attention from a convolution or
recurrence. Depending on its *own* input keeps a projection after the attention from counting as a mixer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_par.parallel.modules import first_tensor

_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax}


@dataclass(frozen=True)
class SequenceMixer:
    """A module inside a block that mixes the tokens without ``F.scaled_dot_product_attention``."""

    block: str  # the block's full name
    module: str  # the module's full name
    kind: str  # its class name
    softmax: bool  # it computes a softmax: attention written out, not a convolution or recurrence


class _Watch(TorchFunctionMode):
    """Marks the modules running when SDPA or a softmax is called."""

    def __init__(self, running: list[str]) -> None:
        super().__init__()
        self.running = running
        self.sdpa: set[str] = set()
        self.softmax: set[str] = set()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.sdpa.update(self.running)
        elif func in _SOFTMAX:
            self.softmax.update(self.running)
        return func(*args, **(kwargs or {}))


def sequence_mixers(model: nn.Module, block_names: list[str], run: Callable[[], Any]) -> dict[str, SequenceMixer]:
    """``{block: the first module in it that mixes tokens without SDPA}`` for the blocks of ``model`` that have one, in
    the order they run, from one forward ``run()`` of ``model`` (the sequence along dim 1 of the blocks' hidden
    states). Empty where the forward raises: the caller's refusal has its own reason."""
    running: list[str] = []
    records: list[tuple[str, str, Tensor, Tensor]] = []  # (block, module, its input, its output), as they finish
    lengths: dict[str, int] = {}
    handles = []
    for block_name in block_names:
        for relative, sub in model.get_submodule(block_name).named_modules():
            name = f"{block_name}.{relative}" if relative else block_name
            handles.append(sub.register_forward_pre_hook(
                lambda m, a, k, n=name, b=block_name: _enter(running, n, b, a, k, lengths), with_kwargs=True))
            handles.append(sub.register_forward_hook(
                lambda m, a, k, o, n=name, b=block_name: _leave(running, records, n, b, a, k, o),
                with_kwargs=True, always_call=True))
    watch = _Watch(running)
    try:
        with torch.enable_grad(), watch:
            run()
    except Exception:  # noqa: BLE001 - only a hint for a refusal that has its own reason
        return {}
    finally:
        for handle in handles:
            handle.remove()
    found: dict[str, SequenceMixer] = {}
    with torch.enable_grad():  # (a caller's no_grad would leave the slices below outside the graph)
        for block, name, source, output in records:
            if block in found or name in watch.sdpa or block not in lengths:
                continue
            if _mixes(source, output, lengths[block]):
                found[block] = SequenceMixer(block, name, type(model.get_submodule(name)).__name__,
                                             name in watch.softmax)
    return found


def _enter(running: list[str], name: str, block: str, args: tuple, kwargs: dict, lengths: dict[str, int]) -> None:
    running.append(name)
    if name == block and block not in lengths:
        hidden = _first_float(args, kwargs)
        if hidden is not None and hidden.dim() >= 2:
            lengths[block] = hidden.shape[1]


def _leave(running: list[str], records: list, name: str, block: str, args: tuple, kwargs: dict, output: Any) -> None:
    if name in running:  # the last entry of that name (a module several blocks hold has a name in each)
        del running[len(running) - 1 - running[::-1].index(name)]
    source, (result, _, _) = _first_float(args, kwargs), first_tensor(output)
    if source is not None and source.requires_grad and result is not None and result.requires_grad:
        records.append((block, name, source, result))


def _first_float(args: tuple, kwargs: dict) -> Tensor | None:
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, Tensor) and v.is_floating_point()), None)


def _mixes(source: Tensor, output: Tensor, length: int) -> bool:
    """Whether ``output`` at one position along a dimension of size ``length`` depends on ``source`` at another
    position. A pair of dimensions that are features rather than positions shows every position depending on every
    other, first and last alike, and is not taken for mixing; a module that mixes causally or over a window is."""
    if length < 3:
        return False
    every = set(range(length))
    # At least as many positions out as in: a convolution padded on both sides returns a few more.
    for out_dim in [d for d in range(1, output.dim()) if output.shape[d] >= length]:
        for in_dim in [d for d in range(1, source.dim()) if source.shape[d] == length]:
            reach = []
            for position in (0, length - 1):
                (grad,) = torch.autograd.grad(output.select(out_dim, position).sum(), source, retain_graph=True,
                                              allow_unused=True)
                if grad is None:
                    break
                moved = grad.abs().movedim(in_dim, 0).reshape(length, -1).sum(1)
                reach.append({int(p) for p in torch.nonzero(moved).flatten()})
            if len(reach) < 2 or reach == [every, every]:
                continue
            if not (reach[0] <= {0} and reach[1] <= {length - 1}):
                return True
    return False


__all__ = ["SequenceMixer", "sequence_mixers"]
