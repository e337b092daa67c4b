"""The search: every layout the world size allows, sized, costed, filtered and ranked.

A layout is a fully sized :class:`~lightning_par.layout.config.ParallelConfig`: ``pp x dp_replicate x dp_shard x
cp x tp`` multiplying to the world size, ``ep`` borrowed from ``dp_shard x cp``, a ZeRO stage, an
activation-checkpointing mode and, with a pipeline, a schedule. Sizes the user fixed are kept; only the
others are searched. A layout is kept when the model can be split that way (``tp`` divides the heads, the
key/value heads, the vocabulary and the MLP; ``pp`` divides the layers; ``cp`` divides the sequence and, for
Ulysses, the heads; ``ep`` divides the experts; the data-parallel ranks divide the global batch into
micro-batches), when this version of lightning_par composes it (``composable``), and when it fits the
device memory (:mod:`lightning_par.planner.memory`). The survivors are ranked by predicted step time
(:mod:`lightning_par.planner.time`), ties by memory.

The search is exhaustive: a cluster of 64 devices has a few thousand layouts, each costed in microseconds
(Narayanan et al. 2021 explore the same space by hand in their section 3, and reach the same rules of thumb:
tensor parallel inside a node, pipeline across nodes, data parallel for the rest).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_par.layout.config import (
    CP_METHODS,
    PP_SCHEDULES,
    RECOMPUTE_MODES,
    ZERO3_UNIT_DEFAULTS,
    ZERO_STAGES,
    ParallelConfig,
    divisors,
)
from lightning_par.layout.context_methods import fits as method_fits
from lightning_par.layout.schedules import SCHEDULES, fewest_microbatches
from lightning_par.planner.cluster import ClusterSpec, GiB
from lightning_par.planner.memory import (OPTIMIZERS, PRECISIONS, MemoryBreakdown, block_local_params, estimate_memory,
                                          rank_stages)
from lightning_par.planner.model import ModelSpec, parameter_count
from lightning_par.planner.time import StepTime, estimate_step_time
from lightning_par.layout.dimensions import DIMENSIONS, argument_fields
from lightning_par.layout.zero_units import choose_units

# The values config.py allows, in the order the search tries them (cheapest first).
CHECKPOINTING = tuple(sorted(RECOMPUTE_MODES, key=("none", "selective", "op", "full").index))
SCHEDULE_PREFERENCE = tuple(sorted(PP_SCHEDULES, key=lambda name: SCHEDULES[name].search_order))

# Names a user may fix: every dimension's size (and dp, their data-parallel product) and the knobs the search
# chooses, with the strategies' argument names as aliases.
_ALIASES = argument_fields()
_FIXABLE = (*(row.field for row in DIMENSIONS), "dp", "zero_stage", "activation_checkpointing", "pp_schedule",
            "pp_virtual_stages", "sequence_parallel", "loss_parallel", "cp_method", "sharded_accumulation")


@dataclass(frozen=True)
class TrainingSpec:
    """What is trained: ``global_batch_size`` sequences of ``seq_len`` tokens per optimizer step, in
    micro-batches of ``microbatch_size`` sequences per data-parallel rank (a sequence of sizes lets the
    planner choose). ``activation_checkpointing`` and ``pp_schedules`` are the modes it may use. ``compiled``
    (the blocks under ``torch.compile``) and ``float8`` (their linear layers in torchao's Float8) change the
    step time only (:func:`~lightning_par.planner.time.estimate_step_time`)."""

    global_batch_size: int
    seq_len: int
    microbatch_size: int | tuple[int, ...] = 1
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    activation_checkpointing: tuple[str, ...] = CHECKPOINTING
    pp_schedules: tuple[str, ...] = SCHEDULE_PREFERENCE
    zero_stages: tuple[int, ...] = ZERO_STAGES
    cp_methods: tuple[str, ...] = CP_METHODS
    pp_virtual_stages: tuple[int, ...] = (2,)
    compiled: bool = False
    float8: bool = False

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainingSpec.{name} must be a positive integer, got {value!r}")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.micro_batch_sizes):
            raise ValueError(f"TrainingSpec.microbatch_size must be positive integers, got {self.microbatch_size!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainingSpec.optimizer={self.optimizer!r} is not one of {OPTIMIZERS}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainingSpec.precision={self.precision!r} is not one of {PRECISIONS}")
        unknown = set(self.activation_checkpointing) - set(CHECKPOINTING)
        if unknown or not self.activation_checkpointing:
            raise ValueError(f"TrainingSpec.activation_checkpointing={self.activation_checkpointing!r}: choose from "
                             f"{CHECKPOINTING}")
        unknown = set(self.pp_schedules) - set(SCHEDULE_PREFERENCE)
        if unknown:
            raise ValueError(f"TrainingSpec.pp_schedules: {sorted(unknown)} not in {SCHEDULE_PREFERENCE}")

    @property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        sizes = self.microbatch_size
        return (sizes,) if isinstance(sizes, int) else tuple(sizes)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


@dataclass(frozen=True)
class Candidate:
    """One sized layout with its predicted memory and step time.

    ``microbatches`` is the number of micro-batches each data-parallel rank runs per optimizer step: the
    pipeline's micro-batches (``config.microbatches``) with ``pp > 1``, gradient-accumulation steps
    otherwise (:attr:`accumulate_grad_batches`)."""

    config: ParallelConfig
    microbatches: int
    microbatch_size: int
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    cluster: ClusterSpec
    mfu: float = 0.0

    @property
    def memory_limit(self) -> float:
        """Bytes a device offers the step (its memory times the usable fraction)."""
        return self.cluster.usable_memory_bytes

    @property
    def accumulate_grad_batches(self) -> int:
        return 1 if self.config.pp > 1 else self.microbatches

    @property
    def batch_size_per_rank(self) -> int:
        """Sequences a data-parallel rank loads per optimizer step."""
        return self.microbatches * self.microbatch_size

    @property
    def loader_batch_size(self) -> int:
        """Sequences per batch of the data loader: the whole pipeline batch with ``pp > 1`` (the schedule cuts it
        into micro-batches), one micro-batch otherwise (Lightning accumulates :attr:`accumulate_grad_batches`)."""
        return self.batch_size_per_rank if self.config.pp > 1 else self.microbatch_size

    @property
    def tokens_per_second(self) -> float:
        return self.time.tokens_per_second

    def sizes(self) -> dict[str, int]:
        c = self.config
        return {"pp": c.pp, "dp_replicate": int(c.dp_replicate), "dp_shard": int(c.dp_shard), "cp": c.cp,
                "tp": c.tp, "ep": c.ep}


def normalize_fixed(fixed: dict[str, Any] | None) -> dict[str, Any]:
    """``fixed`` with aliases resolved and ``"auto"``/None entries dropped; unknown names raise."""
    result: dict[str, Any] = {}
    for key, value in (fixed or {}).items():
        name = _ALIASES.get(key, key)
        if name not in _FIXABLE:
            raise ValueError(f"cannot fix {key!r}: fixable are {sorted(_FIXABLE)} (or {sorted(_ALIASES)})")
        if value is None or value == "auto":
            continue
        if name in ("tp", "pp", "cp", "ep", "dp", "dp_replicate", "dp_shard", "pp_virtual_stages") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key}={value!r} must be a positive integer or 'auto'")
        result[name] = value
    return result


def _check_fixed_sizes(fixed: dict[str, Any], world: int) -> None:
    sizes = {k: fixed[k] for k in ("tp", "pp", "cp", "dp") if k in fixed}
    if "dp" not in sizes and "dp_replicate" in fixed and "dp_shard" in fixed:
        sizes["dp"] = fixed["dp_replicate"] * fixed["dp_shard"]
    product = math.prod(sizes.values())
    text = " x ".join(f"{k}={v}" for k, v in sizes.items())
    if world % product:
        raise ValueError(f"the fixed sizes {text} = {product} do not divide the world size {world}: the mesh sizes "
                         f"must multiply to the number of devices; sizes that divide it: {divisors(world)}")
    if len(sizes) == 4 and product != world:
        raise ValueError(f"the fixed sizes {text} multiply to {product}, not to the world size {world}; leave one "
                         "of them 'auto' or change the number of devices")
    if "dp" in fixed and "dp_replicate" in fixed and fixed["dp"] % fixed["dp_replicate"]:
        raise ValueError(f"dp_replicate={fixed['dp_replicate']} does not divide dp={fixed['dp']}")


def _default_composable(config: ParallelConfig) -> bool:
    try:
        config.check_composable()
    except ValueError:
        return False
    return True


def _options(name: str, fixed: dict[str, Any], default: Sequence[Any]) -> list[Any]:
    return [fixed[name]] if name in fixed else list(default)


def enumerate_layouts(model: ModelSpec, world: int, training: TrainingSpec,
                      fixed: dict[str, Any] | None = None) -> list[tuple[ParallelConfig, int, int]]:
    """Every (config, micro-batches, micro-batch size) that splits ``model`` over ``world`` ranks validly."""
    fixed = normalize_fixed(fixed)
    _check_fixed_sizes(fixed, world)
    layouts = []
    for tp, cp, pp, dp in _mesh_sizes(model, world, training, fixed):
        offered = list(_options("cp_method", fixed, training.cp_methods))
        # At cp = 1 the method changes nothing: the first offered stands for all.
        methods = offered[:1] if cp == 1 else [method for method in offered
                                               if method_fits(training.seq_len, model.heads // tp, cp, method)]
        for mbs in training.micro_batch_sizes:
            if training.global_batch_size % (dp * mbs):
                continue
            m = training.global_batch_size // (dp * mbs)
            for zero, rep, shard in _data_parallel_options(dp, cp, training, fixed):
                eps = [ep for ep in _options("ep", fixed, divisors(model.moe_experts) if model.is_moe else [1])
                       if (shard * cp) % ep == 0 and (not model.is_moe or model.moe_experts % ep == 0)]
                knobs = (eps, _pipeline_options(pp, m, model, training, fixed), methods,
                         _tp_options(tp, training.seq_len // cp, fixed),
                         _options("activation_checkpointing", fixed, training.activation_checkpointing))
                # ZeRO-2/3 under gradient accumulation: reduce once (less traffic) or on every micro-batch (less
                # memory); the ranking keeps the first that fits.
                shardable = zero in (2, 3) and pp == 1 and m > 1
                accumulations = _options("sharded_accumulation", fixed, [False, True] if shardable else [False])
                for ep, pipeline, cp_method, (sp, lp), ac, sharded in itertools.product(*knobs, accumulations):
                    config = ParallelConfig(pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, ep=ep,
                                            sequence_parallel=sp, loss_parallel=lp, cp_method=cp_method,
                                            zero_stage=zero, activation_checkpointing=ac,
                                            sharded_accumulation=sharded and shardable,
                                            # Under a pipeline a ZeRO-3 stage stays gathered from its first backward
                                            # anyway (torch.distributed.pipelining): resharding after forward would
                                            # only add gathers (torchtitan's default policy too).
                                            reshard_after_forward=not (zero == 3 and pp > 1),
                                            **_precision_knobs(zero, training.precision), **pipeline)
                    layouts.append((config, m, mbs))
    return layouts


def _mesh_sizes(model: ModelSpec, world: int, training: TrainingSpec,
                fixed: dict[str, Any]) -> Iterator[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) multiplying to ``world`` that split the model: tp its heads, key/value heads, vocabulary
    and MLP; pp its layers (at least one a stage); cp its sequence (each method by ``layout.context_methods.fits``)."""
    splits = [t for t in divisors(world) if all(n % t == 0 for n in (model.heads, model.kv_heads,
                                                                       model.vocab_size, model.ffn_hidden))]
    for tp in _options("tp", fixed, splits):
        for cp in _options("cp", fixed, divisors(world // tp) if world % tp == 0 else []):
            if world % (tp * cp) or training.seq_len % cp:
                continue
            # Stages need not hold equal numbers of blocks (the pipeline balances them by parameters, and the
            # memory model counts the largest): Llama-3-405B's 126 layers go over 8 or 16 stages.
            layers = [p for p in divisors(world // (tp * cp)) if p <= model.layers]
            for pp in _options("pp", fixed, layers):
                if world % (tp * cp * pp) == 0 and fixed.get("dp", world // (tp * cp * pp)) == world // (tp * cp * pp):
                    yield tp, cp, pp, world // (tp * cp * pp)


def _data_parallel_options(dp: int, cp: int, training: TrainingSpec,
                           fixed: dict[str, Any]) -> Iterator[tuple[int, int, int]]:
    """(zero stage, dp_replicate, dp_shard): ZeRO needs ranks to shard over (dp_shard, or dp_shard x cp for
    stage 3); without ZeRO the split into replicate and shard means nothing, so only one is kept."""
    for zero in _options("zero_stage", fixed, training.zero_stages):
        for rep in _options("dp_replicate", fixed, divisors(dp) if zero else [1]):
            if dp % rep or fixed.get("dp_shard", dp // rep) != dp // rep:
                continue
            shard = dp // rep
            if zero in (1, 2) and shard == 1 or zero == 3 and shard * cp == 1:
                continue  # nothing to shard over
            yield zero, rep, shard



def _pipeline_options(pp: int, m: int, model: ModelSpec, training: TrainingSpec,
                      fixed: dict[str, Any]) -> list[dict[str, Any]]:
    if pp == 1:
        return [{}]
    options = []
    for schedule in _options("pp_schedule", fixed, training.pp_schedules):
        fixed_count = SCHEDULES[schedule].stages_per_rank
        # A schedule of virtual stages is tried with each count the training allows; the others hold a fixed count.
        counts = _options("pp_virtual_stages", fixed, training.pp_virtual_stages) if fixed_count is None else [None]
        for v in counts:
            per_rank = fixed_count or v
            if m < fewest_microbatches(schedule, pp, per_rank) or pp * per_rank > model.layers:
                continue  # too few micro-batches to fill the schedule, or fewer blocks than stages
            option = {"pp_schedule": schedule, "microbatches": m}
            if fixed_count is None:
                option["pp_virtual_stages"] = v
            options.append(option)
    return options


def _tp_options(tp: int, local_seq: int, fixed: dict[str, Any]) -> list[tuple[bool, bool]]:
    if tp == 1:
        return [(False, False)]
    sps = _options("sequence_parallel", fixed, [True, False] if local_seq % tp == 0 else [False])
    return [(sp, lp) for sp in sps for lp in _options("loss_parallel", fixed, [True, False])]


def _precision_knobs(zero: int, precision: str) -> dict[str, Any]:
    # FSDP2 gathers bf16 copies of its fp32 shards and reduces in fp32 (torchtitan's default): half the
    # all-gather bytes, and autocast finds nothing left to cast.
    if zero == 3 and precision != "32-true":
        return {"param_dtype": "bf16", "reduce_dtype": "fp32" if precision == "bf16-mixed" else None}
    return {}


def evaluate(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: ParallelConfig,
             microbatches: int, microbatch_size: int, memory: MemoryBreakdown | None = None) -> Candidate:
    """Cost one sized layout (``memory``: its :func:`layout_memory`, where already estimated)."""
    memory = memory or layout_memory(model, training, config, microbatches, microbatch_size)
    time = estimate_step_time(model, config, cluster, seq_len=training.seq_len, microbatch_size=microbatch_size,
                              microbatches=microbatches, precision=training.precision, compiled=training.compiled,
                              float8=training.float8, optimizer=training.optimizer)
    return Candidate(config=config, microbatches=microbatches, microbatch_size=microbatch_size, memory=memory,
                     time=time, fits=memory.total <= cluster.usable_memory_bytes, cluster=cluster,
                     mfu=time.mfu(cluster, training.precision))


def layout_memory(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, microbatches: int,
                  microbatch_size: int) -> MemoryBreakdown:
    """The peak memory of the most loaded rank of one sized layout."""
    return estimate_memory(model, config, seq_len=training.seq_len, microbatch_size=microbatch_size,
                           precision=training.precision, microbatches=microbatches, optimizer=training.optimizer)


def chosen_units(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig) -> ParallelConfig:
    """``config`` with ZeRO-3's gather controls as a strategy left at its defaults chooses them for ``model`` on
    ``cluster`` (``lightning_par.layout.zero_units.choose_units``), so that what is costed is what runs."""
    if not config.zero.shards_parameters:
        return config
    stages = rank_stages(model, config)[0]
    gather_bytes = 2 if config.param_dtype in ("bf16", "fp16") else 4
    # every block of a kind (dense, MoE) gathers the same bytes: each kind is sized once
    blocks = [size for moe, count in ((False, stages.n_dense), (True, stages.n_moe)) if count
              for size in [block_local_params(model, config, moe) * gather_bytes] * count]
    choice = choose_units(blocks, memory_bytes=cluster.memory_bytes, prefetch=config.pp == 1,
                          accelerator=cluster.accelerator)
    return dataclasses.replace(config, **{name: getattr(choice, name) for name in ZERO3_UNIT_DEFAULTS})


def plan_layouts(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *,
                 fixed: dict[str, Any] | None = None, top: int | None = None,
                 composable: Callable[[ParallelConfig], bool] | None = None,
                 include_unfit: bool = False) -> list[Candidate]:
    """Layouts of ``model`` on ``cluster`` for ``training``, fastest first among those that fit memory.

    ``fixed`` keeps sizes or knobs the user chose (``{"tp": 2}``, ``{"tensor_parallel_size": 8, "zero_stage":
    3}``; ``"auto"`` leaves one to the search). ``composable`` says whether this version of lightning_par can
    apply a layout (default: ``ParallelConfig.check_composable`` does not raise); pass
    ``lambda config: True`` to rank every layout the cost model understands. ``include_unfit`` appends the
    layouts that do not fit, smallest memory first. Raises ``ValueError`` when no layout is possible or none
    fits, naming the memory the smallest one needs and what would help.
    """
    world = cluster.world_size
    composable = composable or _default_composable
    layouts = enumerate_layouts(model, world, training, fixed)
    allowed = [(c, m, b) for c, m, b in layouts if composable(c)]
    if not allowed:
        raise ValueError(_nothing_possible(model, cluster, training, fixed, found=len(layouts)))
    sized = [(chosen_units(model, cluster, c), m, b) for c, m, b in allowed]
    # Memory first: the step time of a layout that does not fit is costed only where it is shown.
    memories = [layout_memory(model, training, *layout) for layout in sized]
    fits = [memory.total <= cluster.usable_memory_bytes for memory in memories]
    fitting = sorted((evaluate(model, cluster, training, *layout, memory=memory)
                      for layout, memory, fit in zip(sized, memories, fits) if fit),
                     key=lambda c: (c.time.total, c.memory.total))
    unfit = sorted(((layout, memory) for layout, memory, fit in zip(sized, memories, fits) if not fit),
                   key=lambda pair: pair[1].total)
    if not fitting:
        smallest = evaluate(model, cluster, training, *unfit[0][0], memory=unfit[0][1])
        raise ValueError(_nothing_fits(model, cluster, training, [smallest]))
    if include_unfit:
        fitting += [evaluate(model, cluster, training, *layout, memory=memory) for layout, memory in unfit]
    return fitting[:top] if top else fitting


def _nothing_possible(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, fixed: dict[str, Any] | None,
                      found: int) -> str:
    world = cluster.world_size
    if found:
        return (f"none of the {found} layouts of {model.name} over {world} devices is composable in this version of "
                f"lightning_par (fixed: {fixed or {}}); see ParallelConfig.check_composable")
    return (f"no layout splits {model.name} (heads={model.heads}, kv_heads={model.kv_heads}, layers={model.layers}) "
            f"over {world} devices for a global batch of {training.global_batch_size} sequences of {training.seq_len} "
            f"tokens in micro-batches of {training.microbatch_size} (fixed: {fixed or {}}): the data-parallel size "
            "must divide global_batch_size / microbatch_size, tp the heads, pp the layers, cp the sequence")


def _nothing_fits(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                  candidates: list[Candidate]) -> str:
    smallest = min(candidates, key=lambda c: c.memory.total)
    need, have = smallest.memory.total / GiB, cluster.usable_memory_bytes / GiB
    helps = [f"more devices (the model states alone need {smallest.memory.model_states / GiB:.1f} GiB per device "
             f"at this size)", "a device with more memory"]
    if "full" not in training.activation_checkpointing:
        helps.append("allowing full activation checkpointing")
    if max(training.micro_batch_sizes) > 1 or training.seq_len > 2048:
        helps.append("a smaller micro batch or shorter sequences")
    sizes = " x ".join(f"{k}={v}" for k, v in smallest.sizes().items() if v > 1) or "one device"
    return (f"no layout of {model.name} ({parameter_count(model.total_params)} parameters) fits {cluster.world_size} x "
            f"{cluster.name}: the smallest needs {need:.1f} GiB per device ({sizes}, zero_stage="
            f"{smallest.config.zero_stage}, activation_checkpointing={smallest.config.activation_checkpointing}), "
            f"the device has {cluster.memory_bytes / GiB:.1f} GiB ({have:.1f} GiB usable). What would help: "
            + "; ".join(helps))


__all__ = ["TrainingSpec", "Candidate", "plan_layouts", "enumerate_layouts", "evaluate", "normalize_fixed",
           "chosen_units", "layout_memory"]
