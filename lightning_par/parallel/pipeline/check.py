"""The pipeline split run on a small copy of the model before anything trains: forward and backward through stages
on the pipeline's ranks, with the stages' real sends, held to the whole copy's logits and gradients.

A stage runs the model's own forward with the blocks of other stages skipped, and receives from the stage before
only what is sent to it: the hidden states and the values the trace found earlier blocks hand later ones
(``pipeline.handoffs``). A value the network hands on some other way (an attribute a block sets on a module, a cache
object, a global) would be dropped between stages, and the model would train silently wrong. So before training,
:func:`check_pipeline_split` cuts a small copy (``parallel.small_copy``: one block of each kind, at least two, random
weights every rank draws alike, float64 where the model runs in it) into stages at every block where a stage may
start, places them on the pipeline ranks in turn (so every boundary is a send between two ranks), runs one sample
forward and backward through them (each rank its stages; what a stage sends is what training sends), and compares
every block's hidden states, the last stage's logits and every parameter's gradient (summed over the ranks that hold
it, as the stages' ties sum it in training) with the whole copy's. A copy that raises, or differs, is refused on every
rank before the first step, naming the first block that differs or the module that raised. Its cost is a forward
and backward of the copy, twice, a traced forward, and one send each way per boundary (0.1-0.3 s at set-up for the
tiny models of the tests on 2 CPU cores); it holds one copy and its gradients at a time (the whole copy's gradients
are kept as one projection each).

The ranks stay in step whatever fails: each send says whether the stage before succeeded, a rank that fails sends
the failure on, and every rank takes part in the final comparison (``all_gather_object``), so no collective is left
waiting.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.layout_check import track_running
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.model_map import ModelMap, network_prefix
from lightning_par.parallel.model_map_check import copy_settings
from lightning_par.parallel.modules import clean_name, first_tensor
from lightning_par.parallel.pipeline.split import (StageLayout, StageModule, cut_network, receive_tensors,
                                                  send_tensors, stage_modules)
from lightning_par.parallel.pipeline.trace import NetworkTrace, output_item, trace_network
from lightning_par.parallel.small_copy import small_copy

# A faithful split differs from the whole copy by rounding (~1e-15 in float64, ~1e-6 in float32); a dropped value by
# far more (T5's position bias not carried changes block 1's hidden states by 7e-2 relative).
_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4}


def check_pipeline_split(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, model_map: ModelMap,
                         inputs: Tensor) -> None:
    """Raise ``ValueError`` on every rank when a small copy of ``model`` cut into pipeline stages computes other
    hidden states, logits or gradients than the whole copy on the first sample of ``inputs`` (see the module
    docstring), or raises. Collective over every rank; pipeline ranks exchange point-to-point."""
    device = torch.device(mesh.device_type)
    vocabulary, sample, dtype = copy_settings(model, model_map, inputs[:1], mesh.size("tp"), device)
    sample = sample.to(device)
    sample = sample.to(dtype) if sample.is_floating_point() else sample

    def make_copy() -> nn.Module:
        return small_copy(model, model_map.blocks, device, dtype, min_blocks=2, vocabulary=vocabulary)

    found = _check(make_copy, mesh, model_map, sample)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    found = min((f for f in everyone if f is not None), default=None)  # the earliest block that differs, say
    if found is not None:
        raise ValueError(f"{config.named_sizes()} does not compute what {type(model).__name__} computes: {found[2]}. "
                         "Checked on a small copy of the model cut into pipeline stages before training "
                         "(docs/pipeline_parallel.md)")


# (what: 0 a stage raises in forward, 1 a block's output differs, 2 a stage raises in backward, 3 the logits differ,
# 4 a gradient; the block; the reason): the earliest in a forward and backward is the one to name.
Found = tuple[int, int, str]


def _check(make_copy: Callable[[], nn.Module], mesh: ParallelMesh, model_map: ModelMap,
           sample: Tensor) -> Found | None:
    """What differs between stages cut from a copy (``make_copy()``, the same on every call) and a whole copy on
    ``sample``, on this rank; None where nothing does, and where the copy cannot be checked (a model that fails whole,
    or that the trace refuses, is refused by training's own set-up). The whole run, the trace and the stages each get
    a copy of their own: what a forward leaves on a module (a value a block stores for later blocks) must not reach
    the stages' copy, where it would hide that the value does not cross. The pipeline ranks agree to go on before the
    stages send anything, so that one that could not prepare (out of memory, say) leaves none waiting."""
    try:
        prepared = _prepare(make_copy, mesh, model_map, sample)
    except Exception:  # noqa: BLE001 - the model's own failure, or a split the split itself refuses (and names)
        prepared = None
    agreed = torch.tensor([prepared is not None], dtype=torch.int64, device=torch.device(mesh.device_type))
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=mesh.group("pp"))
    if not int(agreed):
        return None
    whole, model_copy, trace, layout, starts, placement = prepared
    blocks = list(layout.block_names)
    me = mesh.local_rank("pp")
    mine = [block for stage, (first, end) in enumerate(zip([0, *starts], [*starts, len(blocks)]))
            if placement[stage] == me for block in range(first, end)]
    staged_outputs: dict[int, Any] = {}
    running: list[str] = []
    # Before the stages' own hooks, which stop a stage inside its last block's forward hooks.
    handles = _keep_outputs(model_copy, blocks, mine, staged_outputs) + track_running(model_copy, running)
    try:
        stages = stage_modules(model_copy, layout, sample.device)
        failure, backward_failure, staged_logits = _run(stages, placement, mesh, sample, whole.weights, running)
    finally:
        for handle in handles:
            handle.remove()
    gradients = _compare_gradients(model_copy, whole.canonical, whole.gradients, mesh)  # every rank, whatever failed
    where = f"on a copy cut into stages at {', '.join(repr(blocks[s]) for s in starts)}"
    if failure is not None:
        return (0, 0, f"{where}, {failure}") if failure else None
    index = trace.block_call.output_index
    for block in (b for b in mine if b in staged_outputs):
        differs = _differs(output_item(staged_outputs[block], index), output_item(whole.outputs[block], index))
        if differs is not None:
            kind = type(model_copy.get_submodule(blocks[block])).__name__
            return 1, block, (f"{where}, block {blocks[block]!r} ({kind}) computes other hidden states than in the "
                              f"whole model ({differs}): it receives something the stages before it do not send, a "
                              "value earlier blocks hand it some other way than in their outputs or a dict the blocks "
                              "share (an attribute of a module, a cache object). Return the value from the block that "
                              "computes it, for the network to hand on, or keep it in a dict every block receives: "
                              "both cross stage boundaries. Or train this model without pipeline parallel")
    if backward_failure is not None:
        return (2, 0, f"{where}, in backward {backward_failure}") if backward_failure else None
    if staged_logits is not None:
        differs = _differs(staged_logits, whole.logits)
        if differs is not None:
            return 3, 0, f"{where}, its logits differ from the whole model's ({differs})"
    if gradients is not None:
        name, differs = gradients
        return 4, 0, (f"{where}, the gradient of {name} differs from the whole model's ({differs}): a value a later "
                      "stage receives carries no gradient back to the blocks that computed it")
    return None


@dataclass
class _Whole:
    """What the whole copy computed: its logits, every block's output, each parameter's gradient projected (by its
    first name: ``canonical`` maps every name to it), and the weights the logits were summed with for backward."""

    logits: Tensor
    outputs: dict[int, Any]
    gradients: dict[str, tuple[float, float]]
    canonical: dict[str, str]
    weights: Tensor


def _prepare(make_copy: Callable[[], nn.Module], mesh: ParallelMesh, model_map: ModelMap,
             sample: Tensor) -> tuple[_Whole, nn.Module, NetworkTrace, StageLayout, list[int], dict[int, int]] | None:
    """The whole copy's run, the trace of another, and a third cut into stages (this rank's kept), placed on the
    pipeline ranks in turn; None where no stage can start after the first block. Local to this rank."""
    prefix = network_prefix(model_map)
    whole_copy = make_copy()
    blocks = model_map.block_names(whole_copy)
    outputs: dict[int, Any] = {}
    handles = _keep_outputs(whole_copy, blocks, range(len(blocks)), outputs)
    try:
        logits = _logits(whole_copy(sample))
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        weights = weights.to(device=logits.device, dtype=logits.dtype)
        (logits * weights).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    # A parameter under several names (a tied head) is one gradient, under its first name; after the cut a rank may
    # know it by another.
    canonical: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, parameter in whole_copy.named_parameters(remove_duplicate=False):
        canonical[clean_name(name)] = first.setdefault(id(parameter), clean_name(name))
    whole = _Whole(logits.detach(), outputs, _projected_gradients(whole_copy, canonical), canonical, weights)
    del whole_copy, logits  # the logits' graph would keep the copy's parameters
    traced = make_copy()
    trace = trace_network(traced.get_submodule(prefix.rstrip(".")) if prefix else traced, blocks, sample, root=traced)
    del traced
    starts = _stage_starts(trace, len(blocks))
    if not starts:
        return None
    model_copy = make_copy()
    sizes = [b - a for a, b in zip([0, *starts], [*starts, len(blocks)])]
    placement = {stage: stage % mesh.size("pp") for stage in range(len(sizes))}  # consecutive stages: other ranks
    layout = cut_network(model_copy, mesh, model_map, trace, schedule="1f1b", virtual_stages=1, sizes=sizes,
                         placement=placement)
    return whole, model_copy, trace, layout, starts, placement


def _keep_outputs(model_copy: nn.Module, blocks: list[str], indices: Iterable[int],
                  outputs: dict[int, Any]) -> list[Any]:
    """Forward hooks that keep the output of each block of ``indices`` in ``outputs``, detached (a graph would keep
    the copy's parameters)."""
    def keep(index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            items = output.to_tuple() if hasattr(output, "to_tuple") else output
            outputs[index] = (tuple(t.detach() if isinstance(t, Tensor) else t for t in items)
                              if isinstance(items, (tuple, list)) else items.detach())
        return hook

    return [model_copy.get_submodule(blocks[i]).register_forward_hook(keep(i)) for i in indices]


def _stage_starts(trace: NetworkTrace, n_blocks: int) -> list[int]:
    """Every block a stage may start at: not after code that runs between two blocks, not between the writer and a
    reader of a value that cannot cross."""
    return [i for i in range(1, n_blocks) if i not in trace.changed
            and not any(v.writer < i <= v.last_reader for v in trace.handoffs.uncarried)]


def _run(stages: dict[int, StageModule], placement: dict[int, int], mesh: ParallelMesh, sample: Tensor,
         weights: Tensor, running: list[str]) -> tuple[str | None, str | None, Tensor | None]:
    """Forward, then backward, of ``sample`` through the stages in order, each on its rank (``placement``), sending
    between ranks what training sends, and backward from ``(logits * weights).sum()``. Returns why the forward and
    why the backward failed on this rank ("" where a stage on another rank failed first: that rank says why; None
    where nothing failed) and, on the last stage's rank, the logits. ``running``: the modules running, innermost last
    (``track_running``)."""
    group, me, last = mesh.group("pp"), mesh.local_rank("pp"), len(placement) - 1

    def peer(stage: int) -> int:
        return dist.get_global_rank(group, placement[stage])

    failure: str | None = None
    received: dict[int, tuple[Tensor, ...]] = {}
    sent: dict[int, tuple[Tensor, ...]] = {}
    for stage in range(last + 1):
        if placement[stage] != me:
            continue
        values = (sample,) if stage == 0 else receive_tensors(peer(stage - 1), sample.device)
        if values is None:  # a stage before failed: pass it on
            failure = failure or ""
        elif failure is None:
            if stage > 0:
                values = tuple(v.requires_grad_(True) if v.is_floating_point() else v for v in values)
                received[stage] = values
            running.clear()  # a stage before stopped inside its last block, whose hooks did not see it leave
            try:
                output = stages[stage](*values, tokens=sample)
            except Exception as error:  # noqa: BLE001 - what a stage raises is the reason the split is refused
                failure = _raised(error, stages[stage], running)
            else:
                sent[stage] = output if isinstance(output, tuple) else (output,)
        if stage < last:
            send_tensors(None if failure is not None else sent[stage], peer(stage + 1))
    logits = None
    if failure is None and placement[last] == me:
        logits = _logits(sent[last])
        sent[last] = ((logits * weights).sum(),)
        logits = logits.detach()
    forward_failure = failure
    for stage in range(last, -1, -1):
        if placement[stage] != me:
            continue
        gradients = None if stage == last else receive_tensors(peer(stage + 1), sample.device)
        if stage < last and gradients is None:
            failure = failure or ""
        if failure is None:
            outputs = [t for t in sent[stage] if t.requires_grad]
            grads = None if stage == last else [g for t, g in zip(_floating(sent[stage]), gradients)
                                                if t.requires_grad]
            try:
                if outputs:
                    torch.autograd.backward(outputs, grads)
            except Exception as error:  # noqa: BLE001 - as in forward
                failure = _raised(error, stages[stage], [])
        if stage > 0:
            inputs = _floating(received.get(stage, ()))
            send_tensors(None if failure is not None else
                         tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs),
                         peer(stage - 1))
    return forward_failure, None if failure == forward_failure else failure, logits


def _floating(values: tuple[Tensor, ...]) -> list[Tensor]:
    return [v for v in values if v.is_floating_point()]


def _projected_gradients(model_copy: nn.Module, canonical: dict[str, str]) -> dict[str, tuple[float, float]]:
    """Each parameter's gradient, by its ``canonical`` name, as (its projection on a random direction drawn from that
    name, its norm): two numbers that tell gradients apart (a projection moves by about the norm of any difference),
    where keeping the gradients themselves would hold another copy of the blocks. A parameter without a gradient
    projects to 0."""
    projected: dict[str, tuple[float, float]] = {}
    seen: set[int] = set()
    for name, parameter in model_copy.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        name = canonical.get(clean_name(name), clean_name(name))
        grad = parameter.grad
        if grad is None:
            projected[name] = (0.0, 0.0)
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        direction = torch.randn(grad.shape, generator=generator, dtype=torch.float64).to(grad.device, grad.dtype)
        projected[name] = (float((grad.detach() * direction).sum()), float(grad.detach().norm()))
    return projected


def _compare_gradients(model_copy: nn.Module, canonical: dict[str, str], whole: dict[str, tuple[float, float]],
                       mesh: ParallelMesh) -> tuple[str, str] | None:
    """Every parameter's gradient, summed over the pipeline ranks (each holds the gradients of its stages, and
    projections add up as gradients do), against the whole copy's: the first that differs and by how much, or None.
    Collective over the pipeline ranks."""
    names = [name for name, (_, norm) in whole.items() if norm > 0]
    if not names:
        return None
    mine = _projected_gradients(model_copy, canonical)
    projections = torch.tensor([mine.get(name, (0.0, 0.0))[0] for name in names], dtype=torch.float64,
                               device=torch.device(mesh.device_type))
    dist.all_reduce(projections, group=mesh.group("pp"))
    # Relative to each gradient's norm, and at least to a millionth of the largest: a gradient that is zero in exact
    # arithmetic (a key bias's) is rounding-sized in both runs.
    floor = 1e-6 * max(norm for _, norm in whole.values())
    rtol = _RTOL[torch.float64] if all(p.dtype == torch.float64 for p in model_copy.parameters()) else \
        _RTOL[torch.float32]
    for name, staged in zip(names, projections.tolist()):
        expected, norm = whole[name]
        error = abs(staged - expected) / max(norm, floor)
        if not error <= rtol:
            return name, f"by {error:.1e} relative"
    return None


def _differs(actual: Tensor, expected: Tensor) -> str | None:
    """How ``actual`` differs from ``expected``, beyond rounding; None where it does not."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, the whole model's {tuple(expected.shape)}"
    actual, expected = actual.detach(), expected.detach()
    scale = max(float(expected.abs().max()), 1e-30)
    error = float((actual - expected).abs().max()) / scale
    return None if error <= _RTOL.get(expected.dtype, 1e-4) else f"by {error:.1e} relative"


def _raised(error: Exception, stage: StageModule, running: list[str]) -> str:
    """What a stage raised, in the module that was running (innermost)."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    where = ""
    if running:
        where = f" in {running[-1]!r} ({type(stage.model.get_submodule(running[-1])).__name__})"
        running.clear()
    return f"a stage raises{where} {type(error).__name__}: {first_line}"


def _logits(output: Any) -> Tensor:
    logits, _, _ = first_tensor(output)
    return logits


__all__ = ["check_pipeline_split"]
