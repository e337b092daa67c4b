"""ParallelConfig: the size of every mesh dimension and the knobs of each technique.

One frozen dataclass describes a layout. ``validate(world_size)`` checks it against the number of
processes and returns a copy with every ``"auto"`` resolved; ``lightning_par.parallel.mesh.build_mesh(config)`` turns
it into one named :class:`~lightning_par.parallel.mesh.ParallelMesh`. Nothing here talks to other ranks before the sizes are known
to fit, so a bad layout fails with the same ``ValueError`` on every rank instead of hanging a collective.

This module never imports lightning (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional, Union, get_args

from lightning_par.layout.dimensions import DIMENSIONS, FIELD_NAMES, MESH_DIM_NAMES, Spelling
from lightning_par.layout.context_methods import CONTEXT_METHODS, ContextMethod
from lightning_par.layout.schedules import SCHEDULES, Schedule
from lightning_par.layout.zero_stages import ZERO_STAGE_ROWS, ZERO_STAGES, ZeroStage

Size = Union[int, Literal["auto"]]
# ZeRO-3's gather controls when nothing is scheduled: one block a unit, resharded after forward, FSDP2's own
# lookahead. A strategy given "auto" for them chooses from the model (lightning_par.layout.zero_units.choose_units).
ZERO3_UNIT_DEFAULTS = {"keep_gathered_blocks": 0, "prefetch_blocks": 0, "blocks_per_unit": 1}
# Each knob's values, declared once: the strategies' signatures (which LightningCLI reads) use these aliases, and
# the checks below their values.
Recompute = Literal["none", "full", "selective", "op"]
ContextParallelMethod = ContextMethod  # the names of layout.context_methods.CONTEXT_METHODS
PipelineSchedule = Schedule  # the names of layout.schedules.SCHEDULES
PipelineBalance = Literal["parameters", "profile"]
GradientCompression = Literal["none", "bf16", "fp16"]
Dtype = Literal["fp32", "bf16", "fp16"]
Float8Recipe = Literal["tensorwise", "rowwise"]

GRADIENT_COMPRESSIONS = get_args(GradientCompression)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
RECOMPUTE_MODES = get_args(Recompute)
CP_METHODS = tuple(sorted(CONTEXT_METHODS, key=lambda name: CONTEXT_METHODS[name].search_order))
PP_SCHEDULES = get_args(PipelineSchedule)
PP_BALANCE = get_args(PipelineBalance)
FLOAT8_RECIPES = get_args(Float8Recipe)


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the mesh dimensions ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first) plus ``ep``.

    Expert parallel (``ep``) is not a mesh dimension of its own: it borrows ranks from ``dp_shard x cp``
    (as in torchtitan and Megatron-Core), so adding experts does not multiply the world size.

    ``sequence_parallel`` keeps the activations between tensor-parallel regions split along the sequence.
    ``pp_schedule``, ``microbatches``, ``pp_virtual_stages`` (stages per rank, interleaved 1F1B) and
    ``pp_balance`` configure pipeline parallel (``lightning_par.parallel.pipeline``).
    ``loss_parallel`` keeps the head's logits split over the vocabulary under tensor parallel and computes
    the cross-entropy on the shards. ``cp_method`` is how context parallel attends across the sequence slices
    (``ulysses`` all-to-all or ``ring``; see ``lightning_par.parallel.context``).
    ``zero_stage`` shards model states over the data-parallel ranks (0: plain DDP; 1: optimizer states;
    2: + gradients; 3: + parameters, FSDP2), ``reshard_after_forward`` is the stage-3 trade of memory for
    one all-gather per block (``keep_gathered_blocks``: for the last N blocks only), ``prefetch_blocks`` how many
    blocks ahead stage 3 gathers (0: FSDP2's own lookahead), ``blocks_per_unit`` how many consecutive blocks it
    gathers and reduces as one unit; ``param_dtype`` / ``reduce_dtype`` (stage 3) compute in low precision from
    fp32 shards and reduce gradients in ``reduce_dtype`` (default: ``param_dtype``); ``cpu_offload``
    (stage 3) keeps shards, gradients and optimizer states in host memory; ``sharded_accumulation`` (stages 2
    and 3, under gradient accumulation) reduces gradients on every micro-batch so that they stay sharded,
    instead of accumulating whole ones and reducing once (see ``lightning_par.parallel.zero``).
    ``activation_checkpointing`` recomputes activations of every ``activation_checkpointing_every``-th block
    (``lightning_par.parallel.recompute``); ``compile`` compiles every block with ``torch.compile``
    (``lightning_par.parallel.compile``); ``float8`` trains the blocks' linear layers in torchao's Float8 with the
    ``tensorwise`` or ``rowwise`` recipe, ``float8_emulate`` rounding to float8 and multiplying in high precision
    (``lightning_par.parallel.float8``); ``async_tp`` overlaps sequence parallel's collectives with the matmuls
    beside them inside the compiled blocks (``lightning_par.parallel.async_tp``). Data-parallel knobs (``ddp_*``,
    ``gradient_compression``) configure PyTorch's ``DistributedDataParallel`` (Li et al. 2020, "PyTorch
    Distributed: Experiences on Accelerating Data Parallel Training") and apply to stages 0 and 1.

    ``spelling`` is how whoever made the config names its fields, so that every message about a size or knob says
    what the user wrote: a strategy's arguments (``tensor_parallel_size=2``), or the fields themselves
    (``tp=2``) for a config built directly. It is no part of the layout: not compared, hashed or shown.
    """

    pp: int = 1
    dp_replicate: Size = 1
    dp_shard: Size = "auto"
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    cp_method: ContextParallelMethod = "ulysses"
    pp_schedule: PipelineSchedule = "1f1b"
    microbatches: int = 4
    pp_virtual_stages: int = 2
    pp_balance: PipelineBalance = "parameters"
    zero_stage: int = 0
    reshard_after_forward: bool = True
    keep_gathered_blocks: int = 0
    prefetch_blocks: int = 0
    blocks_per_unit: int = 1
    param_dtype: Dtype = "fp32"
    reduce_dtype: Optional[Dtype] = None
    cpu_offload: bool = False
    sharded_accumulation: bool = False
    activation_checkpointing: Recompute = "none"
    activation_checkpointing_every: int = 1
    compile: bool = False
    float8: Optional[Float8Recipe] = None
    float8_emulate: bool = False
    async_tp: bool = False
    ddp_bucket_cap_mb: float = 25.0
    ddp_static_graph: bool = False
    ddp_find_unused_parameters: bool = False
    gradient_compression: GradientCompression = "none"
    spelling: Spelling = dataclasses.field(default=FIELD_NAMES, compare=False, repr=False)

    # ----------------------------------------------------------------------------------- sizes
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes in mesh order ``(pp, dp_replicate, dp_shard, cp, tp)``; the config must be resolved."""
        shape = tuple(getattr(self, name) for name in MESH_DIM_NAMES)
        if any(not isinstance(size, int) for size in shape):
            raise ValueError(f"{self.named_sizes()} still has 'auto' sizes: call validate(world_size) first")
        return shape

    @property
    def dp(self) -> int:
        """Number of data-parallel replicas of the model: ranks that read different samples."""
        return _as_int(self.dp_replicate) * _as_int(self.dp_shard)

    def describe(self) -> str:
        """The sizes as ``pp=1 x dp_replicate=2 x ...``, in the mesh's names (logs and records)."""
        return self._sizes_as(FIELD_NAMES)

    def name(self, field: str) -> str:
        """How the config's maker names ``field`` (``tensor_parallel_size``, or ``tp``)."""
        return self.spelling.name(field)

    def named(self, field: str) -> str:
        """``field`` and its value as the config's maker names it: ``tensor_parallel_size=2`` (or ``tp=2``), for
        messages."""
        return self.spelling.named(field, getattr(self, field))

    def named_sizes(self) -> str:
        """Every size, as the config's maker names them (the layout in messages)."""
        return self._sizes_as(self.spelling)

    def _sizes_as(self, spelling: Spelling) -> str:
        sizes = " x ".join(spelling.named(name, getattr(self, name)) for name in MESH_DIM_NAMES)
        return f"{sizes}, {spelling.named('ep', self.ep)}"

    # ------------------------------------------------------------------------------ validation
    def _validate_values(self) -> None:
        """What can be checked without the world size: size types and every knob."""
        for row in DIMENSIONS:
            _check_size(self.name(row.field), getattr(self, row.field), allow_auto=row.may_be_auto)
        self._check_knobs()

    def check_composable(self) -> None:
        """Raise ``ValueError`` when this layout combines techniques this version cannot compose. The strategies
        call it at construction, ``parallelize`` before applying anything, the planner to drop candidates.

        Every combination not refused here has a parity test against one process (docs/hybrid3d.md lists them).
        """
        stage = self.zero_stage
        if self.sharded_accumulation and stage not in (2, 3):
            raise ValueError(f"{self.name('sharded_accumulation')}=True with {self.named('zero_stage')}: only ZeRO-2 "
                             f"and ZeRO-3 shard gradients; use {self.name('zero_stage')} 2 or 3, or "
                             f"{self.name('sharded_accumulation')}=False")
        if self.pp > 1:
            if self.prefetch_blocks:
                raise ValueError(f"{self.named('pp')} with {self.named('prefetch_blocks')}: a pipeline schedule runs "
                                 "its blocks for several micro-batches in its own order, not one after the next; set "
                                 f"{self.name('prefetch_blocks')}=0 (the schedule keeps a stage gathered between its "
                                 "micro-batches)")
        if self.async_tp and not (self.tp > 1 and self.sequence_parallel and self.compile):
            raise ValueError(f"{self.name('async_tp')}=True with {self.named('tp')}, "
                             f"{self.named('sequence_parallel')}, {self.named('compile')}: async tensor parallel "
                             "splits sequence parallel's all-gathers and reduce-scatters into pieces that overlap the "
                             "matmuls beside them, a rewrite inductor makes in compiled blocks; it needs "
                             f"{self.name('tp')} > 1, {self.name('sequence_parallel')}=True and "
                             f"{self.name('compile')}=True")

    @property
    def zero(self) -> ZeroStage:
        """The row of ``zero_stage`` (``layout/zero_stages.py``): what it shards and how it reduces gradients."""
        return ZERO_STAGE_ROWS[self.zero_stage]

    @property
    def reduces_gradients_after_backward(self) -> bool:
        """Whether the data-parallel gradient average runs after backward (``Parallelized.after_backward``) instead of
        in hooks during it: under pipeline parallel (a schedule calls stage views, never the module DDP wraps, and
        runs backward itself) and, for DDP, for tensor-parallel DTensors (DDP all-reduces plain tensors only)."""
        reduction = self.zero.gradient_reduction
        return ((reduction == "all-reduce" and (self.pp > 1 or self.tp > 1))
                or (reduction == "to owners" and self.pp > 1))

    @property
    def gathers_into_the_weight_pass(self) -> bool:
        """ZeRO-3 inside ZB-V or DualPipeV: there FSDP2 keeps each block gathered from its forward to its backward
        (whatever ``reshard_after_forward`` says) and gathers weights as they are, not in float8. The weight-gradient
        pass of layers other than plain ``nn.Linear`` (experts, float8 linears: PyTorch's generic split, not this
        library's ``pipeline/weight_grad.py``) runs their backward again after the input-gradient pass, reading the
        gathered weights it saved, which resharding or the float8 gather has replaced by then: measured 0.1
        relative in the weights after 8 steps on float8 and MoE models. torchtitan keeps blocks gathered under
        every schedule."""
        return self.zero.shards_parameters and self.splits_backward

    @property
    def splits_backward(self) -> bool:
        """A pipeline whose schedule (ZB-V, DualPipeV: ``splits_backward`` in ``layout.schedules.SCHEDULES``) runs
        each backward as an input-gradient pass (``torch.autograd.grad``) and a later weight-gradient pass."""
        schedule = SCHEDULES.get(self.pp_schedule)  # None before validate() refuses an unknown name
        return self.pp > 1 and schedule is not None and schedule.splits_backward

    @property
    def pipeline_casts_without_cache(self) -> bool:
        """A pipeline whose every block is recomputed runs its schedule without autocast's weight cache
        (``parallel.pipeline.runner``): nothing keeps a cast weight for backward, so no copies and no piled-up bf16
        weight gradients (the planner counts one block's copies)."""
        return self.pp > 1 and self.activation_checkpointing == "full" and self.activation_checkpointing_every == 1

    def validate(self, world_size: int | None = None) -> ParallelConfig:
        """Check the layout against ``world_size`` processes and return it with ``"auto"`` resolved; without a world
        size, check what can be checked without one (size types and every knob: the strategies do so in their
        constructor, so a typo fails before any process starts) and return it as it is.

        Raises ``ValueError`` naming the offending sizes and what would fit.
        """
        if world_size is None:
            self._validate_values()
            return self
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self._validate_values()

        fixed = {name: getattr(self, name) for name in MESH_DIM_NAMES if getattr(self, name) != "auto"}
        product = math.prod(fixed.values())
        auto = [name for name in MESH_DIM_NAMES if getattr(self, name) == "auto"]
        if not auto and product != world_size:
            raise ValueError(
                f"{_product_text(fixed, self.spelling)} = {product} does not equal the world size {world_size}: "
                f"the mesh sizes must multiply to the number of processes; "
                f"{_suggest(fixed, world_size, self.spelling, exact=True)}"
            )
        if auto and world_size % product != 0:
            raise ValueError(
                f"{_product_text(fixed, self.spelling)} = {product} does not divide the world size {world_size}; "
                f"{_suggest(fixed, world_size, self.spelling)}"
            )
        resolved = dict(fixed)
        if auto:
            # One "auto" data dimension absorbs the remaining ranks; with both, sharding takes them
            # (replication across nodes is something a user asks for, sharding is the better default).
            for name in auto:
                resolved[name] = 1
            resolved["dp_shard" if "dp_shard" in auto else auto[0]] = world_size // product
        config = dataclasses.replace(self, **resolved)
        for row in DIMENSIONS:
            if row.divides:
                config._check_divides(row.field, row.divides, row.why_it_divides)
        return config

    def _check_divides(self, name: str, hosts: tuple[str, ...], why: str) -> None:
        """``name``'s size must divide the product of the (resolved) sizes ``hosts``."""
        host = math.prod(_as_int(getattr(self, host)) for host in hosts)
        if host % getattr(self, name) != 0:
            raise ValueError(
                f"{self.named(name)} does not divide {' x '.join(map(self.name, hosts))} = "
                f"{' x '.join(str(getattr(self, host)) for host in hosts)} = {host}: {why}. "
                f"Try {self.name(name)} in {divisors(host)}, or raise {self.name(hosts[0])}."
            )

    def _check_knobs(self) -> None:
        name, named = self.name, self.named
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            stages = ", ".join(f"{row.level}: {row.summary}" for row in ZERO_STAGE_ROWS.values())
            raise ValueError(f"{named('zero_stage')} is not one of {ZERO_STAGES} ({stages})")
        for knob in ("param_dtype", "reduce_dtype"):
            value = getattr(self, knob)
            if value not in DTYPES and not (knob == "reduce_dtype" and value is None):
                raise ValueError(f"{named(knob)} is not one of {tuple(DTYPES)}")
        stage3_only = {"param_dtype": self.param_dtype != "fp32",
                       "reduce_dtype": self.reduce_dtype not in (None, "fp32"), "cpu_offload": self.cpu_offload is True}
        for knob, asked in stage3_only.items():
            if asked and not self.zero.shards_parameters:
                raise ValueError(
                    f"{named(knob)} needs {name('zero_stage')}=3 (FSDP2 keeps fp32 shards and casts per block); "
                    f"with {named('zero_stage')} use Trainer(precision='bf16-mixed') instead"
                )
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"{named('pp_schedule')} is not one of {PP_SCHEDULES}")
        if self.pp_balance not in PP_BALANCE:
            raise ValueError(f"{named('pp_balance')} is not one of {PP_BALANCE}")
        for knob, least in (("microbatches", 1), ("pp_virtual_stages", 2), ("keep_gathered_blocks", 0),
                            ("prefetch_blocks", 0), ("blocks_per_unit", 1)):
            value = getattr(self, knob)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name(knob)} must be an integer >= {least}, got {value!r}")
        for knob, default in ZERO3_UNIT_DEFAULTS.items():
            if getattr(self, knob) != default and not self.zero.shards_parameters:
                raise ValueError(f"{named(knob)} schedules ZeRO-3's parameter all-gathers, and "
                                 f"{named('zero_stage')} keeps parameters whole; use {name('zero_stage')}=3 or "
                                 f"{name(knob)}={default}")
        if self.cp_method not in CP_METHODS:
            methods = "; ".join(f"{spec.name}: {spec.summary}" for spec in CONTEXT_METHODS.values())
            raise ValueError(f"{named('cp_method')} is not one of {CP_METHODS} ({methods})")
        if self.activation_checkpointing not in RECOMPUTE_MODES:
            raise ValueError(f"{named('activation_checkpointing')} is not one of {RECOMPUTE_MODES}")
        every = self.activation_checkpointing_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"{name('activation_checkpointing_every')} must be a positive integer, got {every!r}")
        if self.gradient_compression != "none" and self.zero.gradient_reduction != "all-reduce":
            raise ValueError(f"{named('gradient_compression')} applies to DDP's all-reduce ({name('zero_stage')} 0 "
                             f"or 1); {named('zero_stage')} reduces gradients differently")
        if self.gradient_compression not in GRADIENT_COMPRESSIONS:
            raise ValueError(f"{named('gradient_compression')} is not one of {GRADIENT_COMPRESSIONS}")
        bucket = self.ddp_bucket_cap_mb
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not bucket > 0:
            raise ValueError(f"{name('ddp_bucket_cap_mb')} must be a positive number of MiB, got {bucket!r}")
        for flag in ("ddp_static_graph", "ddp_find_unused_parameters", "reshard_after_forward", "cpu_offload",
                     "sequence_parallel", "loss_parallel", "sharded_accumulation", "compile", "float8_emulate",
                     "async_tp"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{name(flag)} must be true or false, got {getattr(self, flag)!r}")
        if self.float8 is not None and self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"{named('float8')} is not one of {FLOAT8_RECIPES} (tensorwise: one scale per tensor, "
                             "weights gathered in float8 under ZeRO-3; rowwise: one scale per row), or None")
        if self.float8_emulate and self.float8 is None:
            raise ValueError(f"{name('float8_emulate')}=True emulates float8 matmuls, and {name('float8')} is None; "
                             f"set {name('float8')} to one of {FLOAT8_RECIPES} or {name('float8_emulate')}=False")
        if self.ddp_static_graph and self.ddp_find_unused_parameters:
            raise ValueError(
                f"{name('ddp_static_graph')}=True and {name('ddp_find_unused_parameters')}=True exclude each other: "
                "a static graph already records which parameters are unused in the first iteration; keep one of them"
            )

def shard_size(data_parallel_size: Size, replicate_size: int) -> Size:
    """``dp_shard`` when ``data_parallel_size`` ranks form ``replicate_size`` replicated groups (HSDP).

    ``"auto"`` stays ``"auto"``. ``data_parallel_size`` is checked here, where it is still the argument the user
    gave (under HSDP no field holds it); a bad ``replicate_size`` is passed on for :meth:`ParallelConfig.validate`.
    """
    _check_size("data_parallel_size", data_parallel_size, allow_auto=True)
    if data_parallel_size == "auto" or not _positive(replicate_size):
        return data_parallel_size
    if data_parallel_size % replicate_size != 0:
        raise ValueError(f"replicate_size={replicate_size} does not divide data_parallel_size={data_parallel_size}: "
                         "HSDP needs shard groups of equal size")
    return data_parallel_size // replicate_size


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_size(name: str, value: object, *, allow_auto: bool) -> None:
    if value == "auto" and allow_auto:
        return
    if value == "auto":
        raise ValueError(
            f"{name}='auto' is not supported: only the data-parallel sizes can be 'auto' "
            f"(give {name} as a positive integer, or use the auto_parallel strategy to plan it)"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " or 'auto'" if allow_auto else ""
        raise ValueError(f"{name} must be a positive integer{hint}, got {value!r}")


def _as_int(value: Size) -> int:
    if not isinstance(value, int):
        raise ValueError(f"size {value!r} is not resolved: call validate(world_size) first")
    return value


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the sizes that split ``n`` evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _product_text(sizes: dict[str, int], spelling: Spelling) -> str:
    shown = {k: v for k, v in sizes.items() if v != 1} or sizes
    return " x ".join(spelling.named(name, size) for name, size in shown.items())


def _suggest(fixed: dict[str, int], world_size: int, spelling: Spelling, *, exact: bool = False) -> str:
    """Name the values of the largest model-parallel size that would fit with every other size as given, e.g.
    'try tp=2 or tp=4' (innermost first among equals). ``exact``: no size is 'auto', so the product must equal the
    world size, not divide it."""
    model_dims = [row.field for row in reversed(DIMENSIONS)
                  if row.in_mesh and not row.may_be_auto and fixed.get(row.field, 1) > 1]
    if not model_dims:
        return f"sizes whose product divides {world_size}: {divisors(world_size)}"
    name = max(model_dims, key=lambda n: fixed[n])
    others = math.prod(v for k, v in fixed.items() if k != name)
    fits = [d for d in divisors(world_size) if d > 1 and d != fixed[name]
            and (d * others == world_size if exact else world_size % (d * others) == 0)]
    if not fits:
        return (f"no {spelling.name(name)} fits with the other sizes; world size {world_size} has divisors "
                f"{divisors(world_size)}")
    return "try " + " or ".join(spelling.named(name, d) for d in fits)
