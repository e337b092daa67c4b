"""The layout run on a small copy of the model before anything trains, so that what cannot run under it, or computes
something else, is refused at set-up with the module and the reason, not in training step 0.

The tensor-parallel split has a check of its own, which also settles the model map
(:mod:`~lightning_par.parallel.model_map_check`). :func:`check_layout_forward` runs what the layout changes inside the
model on top of it: context parallel (each rank's chunk of the sequence, attention routed over the ranks), expert
parallel (experts split, tokens sent to the ranks of their experts) and sequence parallel's routing of this rank's
tokens, with the layout's own collectives, on a small copy (:func:`~lightning_par.parallel.small_copy.small_copy`,
float64 where the model runs in it) and one sample of the data. Its logits must be the whole copy's; a model whose
blocks mix the sequence some other way than through ``F.scaled_dot_product_attention`` (eager attention with a mask of
the whole sequence, a convolution or recurrence along it) is refused under context parallel, naming the block and the
attention implementation.

:func:`check_routing_draws` refuses a mixture-of-experts layer that draws random numbers in training (sampled routing
such as PhiMoE's sparsemixer, router jitter) where the layout routes other sets of tokens at once than one process
does: each rank would draw from its own stream, and the model would train on other routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.experts import moe_layers
from lightning_par.parallel.model_map import ModelMap
from lightning_par.parallel.model_map_check import copy_settings
from lightning_par.parallel.modules import first_tensor
from lightning_par.parallel.small_copy import small_copy

# A faithful layout differs from the whole copy by rounding (~1e-15 in float64, ~1e-6 in float32); a wrong one by
# O(0.1).
_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4}


def check_layout_forward(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, model_map: ModelMap,
                         inputs: Tensor, *, apply: Callable[[nn.Module], None]) -> None:
    """Raise ``ValueError`` on every rank when the small copy of ``model``, laid out by ``apply(copy)`` (the layout's
    tensor, context and expert parallel, as training applies them), raises or computes other logits than the whole copy
    on ``inputs`` (a micro-batch of the model's own inputs; its first row is used). Collective over every rank."""
    device = torch.device(mesh.device_type)
    model_copy, sample = _small_copy_and_sample(model, model_map, inputs, mesh.size("tp"), device)
    reason = None
    with torch.no_grad():
        try:
            whole = _logits(model_copy(sample))
        except Exception:  # noqa: BLE001 - the model's own failure is not the layout's: training will report it
            whole = None
        if whole is not None:
            attending = _blocks_calling_attention(model_copy, model_map, sample)
            stack: list[str] = []
            handles = track_running(model_copy, stack)
            try:
                apply(model_copy)
                laid_out = _logits(model_copy(sample))
                if laid_out.shape != whole.shape:
                    reason = f"its logits have shape {tuple(laid_out.shape)}, the whole model's {tuple(whole.shape)}"
                else:
                    error = float((laid_out - whole).abs().max()) / max(float(whole.abs().max()), 1e-30)
                    if not error <= _RTOL[whole.dtype]:
                        reason = f"its logits differ from the whole model's by {error:.1e} relative on a sample"
            except ValueError as refusal:  # a refusal of the layout's own, which names the value and what fits
                reason = f"!{refusal}"
            except Exception as error:  # noqa: BLE001 - what the laid-out copy raises is the reason it is refused
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
                where = f" in {stack[-1]!r} ({type(model_copy.get_submodule(stack[-1])).__name__})" if stack else ""
                reason = f"it raises{where} {type(error).__name__}: {first_line}"
            finally:
                for handle in handles:
                    handle.remove()
            if reason is not None and config.cp > 1:
                reason += _attention_hint(model, model_map, attending)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, reason)
    reason = next((r for r in everyone if r is not None), None)
    if reason is None:
        return
    if reason.startswith("!"):
        raise ValueError(reason[1:])
    raise ValueError(f"{config.named_sizes()} does not compute what {type(model).__name__} computes: {reason}. "
                     "Checked on a small copy of the model before training (docs/models.md)")


def _small_copy_and_sample(model: nn.Module, model_map: ModelMap, inputs: Tensor, tp: int,
                           device: torch.device) -> tuple[nn.Module, Tensor]:
    """A small copy of ``model`` (its vocabulary cut where the model allows, float64 where it runs in it) and the
    first row of ``inputs`` as it takes it."""
    vocabulary, sample, dtype = copy_settings(model, model_map, inputs[:1], tp, device)
    sample = sample.to(device)
    sample = sample.to(dtype) if sample.is_floating_point() else sample
    return small_copy(model, model_map.blocks, device, dtype, vocabulary=vocabulary), sample


def _logits(output: Any) -> Tensor:
    logits, _, _ = first_tensor(output)
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def track_running(model: nn.Module, stack: list[str]) -> list[Any]:
    """Forward hooks that keep ``stack`` the path of the modules running, innermost last."""
    def enter(name: str) -> None:
        stack.append(name)

    def leave(name: str) -> None:  # returns None: a forward hook's value would replace the module's output
        if stack and stack[-1] == name:
            stack.pop()

    handles = []
    for name, sub in model.named_modules():
        if name:
            handles.append(sub.register_forward_pre_hook(lambda m, a, n=name: enter(n)))
            handles.append(sub.register_forward_hook(lambda m, a, o, n=name: leave(n)))
    return handles


class _CountAttention(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _blocks_calling_attention(model: nn.Module, model_map: ModelMap, sample: Tensor) -> dict[str, bool]:
    """Whether each block of the whole copy calls ``F.scaled_dot_product_attention`` (what context parallel routes)."""
    called: dict[str, bool] = {}
    handles = []
    for name in model_map.block_names(model):
        counter = _CountAttention()
        block = model.get_submodule(name)

        def leave(counter: _CountAttention, name: str) -> None:
            counter.__exit__(None, None, None)
            called[name] = counter.calls > 0

        handles.append(block.register_forward_pre_hook(lambda m, a, c=counter: c.__enter__() and None))
        handles.append(block.register_forward_hook(lambda m, a, o, c=counter, n=name: leave(c, n)))
    try:
        model(sample)
    except Exception:  # noqa: BLE001 - only a hint for the refusal
        pass
    finally:
        for handle in handles:
            handle.remove()
    return called


def _attention_hint(model: nn.Module, model_map: ModelMap, attending: dict[str, bool]) -> str:
    silent = [name for name, calls in attending.items() if not calls]
    if not silent:
        return ""
    kind = type(model.get_submodule(silent[0])).__name__
    implementation = next((getattr(sub.config, "_attn_implementation", None) for sub in model.modules()
                           if getattr(getattr(sub, "config", None), "_attn_implementation", None)), None)
    how = f" (attn_implementation={implementation!r})" if implementation else ""
    return (f". Block {silent[0]!r} ({kind}) mixes the sequence without F.scaled_dot_product_attention{how}: context "
            "parallel routes only that call over the ranks, so another attention (eager, with a mask of the whole "
            "sequence) or a recurrence along the sequence sees this rank's chunk alone. Load the model with "
            "attn_implementation='sdpa' where it supports it (a model whose attention needs eager, for soft-capping "
            "or attention sinks, cannot use context parallel), or set context_parallel_size=1")


# ------------------------------------------------------------------------------------------------ routing draws
def check_routing_draws(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, model_map: ModelMap,
                        inputs: Tensor) -> None:
    """Raise ``ValueError`` when an MoE layer of ``model`` draws random numbers in training and the layout routes other
    sets of tokens at once than one process (several data-parallel or context-parallel ranks, sequence parallel,
    pipeline micro-batches). Local and alike on every rank: a training-mode forward of a small copy, watching the
    random generator's state around each MoE layer."""
    splits_tokens = (mesh.size("dp_cp") > 1 or (config.tp > 1 and config.sequence_parallel) or config.pp > 1)
    if not splits_tokens or not moe_layers(model, model_map):  # no small copy to build for a dense model
        return
    device = torch.device(mesh.device_type)
    model_copy, sample = _small_copy_and_sample(model, model_map, inputs, mesh.size("tp"), device)
    layers = moe_layers(model_copy, model_map)
    if not layers:
        return
    drawing: list[str] = []

    def state() -> Tensor:
        return torch.cuda.get_rng_state() if device.type == "cuda" else torch.get_rng_state()

    handles = []
    for name in layers:
        before: list[Tensor] = []
        layer = model_copy.get_submodule(name)
        handles.append(layer.register_forward_pre_hook(lambda m, a, b=before: b.append(state())))
        handles.append(layer.register_forward_hook(
            lambda m, a, o, b=before, n=name: drawing.append(n) if not torch.equal(b.pop(), state()) else None))
    model_copy.train()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            model_copy(sample)
    except Exception:  # noqa: BLE001 - the model's own failure: training will report it
        return
    finally:
        for handle in handles:
            handle.remove()
    if drawing:
        name = drawing[0]
        raise ValueError(
            f"{type(model_copy.get_submodule(name)).__name__} {name!r} draws random numbers in training (sampled "
            f"routing such as sparsemixer, or router jitter), and {config.named_sizes()} routes other sets of tokens "
            "at once than one process: each rank would draw from its own stream, and the model would train on other "
            "routes than one process. Turn the draws off in the model's config where it has a setting (router jitter "
            "0), or train it on one process (docs/expert_parallel.md)")


__all__ = ["check_layout_forward", "check_routing_draws", "track_running"]
