"""ZeRO-3's units run on a small copy of the model before anything trains, forward and backward, against the whole copy.

FSDP2 gathers a unit's parameters when the unit's forward starts and frees them when it ends (Rajbhandari et al.
2020, "ZeRO"; Zhao et al. 2023, "PyTorch FSDP"). What the network does outside that rhythm fails only once training
runs: a part of a block called outside the block, a parameter two units hold, a unit whose forward the step never
calls. Here a small copy (:func:`~lightning_par.parallel.small_copy.small_copy`, float64 where the model runs in it) is
cut into the run's units over its real sharding ranks and runs one sample forward and backward as the training step
calls it; its logits must be the whole copy's on that rank, and every gradient (gathered whole) the whole copy's
averaged over the sharding ranks, as FSDP2 averages them (each rank runs the first row of its own batch). It runs in
float32 (a unit that cannot run fails by an error or by O(1), not by rounding), the whole copy freed before the
sharded one is built; with one sharding rank there is nothing to check. What raises or differs is refused at set-up,
with the module that ran when it did.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.layout_check import agree_and_refuse, raised_reason, small_copy_and_sample, track_running
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.model_call import current_call, run_model
from lightning_par.parallel.model_map import ModelMap
from lightning_par.parallel.modules import clean_name, first_tensor

__all__ = ["check_sharded_units"]

_RTOL = 1e-4  # float32 rounding apart from the whole copy; a wrong unit is O(1)


def check_sharded_units(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, model_map: ModelMap,
                        inputs: Tensor, *, shard: Callable[[nn.Module], Any]) -> None:
    """Raise ``ValueError`` on every rank when a small copy of ``model`` sharded by ``shard(copy)`` (the run's ZeRO-3
    units) raises, or computes other logits or gradients than the whole copy, on the first row of ``inputs``.
    Collective over every rank."""
    if _sharding_ranks(mesh) == 1:
        return  # one rank holds every unit whole: nothing is gathered or freed
    device = torch.device(mesh.device_type)
    # Two blocks at least: FSDP2 keeps the last unit gathered for backward, so only an earlier one is freed after its
    # forward, as most of a model's blocks are. float32: what fails here fails by an error or O(1), not by rounding.
    copy = functools.partial(small_copy_and_sample, model, model_map, inputs, 1, device, min_blocks=2,
                             dtype=torch.float32)
    whole_copy, sample = copy()
    shapes = {clean_name(name): parameter.shape for name, parameter in whole_copy.named_parameters()}
    reason = None
    try:
        whole_logits, whole_gradients = _forward_and_backward(whole_copy, sample)
    except Exception:  # noqa: BLE001 - the model's own failure is not the layout's: training will report it
        whole_logits, whole_gradients = None, {}
    del whole_copy  # its gradients are kept; the sharded copy is built in its place
    ran_everywhere = torch.tensor([int(whole_logits is not None)], device=device)
    dist.all_reduce(ran_everywhere, op=dist.ReduceOp.MIN)
    if ran_everywhere.item():
        whole_gradients = _average_over(whole_gradients, shapes, mesh.group("dp_cp"), device)
        model_copy, _ = copy()
        stack: list[str] = []
        handles = track_running(model_copy, stack)
        try:
            shard(model_copy)
            logits, gradients = _forward_and_backward(model_copy, sample)
            reason = _difference(logits, gradients, whole_logits, whole_gradients, model_copy)
        except Exception as error:  # noqa: BLE001 - what the sharded copy raises is the reason it is refused
            reason = raised_reason(error, model_copy, stack)
        finally:
            for handle in handles:
                handle.remove()
    agree_and_refuse(reason, config, model, what="zero_stage=3's units")


def _average_over(gradients: dict[str, Tensor], shapes: dict[str, torch.Size], group: dist.ProcessGroup,
                  device: torch.device) -> dict[str, Tensor]:
    """The average over ``group`` of each rank's ``gradients`` (a parameter of ``shapes`` without one counts as zero),
    of the parameters that got a gradient on some rank; one all-reduce (gloo has no AVG: a sum, divided)."""
    parts = [gradients[name].reshape(-1).float() if name in gradients else torch.zeros(shape.numel(), device=device)
             for name, shape in shapes.items()]
    got_one = torch.tensor([float(name in gradients) for name in shapes], device=device)
    flat = torch.cat([*parts, got_one])
    dist.all_reduce(flat, group=group)
    *averages, got = flat.split([shape.numel() for shape in shapes.values()] + [len(shapes)])
    size = dist.get_world_size(group)
    return {name: (average / size).view(shape) for (name, shape), average, some in zip(shapes.items(), averages, got)
            if some > 0}


def _sharding_ranks(mesh: ParallelMesh) -> int:
    """How many ranks ZeRO-3 shards or replicates a unit over (``zero._fsdp_mesh``: dp_replicate x dp_shard x cp)."""
    return mesh.size("dp_replicate") * mesh.size("dp_shard_cp")


def _forward_and_backward(model_copy: nn.Module, sample: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The copy's logits on ``sample`` and the gradients of a fixed projection of them, whole, by parameter name."""
    logits, _, _ = first_tensor(_through_the_root(model_copy, sample))
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (logits * weights.to(device=logits.device, dtype=logits.dtype)).sum().backward()
    gradients = {}
    for name, parameter in model_copy.named_parameters():
        if parameter.grad is not None:
            grad = parameter.grad
            gradients[clean_name(name)] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return logits.detach(), gradients


def _through_the_root(model_copy: nn.Module, sample: Tensor) -> Any:
    """The copy run as the training step runs the model: where the step calls a submodule, through the root's own
    forward, as the strategies route the step (``strategies/steps.py``), so that the root unit's hooks run."""
    call = current_call()
    if call is None or not call.path:
        return run_model(model_copy, sample)
    model_copy.forward = lambda *_: run_model(model_copy, sample)  # an instance attribute shadows the class's
    try:
        return model_copy(sample)
    finally:
        del model_copy.forward


def _difference(logits: Tensor, gradients: dict[str, Tensor], whole_logits: Tensor,
                whole_gradients: dict[str, Tensor], model_copy: nn.Module) -> str | None:
    rtol = _RTOL
    if logits.shape != whole_logits.shape:
        return f"its logits have shape {tuple(logits.shape)}, the whole model's {tuple(whole_logits.shape)}"
    error = float((logits - whole_logits).abs().max()) / max(float(whole_logits.abs().max()), 1e-30)
    if not error <= rtol:
        return f"its logits differ from the whole model's by {error:.1e} relative on a sample"
    missing = sorted(set(whole_gradients) - set(gradients))
    if missing:
        return f"{missing[0]!r} gets no gradient"
    floor = max(float(g.abs().max()) for g in whole_gradients.values()) * 1e-6
    for name, expected in whole_gradients.items():
        got = gradients[name].to(expected.dtype)
        error = float((got - expected).abs().max()) / max(float(expected.abs().max()), floor, 1e-30)
        if not error <= rtol:
            owner = name.rpartition(".")[0]
            return f"the gradient of {name!r} ({type(model_copy.get_submodule(owner)).__name__}) differs by " \
                   f"{error:.1e} relative"
    return None
