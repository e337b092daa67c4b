"""Pipeline parallelism: consecutive blocks form stages on different ranks; micro-batches flow through.

GPipe (Huang et al. 2019) runs all forwards then all backwards; 1F1B (PipeDream-Flush, Narayanan et
al. 2021) alternates them so at most ``pp`` micro-batches are in flight; interleaved 1F1B (Narayanan et
al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") gives each
rank ``v`` smaller stages (rank ``r`` holds stages ``r, r + pp, ...``), dividing the bubble by ``v``;
ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism") places two stages per rank in a V (rank ``r``
holds ``r`` and ``2pp - 1 - r``) and fills the bubble with the weight-gradient halves of backward. The
schedules and stage communication are PyTorch's ``torch.distributed.pipelining`` (each schedule's facts, its
torch class among them, are a row of ``lightning_par.layout.schedules.SCHEDULES``); this module decides where the
stages are and builds them from the model map.

How a stage is made, without model-specific code: every stage runs the model's own forward over a view
of it in which the network (the module holding the map's blocks) has the blocks the stage does not own skipped. What runs outside the blocks is found
by tracing one forward (``lightning_par.parallel.pipeline.trace``): stage 0 runs the code before the first
block (embedding, positions, scaling); a later stage runs the same code on stand-ins that hold no weights
(zeros for an embedding), only for the tensors every block takes beside the hidden states (rotary tables,
masks), and a hook swaps its first block's hidden-state input for the activations it received; a stage
that is not the last stops right after its last block, so the final norm, the head and whatever follows
them (soft-capping) run once, on the last stage. Every stage receives the micro-batch's tokens as a keyword
argument for that purpose. What blocks hand later blocks beside the hidden states (a position bias a block returns,
keys and values written into a dict the blocks share) is sent after the hidden states and given back to the
network's loop on the next stage (``lightning_par.parallel.pipeline.carry``). Parameter names do not change, so
optimizers and checkpoints see the usual names, each rank holding only its stages' parameters; a parameter several
stages use (a head tied to the embedding) is held by each of them and kept equal
(``lightning_par.parallel.pipeline.ties.StageTies``).
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.pipeline.trace import (
    Call,
    NetworkTrace,
    StandIn,
    first_tensor,
    output_item,
    trace_network,
)
from lightning_par.parallel.model_map import ModelMap, network_prefix, why_no_blocks
from lightning_par.parallel.pipeline.carry import Carrier, active as active_carrier, skipped_output
from lightning_par.parallel.pipeline.handoffs import Carried
from lightning_par.parallel.small_copy import small_copy
from lightning_par.parallel.modules import clean_name
from lightning_par.layout.schedules import (SCHEDULES, Schedule, balance, stage_indices, stages_per_rank,
                                           too_few_microbatches)
from lightning_par.layout.config import ParallelConfig
from lightning_par.layout.zero_stages import ZERO_STAGE_ROWS


def check_weight_pass_with_zero3(schedule: Schedule, zero_stage: int) -> None:
    """ZB-V and DualPipeV compute weight gradients in a pass of their own after the input gradients (Qi et al.
    2024), so under ZeRO-3 FSDP2 must reduce-scatter a stage's gradients only after its last weight pass. torch's
    pipeline runtime does: each stage backward runs with FSDP2's gradient sync off, and the schedule adds a
    REDUCE_GRAD action after the stage's last weight pass (``PipelineStage.perform_reduce_grad``). A torch without
    it would reduce incomplete gradients, so the pair is refused there, naming the limitation."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    splits = ZERO_STAGE_ROWS[zero_stage].shards_parameters and SCHEDULES[schedule].splits_backward
    if splits and not hasattr(_PipelineStageBase, "perform_reduce_grad"):
        raise ValueError(f"pipeline_schedule={schedule!r} with zero_stage=3 needs torch's pipeline runtime to "
                         "reduce FSDP2's gradients after each stage's last weight-gradient pass "
                         f"(PipelineStage.perform_reduce_grad), which torch {torch.__version__} lacks; use "
                         "pipeline_schedule 1f1b or interleaved_1f1b with zero_stage=3, or a newer torch")


# ------------------------------------------------------------------------------------ placement
def check_microbatches(config: ParallelConfig, batch_size: int | None = None) -> None:
    """Raise ``ValueError`` naming the values when the config's micro-batches do not fit its schedule or the batch."""
    n_microbatches = config.microbatches
    too_few = too_few_microbatches(n_microbatches, config.pp_schedule, config.pp, config.pp_virtual_stages,
                                   named=config.named)
    if too_few:
        raise ValueError(too_few)
    if batch_size is not None and batch_size % n_microbatches != 0:
        raise ValueError(f"a batch of {batch_size} samples does not split into microbatches={config.microbatches!r}; "
                         f"use a batch size divisible by {n_microbatches}, and a loader that leaves out a partial "
                         "last batch (DataLoader(drop_last=True))")


# ------------------------------------------------------------------------------------ balancing
def sizes_from_split_points(block_names: list[str], split_points: Sequence[str], n_stages: int) -> list[int]:
    """Blocks per stage when the user names the blocks that start stages 1..n_stages-1."""
    if len(split_points) != n_stages - 1:
        raise ValueError(f"{n_stages} stages need {n_stages - 1} split points, got {len(split_points)}: "
                         f"{list(split_points)}")
    starts = [0]
    for name in split_points:
        if name not in block_names:
            raise ValueError(f"split point {name!r} is not a block; blocks are {block_names[0]!r} .. "
                             f"{block_names[-1]!r}")
        starts.append(block_names.index(name))
    if starts != sorted(set(starts)):
        raise ValueError(f"split points {list(split_points)} must name distinct blocks in order, after the first")
    starts.append(len(block_names))
    return [b - a for a, b in zip(starts, starts[1:])]


def parameter_costs(module: nn.Module, model_map: ModelMap) -> tuple[list[float], float, float]:
    """(per-block, first-stage extra, last-stage extra) costs as parameter counts."""
    def count(name: str | None) -> float:
        return 0.0 if name is None else float(sum(p.numel() for p in module.get_submodule(name).parameters()))

    blocks = [count(name) for name in model_map.block_names(module)]
    return blocks, count(model_map.embedding), count(model_map.final_norm) + count(model_map.head)


def profile_costs(module: nn.Module, model_map: ModelMap, forward: Callable[[Tensor], Tensor],
                  loss_fn: Callable[[Tensor, Tensor], Tensor], inputs: Tensor, targets: Tensor,
                  *, repeats: int = 3, clock: Callable[[], float] = time.perf_counter,
                  ) -> tuple[list[float], float, float]:
    """(per-block, first-stage extra, last-stage extra) costs as measured forward + backward seconds (or as whatever
    ``clock`` counts: the floating-point operations counted so far, for a measure that does not depend on the load).

    Runs ``loss_fn(forward(inputs), targets)`` on a sample batch with timing hooks around the
    embedding, every block and the head (the loss is charged to the head), keeping the fastest of
    ``repeats`` runs. Blocks of a standard model cost the same; the embedding and the head (a
    vocabulary-sized matmul and softmax) often do not, which parameter counts miss.
    """
    names = {"embedding": model_map.embedding, "head": model_map.head, **{n: n for n in model_map.block_names(module)}}
    timings: dict[str, float] = {}
    handles = []
    for key, name in names.items():
        if name is not None:
            handles += _time_forward_and_backward(module.get_submodule(name), key, timings, clock)
    best: dict[str, float] = {}
    with warnings.catch_warnings():
        # The embedding's input (token ids) needs no gradient; its backward hook still times its backward.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        try:
            for _ in range(repeats):
                timings.clear()
                started = clock()
                loss_fn(forward(inputs), targets).backward()
                total = clock() - started
                timings["head"] = timings.get("head", 0.0) + total - sum(timings.values())  # loss and the rest
                for key, value in timings.items():
                    best[key] = min(best.get(key, float("inf")), value)
        finally:
            for handle in handles:
                handle.remove()
            module.zero_grad(set_to_none=True)
    blocks = [best.get(n, 0.0) for n in model_map.block_names(module)]
    return blocks, best.get("embedding", 0.0), best.get("head", 0.0)


def _time_forward_and_backward(module: nn.Module, key: str, timings: dict[str, float],
                               clock: Callable[[], float]) -> list[Any]:
    started: dict[str, float] = {}

    def before_forward(*_: Any) -> None:
        started["forward"] = clock()

    def after_forward(*_: Any) -> None:
        timings[key] = timings.get(key, 0.0) + clock() - started["forward"]

    def before_backward(*_: Any) -> None:
        started["backward"] = clock()

    def after_backward(*_: Any) -> None:
        timings[key] = timings.get(key, 0.0) + clock() - started["backward"]

    return [module.register_forward_pre_hook(before_forward), module.register_forward_hook(after_forward),
            module.register_full_backward_pre_hook(before_backward),
            module.register_full_backward_hook(after_backward)]


# ---------------------------------------------------------------------------------- stage modules
class SkippedBlock(nn.Module):
    """Stands in for block ``index``, which another stage owns: hands its hidden-state input on, shaped like the
    block's output, with the values received for it beside (``pipeline.carry``: a position bias it would have
    returned), and gives the stage's carrier the block's arguments (a dict the blocks share gets its received entries).

    ``parts`` (names relative to the block -> modules) are the parts of the block the network runs after its last
    block, kept at their paths on the last stage (the same modules, so their parameters are the block's)."""

    def __init__(self, call: Call, parts: dict[str, nn.Module] | None = None, index: int = -1) -> None:
        super().__init__()
        self.call = call
        self.index = index
        for path, part in (parts or {}).items():
            parent: nn.Module = self
            *containers, leaf = path.split(".")
            for name in containers:
                if name not in parent._modules:
                    parent.add_module(name, nn.Module())
                parent = parent._modules[name]
            parent.add_module(leaf, part)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = _hidden_of(self.call, args, kwargs)
        carrier = active_carrier()
        if carrier is not None:
            carrier.block_called(args, kwargs)
        if self.call.output_index is None:
            return hidden
        return skipped_output(carrier, self.index, hidden, self.call.output_index, self.call.output_length)


class AbsentTensor(Tensor):
    """What a stand-in answers for a tensor of the module it stands for that the stage does not hold (Llama 4's
    forward reads ``embed_tokens.weight.device`` on every stage): its shape, dtype and device, no storage. Writes
    into it (a model's initialisation of every module) are dropped; any computation that reads it raises, naming
    the tensor, so that a forward that uses a module's weights where the module does not run fails instead of
    computing with made-up values."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, name: str) -> "AbsentTensor":
        tensor = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        tensor.stands_for = name
        return tensor

    def __repr__(self) -> str:  # type: ignore[override]
        return f"AbsentTensor({self.stands_for}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.is_mutable and isinstance(args[0], AbsentTensor):  # written in place: nothing to keep
            return args[0]
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        names = [leaf.stands_for for leaf in leaves if isinstance(leaf, AbsentTensor)]
        raise RuntimeError(f"{', '.join(names)} is not on this pipeline stage, and the model's forward computes with "
                           f"it ({func}) on a stage that does not run its module: give the model map a split that "
                           "runs that module on the stages that use it, or pipeline_parallel_size=1")


class StandInModule(nn.Module):
    """Stands in for a module outside the blocks that this stage does not run (see :class:`StandIn`).

    It keeps the parameters of that module that this stage holds anyway (a head tied to the embedding), under
    the same names, without computing with them. The module's other own tensors read as :class:`AbsentTensor`
    (shape, dtype and the stage's ``device``, which :func:`build_stages` sets).
    """

    holds_only = True  # lightning_par.parallel.modules.retie: holds tied parameters, never computes with them

    def __init__(self, spec: StandIn, parameters: dict[str, nn.Parameter] | None = None,
                 stands_for: nn.Module | None = None, path: str = "") -> None:
        super().__init__()
        self.spec = spec
        self.path = path  # the module's name in the model, for messages
        self.device: torch.device | None = None
        for name, parameter in (parameters or {}).items():
            self.register_parameter(name, parameter)
        own = [*stands_for.named_parameters(recurse=False), *stands_for.named_buffers(recurse=False)] \
            if stands_for is not None else []
        self.absent = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in own
                       if name not in (parameters or {})}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            absent = self.__dict__.get("absent", {})
            if name not in absent:
                raise
            shape, dtype = absent[name]
            return AbsentTensor(shape, dtype, self.__dict__.get("device") or torch.device("cpu"),
                                f"{self.__dict__.get('path') or 'a module'}.{name}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else next(iter(kwargs.values()))
        if self.spec.kind == "zeros":  # an embedding's output: (*input shape, width)
            return torch.zeros(*x.shape, self.spec.width, dtype=self.spec.dtype, device=x.device)
        if self.spec.kind == "batch_zeros":  # per sample, the shape the module made (patches x width, say)
            return torch.zeros(x.shape[0], *self.spec.shape, dtype=self.spec.dtype, device=x.device)
        return x


class _StageOutput(Exception):
    """Raised after a stage's last block to stop the network's forward there, carrying the hidden states (the values
    handed on beside them are the stage's carrier's)."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class StageModule(nn.Module):
    """One pipeline stage: the model's forward with only this stage's parts of its network; returns a tensor.

    ``forward(x, tokens)``: ``x`` is the micro-batch's inputs on the first stage and the received hidden
    states elsewhere; ``tokens`` (the inputs, on every stage) feed the code before the blocks on later stages,
    whose stand-ins produce what the blocks take beside the hidden states. Under tensor parallel with
    sequence parallel the hidden states between blocks are DTensors split along the sequence: a stage sends
    its own slice to the same tensor-parallel rank of the next stage (``sequence_mesh``: the ``tp`` mesh on
    stages that receive such slices), which makes it a DTensor again.
    """

    def __init__(self, model: nn.Module, *, is_first: bool, is_last: bool = False,
                 sequence_mesh: DeviceMesh | None = None, carrier: Carrier | None = None) -> None:
        super().__init__()
        self.model = model
        self.is_first, self.is_last = is_first, is_last
        self.sequence_mesh = sequence_mesh
        self.carrier = carrier  # what earlier blocks hand later ones, where the stage receives or sends any
        self.incoming: Tensor | None = None  # the received hidden states, for the first block's input hook

    def forward(self, x: Tensor, *carried: Tensor, tokens: Tensor | None = None) -> Tensor | tuple[Tensor, ...]:
        """``carried``: the values earlier blocks hand the blocks of this stage (``pipeline.carry``), received after
        the hidden states; the stage returns those the next stage needs after its own hidden states."""
        if not self.is_first:
            if tokens is None:
                raise ValueError("a pipeline stage after the first needs the micro-batch's tokens (tokens=...) to run "
                                 "the code before its blocks")
            if self.sequence_mesh is not None:  # (B, T/tp, C) -> (B, T, C)
                x = DTensor.from_local(x, self.sequence_mesh, (Shard(1),), run_check=False)
            self.incoming, x = x, tokens
        if carried and self.carrier is None:
            raise ValueError(f"a pipeline stage received {len(carried)} values beside the hidden states, and expects "
                             "none")
        handed: tuple[Tensor, ...] = ()
        with self.carrier.running(carried) if self.carrier is not None else contextlib.nullcontext():
            try:
                output, _, _ = first_tensor(self.model(x))
            except _StageOutput as stop:
                output = stop.hidden
                handed = self.carrier.collect() if self.carrier is not None else ()
            finally:
                self.incoming = None
        if isinstance(output, DTensor) and not self.is_last:
            # Between stages each rank sends its own piece; the last stage's output (logits split over the
            # vocabulary, under loss parallel) stays a DTensor for the loss.
            output = output.to_local()
        # The zero-bubble schedules detach stage outputs in place, which PyTorch refuses on views (the
        # output of a linear layer on a 3-D input is one).
        output = output.clone() if output._base is not None else output
        return (output, *handed) if handed else output


def _hidden_of(call: Call, args: tuple, kwargs: dict) -> Any:
    return args[call.argument] if isinstance(call.argument, int) else kwargs[call.argument]


def _receive_hidden(stage: StageModule, call: Call) -> Callable:
    """Forward pre-hook of a stage's first block: its hidden-state input becomes what the stage received."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if isinstance(call.argument, int):
            return (*args[:call.argument], stage.incoming, *args[call.argument + 1:]), kwargs
        return args, {**kwargs, call.argument: stage.incoming}
    return hook


def _stop_after(call: Call) -> Callable:
    """Forward hook of a stage's last block (not the last stage): end the network's forward with its output."""
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        raise _StageOutput(output_item(output, call.output_index))
    return hook


def _replace(network: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A copy of ``network`` with the named submodules replaced, sharing every other module.

    Only the modules on the path to a replaced one are copied (shallowly), so the stages of one rank and
    the rank's own network hold the very same parameters.
    """
    if not replacements:
        return network
    copied = copy.copy(network)
    copied._modules = dict(network._modules)
    children: dict[str, dict[str, nn.Module]] = {}
    for name, module in replacements.items():
        head, _, rest = name.partition(".")
        if rest:
            children.setdefault(head, {})[rest] = module
        else:
            copied._modules[head] = module
    for head, nested in children.items():
        copied._modules[head] = _replace(network._modules[head], nested)
    return copied


@dataclass(frozen=True)
class StageLayout:
    """This rank's share of the pipeline: its stage indices, what each runs, and the parameters held twice."""

    network: str  # the module (relative to the model) whose forward a stage runs
    n_stages: int
    call: Call  # where the blocks take and return their hidden states
    # stage index -> (owned block names, outside modules it runs), names relative to ``network``
    stages: dict[int, tuple[frozenset[str], frozenset[str]]]
    stand_ins: dict[str, StandIn]  # outside modules (relative to ``network``) -> their stand-in on other stages
    shared: dict[str, tuple[int, ...]]  # parameter names (from the model root) -> pp ranks holding a copy (2+)
    # blocks (relative to ``network``) -> their parts the network runs after its last block (relative to the block)
    parts_after_blocks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The values blocks hand later blocks (pipeline.handoffs): per stage of this rank, (received, sent); the blocks
    # (relative to ``network``) by index; the blocks' full names, for messages; whether the trace ran every block.
    carried: dict[int, tuple[tuple[Carried, ...], tuple[Carried, ...]]] = field(default_factory=dict)
    block_index: dict[str, int] = field(default_factory=dict)
    block_names: tuple[str, ...] = ()
    traced_every_block: bool = True

    def carrier(self, stage: int) -> Carrier | None:
        """The carrier of ``stage``'s handed values (None where it receives and sends only hidden states)."""
        incoming, outgoing = self.carried.get(stage, ((), ()))
        if not (incoming or outgoing):
            return None
        return Carrier(incoming, outgoing, list(self.block_names), exact=self.traced_every_block)


def _skipped(call: Call, block: nn.Module, paths: tuple[str, ...], index: int = -1) -> SkippedBlock:
    """The stand-in for ``block`` (block ``index``), keeping its parts at ``paths`` (on the last stage: those run after
    the blocks)."""
    return SkippedBlock(call, {path: block.get_submodule(path) for path in paths}, index)


def _outside_runs(trace: NetworkTrace, name: str, module: nn.Module, n_stages: int) -> set[int]:
    """The stages that run outside module ``name`` (a full name) for real."""
    own = {f"{name}.{leaf}" for leaf, _ in module.named_parameters(recurse=False)}
    if own & trace.shared:
        return set(range(n_stages))  # it computes what every block takes
    if name in trace.before_blocks:
        return {0}
    if own & trace.postlude:
        return {n_stages - 1}
    return {0}  # used nowhere in the forward: kept once


def cut_network(module: nn.Module, mesh: ParallelMesh, model_map: ModelMap, trace: NetworkTrace, *, schedule: Schedule,
                virtual_stages: int, sizes: list[int], placement: dict[int, int] | None = None) -> StageLayout:
    """Drop from the network inside ``module`` every part this rank's stages do not run (in place).

    ``sizes`` are the numbers of blocks of every stage (``pp x stages per rank`` of them), placed on the pipeline
    ranks as ``schedule`` places them, or as ``placement`` says (stage -> pipeline rank: the set-up check's). A part
    this rank does not run but whose parameters one of its stages uses (a head tied to the embedding) becomes a
    stand-in holding those parameters. Raises ``ValueError`` naming a module that must run before the blocks
    on stage 0 and that later stages cannot stand in for.
    """
    pp, pp_rank = mesh.size("pp"), mesh.local_rank("pp")
    n_stages = len(sizes)
    prefix = network_prefix(model_map)
    network = module.get_submodule(prefix.rstrip(".")) if prefix else module
    blocks = model_map.block_names(module)
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    block_stage = {name: s for s in range(n_stages) for name in blocks[starts[s]:starts[s] + sizes[s]]}
    rank_of = placement or {s: r for r in range(pp) for s in stage_indices(r, pp, schedule, virtual_stages)}
    mine = sorted(s for s, r in rank_of.items() if r == pp_rank)

    # Where each parameter is held: its block's stage, every stage that runs its outside module, and every
    # stage whose role needs it (its stand-in keeps it); a parameter of an enclosing module stays everywhere.
    # By parameter, not by name: the names of a tied parameter share one set of holders.
    holders: dict[int, set[int]] = {}
    names: dict[int, list[str]] = {}  # parameter -> its names, in module order
    runs: dict[str, set[int]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if name in trace.outside:
            runs[name] = _outside_runs(trace, name, sub, n_stages)
            if name in trace.before_blocks and trace.outside[name].reason and runs[name] != set(range(n_stages)):
                raise ValueError(f"pipeline parallel: {name!r} runs before the first block and holds parameters, but "
                                 f"{trace.outside[name].reason}; later stages cannot stand in for it. Make it part "
                                 "of the first block, or train this model without pp")
        for leaf, parameter in sub.named_parameters(recurse=False):
            full = clean_name(f"{name}.{leaf}" if name else leaf)
            block = next((b for b in blocks if full.startswith(b + ".")), None)
            if block is not None:  # its stage, and the last one for a part run after the blocks
                stages = {block_stage[block]} | trace.role_stages(full, n_stages)
            elif name in runs:
                stages = runs[name] | trace.role_stages(full, n_stages)
            else:
                stages = set(range(n_stages))
            holders.setdefault(id(parameter), set()).update(stages)
            names.setdefault(id(parameter), []).append(full)

    parts_after = {b[len(prefix):]: tuple(p[len(b) + 1:] for p in sorted(trace.parts_after_blocks)
                                          if p.startswith(b + "."))
                   for b in blocks if any(p.startswith(b + ".") for p in trace.parts_after_blocks)}
    for index, name in enumerate(blocks):
        if block_stage[name] not in mine:
            paths = parts_after.get(name[len(prefix):], ()) if n_stages - 1 in mine else ()
            _set(network, name[len(prefix):], _skipped(trace.block_call, module.get_submodule(name), paths, index))
    replaced: list[str] = []
    for name, stages in runs.items():
        if stages & set(mine) or any(name.startswith(outer + ".") for outer in replaced):
            continue  # run here, or inside a module a stand-in already took the place of
        replaced.append(name)
        sub = module.get_submodule(name)
        kept = {leaf: p for leaf, p in sub.named_parameters(recurse=False) if holders[id(p)] & set(mine)}
        spec = trace.outside[name] if name in trace.before_blocks else StandIn("unused")
        _set(network, name[len(prefix):], StandInModule(spec, kept, stands_for=sub, path=name))

    stage_parts = {}
    for s in mine:
        owned = frozenset(b[len(prefix):] for b in blocks if block_stage[b] == s)
        running = frozenset(n[len(prefix):] for n, stages in runs.items() if s in stages)
        stage_parts[s] = (owned, running)
    # Trainable parameters some code uses, held on more than one pipeline rank: kept equal by StageTies.
    used = trace.prelude | trace.postlude | trace.shared
    shared = {}
    # Each tie under a name this rank still holds: a part several blocks share (a shared transformer block) is
    # known by its first name on the stage of its first block, and by another one on the other stages.
    held = {clean_name(n) for n, _ in module.named_parameters(remove_duplicate=False)}
    for key, stages in holders.items():
        ranks = tuple(sorted({rank_of[s] for s in stages}))
        name = next((n for n in names[key] if n in held), names[key][0])
        in_block = any(n.startswith(b + ".") for n in names[key] for b in blocks)
        if len(ranks) > 1 and (in_block or any(n in used for n in names[key])):
            shared[name] = ranks
    # What each stage receives from the stage before and sends to the next beside the hidden states.
    handoffs = trace.handoffs
    crossing = [() if s == 0 else handoffs.crossing(starts[s], len(blocks)) for s in range(n_stages)] + [()]
    return StageLayout(prefix.rstrip("."), n_stages, trace.block_call, stage_parts,
                       {n[len(prefix):]: trace.outside[n] if n in trace.before_blocks else StandIn("unused")
                        for n in runs}, shared, parts_after,
                       carried={s: (crossing[s], crossing[s + 1]) for s in mine},
                       block_index={name[len(prefix):]: index for index, name in enumerate(blocks)},
                       block_names=tuple(blocks), traced_every_block=handoffs.exact(len(blocks)))


def build_stages(module: nn.Module, layout: StageLayout, mesh: ParallelMesh, device: torch.device, *,
                 sequence_parallel: bool = False,
                 shard_root: Callable[[nn.Module], None] | None = None) -> list[PipelineStage]:
    """This rank's ``PipelineStage`` objects over the (already cut) network of ``module``.

    Built after every other technique has changed the blocks (activation checkpointing replaces them),
    because each stage sees the network through its own view: one rank's stages share every module and
    parameter, and differ only in which parts are stand-ins. The hooks that swap a stage's first hidden-state
    input and stop after its last block sit on the blocks as they now are, outside any recomputation wrapper.
    ``sequence_parallel``: tensor parallel keeps the hidden states split along the sequence, so stages after
    the first receive slices. ``shard_root`` (ZeRO-3) makes each stage an FSDP2 root over the parameters its blocks'
    units do not hold (embedding, norm, head), which the schedule then drives (gathered blocks and whole gradients
    over the micro-batches, one reduce-scatter after the last).
    """
    sliced = mesh["tp"] if sequence_parallel and mesh.size("tp") > 1 else None
    return [PipelineStage(stage_module, index, layout.n_stages, device, group=mesh.group("pp"))
            for index, stage_module in stage_modules(module, layout, device, sequence_mesh=sliced,
                                                     shard_root=shard_root).items()]


def stage_modules(module: nn.Module, layout: StageLayout, device: torch.device, *,
                  sequence_mesh: DeviceMesh | None = None,
                  shard_root: Callable[[nn.Module], None] | None = None) -> dict[int, StageModule]:
    """This rank's stage modules (stage index -> :class:`StageModule`) over the cut network of ``module``, with the
    hooks that start and stop each at its blocks: what :func:`build_stages` hands the schedule, and what the set-up
    check (``pipeline.check``) runs itself."""
    network = module.get_submodule(layout.network) if layout.network else module
    prefix = f"{layout.network}." if layout.network else ""
    blocks_held = set().union(*(owned for owned, _ in layout.stages.values()))
    outside_held = set().union(*(running for _, running in layout.stages.values()))
    block_order = {name: index for index, name in enumerate(
        n[len(prefix):] for n, _ in module.named_modules() if n[len(prefix):] in blocks_held)}
    stages = {}
    for index, (owned, running) in layout.stages.items():
        last = index == layout.n_stages - 1
        replacements: dict[str, nn.Module] = {
            name: _skipped(layout.call, network.get_submodule(name),
                           layout.parts_after_blocks.get(name, ()) if last else (), layout.block_index.get(name, -1))
            for name in blocks_held - owned}
        replacements.update({name: StandInModule(layout.stand_ins[name], stands_for=network.get_submodule(name),
                                                 path=prefix + name)
                             for name in outside_held - running})
        # The stage runs the model's own forward (which may hand the network more than the inputs: a timestep,
        # labels), over a view of the model with this stage's parts.
        carrier = layout.carrier(index)
        stage_module = StageModule(_replace(module, {prefix + n: m for n, m in replacements.items()}),
                                   is_first=index == 0,
                                   is_last=index == layout.n_stages - 1,
                                   sequence_mesh=sequence_mesh if index > 0 else None, carrier=carrier)
        for part in stage_module.modules():
            if isinstance(part, StandInModule):
                part.device = device
        if shard_root is not None:
            shard_root(stage_module)
        ordered = sorted(owned, key=block_order.__getitem__)
        if carrier is not None:  # before the hook that stops the stage: the last block's items are kept first
            for name in ordered:
                _watch_handed_values(network.get_submodule(name), layout.block_index[name])
        if index > 0:
            network.get_submodule(ordered[0]).register_forward_pre_hook(
                _receive_hidden(stage_module, layout.call), with_kwargs=True)
        if index < layout.n_stages - 1:
            network.get_submodule(ordered[-1]).register_forward_hook(_stop_after(layout.call))
        stages[index] = stage_module
    return stages


def _watch_handed_values(block: nn.Module, index: int) -> None:
    """Hooks on a block a stage runs: its arguments (a dict the blocks share) and its output (what it hands on) go
    to the carrier of the stage running it."""
    def called(module: nn.Module, args: tuple, kwargs: dict) -> None:
        carrier = active_carrier()
        if carrier is not None:
            carrier.block_called(args, kwargs)

    def returned(module: nn.Module, args: tuple, output: Any) -> None:
        carrier = active_carrier()
        if carrier is not None:
            carrier.block_returned(index, output)

    block.register_forward_pre_hook(called, with_kwargs=True)
    block.register_forward_hook(returned)


def _set(network: nn.Module, name: str, value: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = network.get_submodule(parent_name) if parent_name else network
    parent._modules[leaf] = value


def split_pipeline(module: nn.Module, mesh: ParallelMesh, model_map: ModelMap | None, *, schedule: Schedule,
                   virtual_stages: int, balance_by: str, device: torch.device,
                   sample_batch: tuple[Tensor, Tensor] | None = None) -> StageLayout:
    """Balance the blocks over ``pp x stages per rank`` stages and cut this rank's parts out (in place).

    ``module`` must meet the model contract: ``module(inputs) -> logits`` and
    ``module.loss_fn(logits, targets)``. ``sample_batch`` (inputs, targets; one micro-batch) is traced once
    (its first sample) to find what runs outside the blocks, and ``balance_by="profile"`` times it. Split points
    in ``model_map`` win over balancing.
    """
    pp = mesh.size("pp")
    named_pp = f"pp={pp!r}"
    if model_map is None:
        raise ValueError(f"{named_pp} needs to know where the blocks are, and no model map was found "
                         f"({why_no_blocks(module)}): give the "
                         "strategy a model map (model_map: {blocks: ..., embedding: ..., head: ...})")
    if sample_batch is None:
        raise ValueError(f"{named_pp} traces the network once on a sample of the data to place what runs outside the "
                         "blocks, and no data was found: train with a datamodule or dataloaders")
    n_stages = pp * stages_per_rank(schedule, virtual_stages)
    shared = model_map.shared_blocks(module)
    if shared:
        entries = len(module.get_submodule(model_map.blocks)._modules)
        distinct = entries - sum(len(group) - 1 for group in shared)
        raise ValueError(f"{named_pp}: the {entries} entries of the block list {model_map.blocks!r} hold only "
                         f"{distinct} distinct module{'s' * (distinct != 1)}, because entries share one module "
                         f"({', '.join(' = '.join(group) for group in shared[:2])}): a pipeline stage owns the "
                         "parameters of its blocks, and one block module cannot be cut between stages. Give each "
                         "entry a module of its own, or train this model without pipeline parallel")
    blocks = model_map.block_names(module)
    if len(blocks) < n_stages:
        raise ValueError(f"{n_stages} pipeline stages ({named_pp} x {n_stages // pp} per rank for {schedule!r}) need "
                         f"at least {n_stages} blocks, the model has {len(blocks)}")
    trace = _trace(module, model_map, sample_batch[0][:1].to(device))
    if model_map.split_points:
        sizes = sizes_from_split_points(blocks, model_map.split_points, n_stages)
    else:
        if balance_by == "profile":
            costs, first, last = profile_costs(module, model_map, module, module.loss_fn,
                                               *(t.to(device) for t in sample_batch))
            # Every rank must cut at the same places: agree on the mean of the measured costs.
            measured = torch.tensor([*costs, first, last], dtype=torch.float64)
            torch.distributed.all_reduce(measured)
            measured /= torch.distributed.get_world_size()
            costs, first, last = measured[:-2].tolist(), float(measured[-2]), float(measured[-1])
        else:
            costs, first, last = parameter_costs(module, model_map)
        sizes = balance(costs, n_stages, first=first, last=last)
    _check_boundaries(blocks, sizes, trace.changed)
    trace.handoffs.check_split([sum(sizes[:s]) for s in range(1, len(sizes))], blocks)
    return cut_network(module, mesh, model_map, trace, schedule=schedule, virtual_stages=virtual_stages, sizes=sizes)


def _check_boundaries(blocks: list[str], sizes: list[int], changed: frozenset[int]) -> None:
    """Refuse a split whose stage starts right after code that runs between two blocks (that code would be
    skipped), naming the blocks and split points that avoid it."""
    starts = {sum(sizes[:s]) for s in range(1, len(sizes))}
    if starts & changed:
        index = min(starts & changed)
        allowed = [blocks[i] for i in range(1, len(blocks)) if i not in changed]
        raise ValueError(f"pipeline parallel: between {blocks[index - 1]!r} and {blocks[index]!r} the network changes "
                         "the hidden states, and a stage would start there, skipping that code. Choose the stages' "
                         f"first blocks elsewhere with the map's split_points (any of {allowed[:8]}"
                         f"{' ...' if len(allowed) > 8 else ''}), or move that code into a block")


def _trace(module: nn.Module, model_map: ModelMap, sample: Tensor) -> NetworkTrace:
    """What the network does outside its blocks (``trace.py``), traced on one sample. A model built on the
    meta device (``Trainer.init_module(empty_init=True)``) cannot run: its trace runs on a small copy with its
    first blocks (code such as a causal mask built from the data needs real values)."""
    prefix = network_prefix(model_map)
    root = module
    if any(p.is_meta for p in module.parameters()):
        root = small_copy(module, model_map.blocks, sample.device, torch.float32, min_blocks=2)
    network = root.get_submodule(prefix.rstrip(".")) if prefix else root
    return trace_network(network, model_map.block_names(root), sample, root=root)


def last_stage_rank(pp: int, schedule: Schedule, virtual_stages: int) -> int:
    """The pipeline rank that holds the last stage (and computes the loss)."""
    n_stages = pp * stages_per_rank(schedule, virtual_stages)
    return next(r for r in range(pp) if n_stages - 1 in stage_indices(r, pp, schedule, virtual_stages))


def forward_through_stages(stages: list[PipelineStage], inputs: Tensor, mesh: ParallelMesh,
                           schedule: Schedule, virtual_stages: int = 2) -> Tensor | None:
    """One forward of a whole batch through every stage in turn, without a schedule (evaluation under ZB-V).

    torch 2.13's ZB-V schedule runs backward actions when asked to evaluate (``eval()`` fails with "can't
    steal_bwd_input"), so evaluation sends the batch along the V itself: each rank runs its stage when the
    previous stage's output arrives (point-to-point, a shape header first) and passes it on. Stages run one
    after another rather than overlapped, which evaluation, without backward passes, can afford. Returns
    the last stage's output on the rank that holds it, ``None`` elsewhere.
    """
    pp, me, group = mesh.size("pp"), mesh.local_rank("pp"), mesh.group("pp")
    owner = {stage: rank for rank in range(pp) for stage in stage_indices(rank, pp, schedule, virtual_stages)}
    mine = {stage.stage_index: stage for stage in stages}
    last = len(owner) - 1
    values: tuple[Tensor, ...] = (inputs,)
    for index in range(last + 1):
        if owner[index] != me:
            continue
        if index > 0 and owner[index - 1] != me:
            values = receive_tensors(dist.get_global_rank(group, owner[index - 1]), mine[index].device)
        output = mine[index].submod(*values, tokens=inputs)
        values = output if isinstance(output, tuple) else (output,)  # the hidden states, and values handed on
        if index < last and owner[index + 1] != me:
            send_tensors(values, dist.get_global_rank(group, owner[index + 1]))
    return values[0] if owner[last] == me else None


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.bool, torch.int64, torch.int32)


def send_tensors(tensors: Sequence[Tensor] | None, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``tensors`` to global rank ``dst``, their number and each one's shape and dtype first; None sends a
    failure (:func:`receive_tensors` returns None), so that a rank that failed still answers the one waiting."""
    count = torch.tensor([-1 if tensors is None else len(tensors)], dtype=torch.int64)
    device = tensors[0].device if tensors else torch.device("cpu")
    dist.send(count.to(device), dst, group=group)
    for x in tensors or ():
        header = torch.zeros(10, dtype=torch.int64, device=x.device)
        header[0], header[1] = x.dim(), _DTYPES.index(x.dtype)
        header[2:2 + x.dim()] = torch.tensor(x.shape)
        dist.send(header, dst, group=group)
        dist.send(x.detach().contiguous(), dst, group=group)


def receive_tensors(src: int, device: torch.device,
                    group: dist.ProcessGroup | None = None) -> tuple[Tensor, ...] | None:
    """The tensors :func:`send_tensors` sent from global rank ``src`` (None where it sent a failure)."""
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src, group=group)
    if int(count) < 0:
        return None
    tensors = []
    for _ in range(int(count)):
        header = torch.zeros(10, dtype=torch.int64, device=device)
        dist.recv(header, src, group=group)
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        x = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
        dist.recv(x, src, group=group)
        tensors.append(x)
    return tuple(tensors)


def build_schedule(stages: list[PipelineStage], schedule: Schedule, n_microbatches: int,
                   loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
                   ) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """PyTorch's schedule over ``stages`` (the row's class of ``torch.distributed.pipelining.schedules``);
    ``loss_fn`` already carries the 1/micro-batches scaling."""
    cls = getattr(torch_schedules, SCHEDULES[schedule].torch_class)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)



__all__ = [
    "SkippedBlock",
    "AbsentTensor",
    "StandInModule",
    "StageLayout",
    "StageModule",
    "balance",
    "build_schedule",
    "build_stages",
    "forward_through_stages",
    "receive_tensors",
    "send_tensors",
    "check_microbatches",
    "cut_network",
    "last_stage_rank",
    "split_pipeline",
    "stage_modules",
    "network_prefix",
    "parameter_costs",
    "profile_costs",
    "sizes_from_split_points",
    "stage_indices",
    "stages_per_rank",
]
