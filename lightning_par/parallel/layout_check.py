"""The layout run on a small copy of the model before anything trains, so that what cannot run under it, or computes
something else, is refused at set-up with the module and the reason, not in training step 0.

The tensor-parallel split has a check of its own, which also settles the model map
(:mod:`~lightning_par.parallel.model_map_check`). :func:`check_layout_forward` runs what the layout changes inside the
model on top of it: context parallel (each rank's chunk of the sequence, attention routed over the ranks), expert
parallel (experts split, tokens sent to the ranks of their experts) and sequence parallel's routing of this rank's
tokens, with the layout's own collectives, on a small copy (:func:`~lightning_par.parallel.small_copy.small_copy`,
float64 where the model runs in it) and one sample of the data. Its logits must be the whole copy's; a model whose
blocks mix the sequence some other way than through ``F.scaled_dot_product_attention`` is refused under context
parallel naming the module that does (:mod:`~lightning_par.parallel.sequence_mixing`) and why: attention written out
(eager, with a mask of the whole sequence), with the attention implementation to load instead, or a convolution or
recurrence along the sequence, which context parallel cannot split.

:func:`check_routing_draws` refuses a mixture-of-experts layer that draws random numbers in training (sampled routing
such as PhiMoE's sparsemixer, router jitter) where the layout routes other sets of tokens at once than one process
does: each rank would draw from its own stream, and the model would train on other routes. :func:`draws_in_training`
tells whether a model draws random numbers in training at all (dropout), for the dropout streams of ``rng``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.experts import moe_layers
from lightning_par.parallel.model_map import ModelMap
from lightning_par.parallel.model_map_check import copy_settings
from lightning_par.parallel.modules import first_tensor
from lightning_par.parallel.sequence_mixing import sequence_mixers
from lightning_par.parallel.small_copy import small_copy
from lightning_par.parallel.model_call import run_model

# A faithful layout differs from the whole copy by rounding (~1e-15 in float64, ~1e-6 in float32); a wrong one by
# O(0.1).
_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4}


def check_layout_forward(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, model_map: ModelMap,
                         inputs: Tensor, *, apply: Callable[[nn.Module], None]) -> None:
    """Raise ``ValueError`` on every rank when the small copy of ``model``, laid out by ``apply(copy)`` (the layout's
    tensor, context and expert parallel, as training applies them), raises or computes other logits than the whole copy
    on ``inputs`` (a micro-batch of the model's own inputs; its first row is used). Collective over every rank."""
    device = torch.device(mesh.device_type)
    model_copy, sample = small_copy_and_sample(model, model_map, inputs, mesh.size("tp"), device)
    reason = None
    with torch.no_grad():
        try:
            whole = _logits(run_model(model_copy, sample))
        except Exception:  # noqa: BLE001 - the model's own failure is not the layout's: training will report it
            whole = None
        if whole is not None:
            stack: list[str] = []
            handles = track_running(model_copy, stack)
            try:
                apply(model_copy)
                laid_out = _logits(run_model(model_copy, sample))
                if laid_out.shape != whole.shape:
                    reason = f"its logits have shape {tuple(laid_out.shape)}, the whole model's {tuple(whole.shape)}"
                else:
                    error = float((laid_out - whole).abs().max()) / max(float(whole.abs().max()), 1e-30)
                    if not error <= _RTOL[whole.dtype]:
                        reason = f"its logits differ from the whole model's by {error:.1e} relative on a sample"
            except Exception as error:  # noqa: BLE001 - what the laid-out copy raises is the reason it is refused
                reason = raised_reason(error, model_copy, stack)
            finally:
                for handle in handles:
                    handle.remove()
            if reason is not None and config.cp > 1:
                reason += _mixing_hint(model, model_map, inputs, config, device)
    agree_and_refuse(reason, config, model)


def agree_and_refuse(reason: str | None, config: ParallelConfig, model: nn.Module, *, what: str | None = None) -> None:
    """Raise the same ``ValueError`` on every rank when any rank found a ``reason`` (the first rank's that did): the
    layout (``what``: a part of it) does not compute what ``model`` computes. A reason that starts with ``!`` is a
    refusal of the layout's own, raised as it is. Collective over every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, reason)
    reason = next((r for r in everyone if r is not None), None)
    if reason is None:
        return
    if reason.startswith("!"):
        raise ValueError(reason[1:])
    raise ValueError(f"{what or config.named_sizes()} {'do' if what else 'does'} not compute what "
                     f"{type(model).__name__} computes: {reason}. Checked on a small copy of the model before training "
                     "(docs/models.md)")


def raised_reason(error: Exception, model_copy: nn.Module, stack: list[str]) -> str:
    """The reason a laid-out copy is refused when it raised ``error`` while the modules of ``stack`` ran
    (:func:`track_running`): a ``ValueError`` is a refusal of the layout's own, which names the value and what fits,
    raised as it is (:func:`agree_and_refuse`); anything else, with the innermost module that ran."""
    if isinstance(error, ValueError):
        return f"!{error}"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    where = f" in {stack[-1]!r} ({type(model_copy.get_submodule(stack[-1])).__name__})" if stack else ""
    return f"it raises{where} {type(error).__name__}: {first_line}"


def small_copy_and_sample(model: nn.Module, model_map: ModelMap, inputs: Tensor, tp: int, device: torch.device, *,
                          min_blocks: int = 1, dtype: torch.dtype | None = None) -> tuple[nn.Module, Tensor]:
    """A small copy of ``model`` (its vocabulary cut where the model allows; in ``dtype``, by default float64 where it
    runs in it; at least ``min_blocks`` blocks) and the first row of ``inputs`` as it takes it."""
    vocabulary, sample, found = copy_settings(model, model_map, inputs[:1], tp, device)
    dtype = dtype or found
    sample = sample.to(device)
    sample = sample.to(dtype) if sample.is_floating_point() else sample
    return small_copy(model, model_map.blocks, device, dtype, vocabulary=vocabulary, min_blocks=min_blocks), sample


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


def _mixing_hint(model: nn.Module, model_map: ModelMap, inputs: Tensor, config: ParallelConfig,
                 device: torch.device) -> str:
    """Why context parallel cannot run a block of ``model``: the module that mixes the tokens without
    F.scaled_dot_product_attention (``sequence_mixing``), found on a fresh whole copy; empty where there is none."""
    model_copy, sample = small_copy_and_sample(model, model_map, inputs, config.tp, device)
    mixers = sequence_mixers(model_copy, model_map.block_names(model_copy), lambda: run_model(model_copy, sample))
    if not mixers:
        return ""
    mixer = next(iter(mixers.values()))
    block = f"Block {mixer.block!r} ({type(model_copy.get_submodule(mixer.block)).__name__})"
    unsplit = "set cp=1"
    if mixer.softmax:  # attention written out: the model may run it through SDPA instead
        implementation = next((getattr(sub.config, "_attn_implementation", None) for sub in model.modules()
                               if getattr(getattr(sub, "config", None), "_attn_implementation", None)), None)
        how = f" (attn_implementation={implementation!r})" if implementation else ""
        return (f". {block} mixes the sequence without F.scaled_dot_product_attention{how} in {mixer.module!r} "
                f"({mixer.kind}): context parallel routes only that call over the ranks, so attention written "
                "out (eager, with a mask of the whole sequence) sees this rank's chunk alone. Load the model with "
                "attn_implementation='sdpa' where it supports it (a model whose attention needs eager, for "
                f"soft-capping or attention sinks, cannot use context parallel), or {unsplit}")
    return (f". {block} mixes the tokens through {mixer.module!r} ({mixer.kind}), a convolution or recurrence along "
            "the sequence, not attention: context parallel splits the sequence over the ranks and routes only "
            f"F.scaled_dot_product_attention between them, so {mixer.module!r} would see this rank's chunk alone, "
            "whatever the attention implementation. Context parallel cannot split this model: "
            f"{unsplit} (data, tensor and pipeline parallel and ZeRO keep each sequence whole)")


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
    model_copy, sample = small_copy_and_sample(model, model_map, inputs, mesh.size("tp"), device)
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
            run_model(model_copy, sample)
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


def draws_in_training(model: nn.Module, mesh: ParallelMesh, model_map: ModelMap, inputs: Tensor) -> bool:
    """Whether a training-mode forward of ``model`` draws random numbers (dropout, ``dropout_p`` of attention, any
    other draw from the default generators): one forward of a small copy on the first row of ``inputs``, watching
    the CPU's and the device's generator. A copy that cannot run counts as drawing. Local and alike on every rank;
    the generators are left as they were."""
    device = torch.device(mesh.device_type)
    accelerator = [device] if device.type != "cpu" else []

    def states() -> list[Tensor]:
        return [torch.get_rng_state()] + ([torch.get_device_module(device).get_rng_state()] if accelerator else [])

    # The copy is built inside too: a model built on the meta device is initialised by it, which draws.
    with torch.random.fork_rng(devices=accelerator, device_type=device.type), torch.no_grad():
        try:
            model_copy, sample = small_copy_and_sample(model, model_map, inputs, mesh.size("tp"), device)
            model_copy.train()
            before = states()
            run_model(model_copy, sample)
        except Exception:  # noqa: BLE001 - the model's own failure: training will report it
            return True
        return not all(torch.equal(b, a) for b, a in zip(before, states()))


__all__ = ["agree_and_refuse", "check_layout_forward", "check_routing_draws", "draws_in_training",
           "raised_reason", "small_copy_and_sample", "track_running"]
