"""The dimensions of a layout, one row each, and how whoever made a layout spells them.

The root mesh has the dimensions ``pp, dp_replicate, dp_shard, cp, tp``, outermost first: tensor parallel is innermost
so that its heavy all-reduces stay on the fastest links (inside a node), pipeline parallel outermost because its
point-to-point traffic tolerates slow links (docs/architecture.md, "One mesh, named dimensions"). Expert parallel
(``ep``) is a dimension of the layout but not of the mesh: it borrows its ranks from ``dp_shard x cp``.

:data:`DIMENSIONS` is the one place a dimension is declared: its ``ParallelConfig`` field, the strategies' arguments
for its size and knobs, whether it may be ``"auto"``, what its size must divide, and what the planner costs for it.
The mesh order, the sizes that may be ``"auto"`` and the strategies' spelling (:func:`strategy_spelling`) are read
from it. This module imports nothing of the package (tests/test_layering.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass(frozen=True)
class Dimension:
    """One dimension of a layout. Every size is a positive integer; a mesh dimension's sizes multiply to the world
    size (``ParallelConfig.validate``)."""

    field: str  # the ParallelConfig field, and the mesh dimension's name
    argument: str  # the strategies' argument for its size
    knobs: Mapping[str, str]  # the ParallelConfig fields that configure its technique -> the strategies' arguments
    in_mesh: bool  # a dimension of the root mesh (ep is not: it borrows dp_shard x cp)
    may_be_auto: bool  # "auto" takes the ranks the other sizes leave (only data parallel: it changes no split)
    divides: tuple[str, ...]  # the dimensions whose product its size must divide, beyond the world size
    why_it_divides: str  # the reason, for the message when it does not
    planner: str  # what the planner costs for it (lightning_par/planner/memory.py, time.py)


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(
        "pp", "pipeline_parallel_size",
        {"pp_schedule": "pipeline_schedule", "microbatches": "microbatches", "pp_virtual_stages": "virtual_stages",
         "pp_balance": "pipeline_balance"},
        in_mesh=True, may_be_auto=False, divides=(), why_it_divides="",
        planner="memory: each rank's stages' blocks and the micro-batches in flight under the schedule; time: the "
                "bubble and the point-to-point hidden states at each stage boundary"),
    Dimension(
        "dp_replicate", "replicate_size",
        {"ddp_bucket_cap_mb": "bucket_cap_mb", "ddp_static_graph": "static_graph",
         "ddp_find_unused_parameters": "find_unused_parameters", "gradient_compression": "gradient_compression"},
        in_mesh=True, may_be_auto=True, divides=(), why_it_divides="",
        planner="memory: nothing (replicas hold the same states); time: the gradient all-reduce across the "
                "replicas (the 'dp' term)"),
    Dimension(
        "dp_shard", "data_parallel_size",
        {name: name for name in ("zero_stage", "reshard_after_forward", "keep_gathered_blocks", "prefetch_blocks",
                                 "blocks_per_unit", "param_dtype", "reduce_dtype", "cpu_offload",
                                 "sharded_accumulation")},
        in_mesh=True, may_be_auto=True, divides=(), why_it_divides="",
        planner="memory: ZeRO's division of the model states by dp_shard x cp; time: the gradient reductions, "
                "ZeRO-1/2's broadcasts and ZeRO-3's gathers (the 'dp' term)"),
    Dimension(
        "cp", "context_parallel_size", {"cp_method": "context_parallel_method"},
        in_mesh=True, may_be_auto=False, divides=(), why_it_divides="",
        planner="memory: the blocks' activations divided by cp, the head's on the whole sequence; time: Ulysses' "
                "all-to-alls or the ring's key/value hops and the gather after the last block (the 'cp' term)"),
    Dimension(
        "tp", "tensor_parallel_size",
        {name: name for name in ("sequence_parallel", "loss_parallel", "async_tp")},
        in_mesh=True, may_be_auto=False, divides=(), why_it_divides="",
        planner="memory: the attention, MLP and vocabulary weights and their activations divided by tp (the norms' "
                "too with sequence parallel); time: two all-reduces per block each way, not overlapped (the 'tp' "
                "term)"),
    Dimension(
        "ep", "expert_parallel_size", {},
        in_mesh=False, may_be_auto=False, divides=("dp_shard", "cp"),
        why_it_divides="expert parallel borrows its ranks from the sharded data-parallel and context-parallel "
                       "dimensions",
        planner="memory: each MoE block's experts divided by ep, ZeRO-3 sharding them over dp_shard x cp / ep; "
                "time: four all-to-alls of the routed tokens per MoE block (the 'ep' term)"),
)

MESH_DIM_NAMES = tuple(row.field for row in DIMENSIONS if row.in_mesh)
#: The sizes that may be "auto": the model-parallel ones change memory and speed too much to be guessed (the planner
#: of the auto_parallel strategy chooses them from a cost model instead).
AUTO_SIZES = tuple(row.field for row in DIMENSIONS if row.may_be_auto)
#: Flattened views of the root mesh, by the dimensions they join (``lightning_par.parallel.mesh``).
FLATTENED_DIMS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "cp_tp": ("cp", "tp"),
    "data_parallel": ("dp_replicate", "dp_shard"),
    "tensor_parallel": ("tp",),
}


def dimension(name: str) -> Dimension:
    """The row of the dimension ``name`` (a ParallelConfig field)."""
    for row in DIMENSIONS:
        if row.field == name:
            return row
    raise KeyError(f"no dimension {name!r}; dimensions: {[row.field for row in DIMENSIONS]}")


@dataclass(frozen=True)
class Spelling:
    """How whoever made a layout names its fields: ParallelConfig field -> name, for the fields named otherwise. The
    empty spelling keeps the fields' own names (a ParallelConfig built directly); the strategies'
    (:func:`strategy_spelling`) names their arguments, so that a message says what the user wrote."""

    names: Mapping[str, str] = field(default_factory=dict)

    def name(self, field_name: str) -> str:
        return self.names.get(field_name, field_name)

    def named(self, field_name: str, value: object) -> str:
        """``tensor_parallel_size=2`` (or ``tp=2``): the field with ``value``, as its maker spells it."""
        return f"{self.name(field_name)}={value!r}"

    def spell(self, message: str) -> str:
        """``message``, written with the fields' own names (as ``parallel/`` words its refusals: ``tp=4``), with each
        field named as its maker names it. A field's name is replaced where it stands as a word of its own: not
        inside a longer name (``dp_cp``) or a dotted path (``layers.tp.weight``)."""
        for field_name in sorted(self.names, key=len, reverse=True):
            message = re.sub(rf"(?<![\w.]){re.escape(field_name)}(?!\w|\.\w)", self.names[field_name], message)
        return message

    def spell_error(self, error: BaseException) -> None:
        """Reword ``error``'s message in place with :meth:`spell`: a refusal of the compute code (a ``ValueError``)
        reaches the user in the names they wrote."""
        if isinstance(error, ValueError) and error.args and isinstance(error.args[0], str):
            error.args = (self.spell(error.args[0]), *error.args[1:])


FIELD_NAMES = Spelling()

#: What ``data_parallel_size`` sets in a strategy: ``dp_shard`` (most strategies), ``dp_replicate``
#: (DataParallelStrategy: every rank a replica), ``dp``: the product ``dp_replicate x dp_shard`` (HSDP, where
#: ``replicate_size`` sets ``dp_replicate``), or None (a strategy without the argument).
DataParallelSize = Optional[Literal["dp_shard", "dp_replicate", "dp"]]


def strategy_spelling(data_parallel_size_sets: DataParallelSize) -> Spelling:
    """The strategies' names for the fields: each dimension's argument and its knobs' (what differs from the field),
    with ``data_parallel_size`` where ``data_parallel_size_sets`` says."""
    names = {row.field: row.argument for row in DIMENSIONS}
    names.update({knob: argument for row in DIMENSIONS for knob, argument in row.knobs.items()})
    if data_parallel_size_sets == "dp_replicate":
        names.update(dp_replicate="data_parallel_size", dp_shard="dp_shard")
    elif data_parallel_size_sets == "dp":
        names["dp_shard"] = "data_parallel_size/replicate_size"
    elif data_parallel_size_sets is None:
        names["dp_shard"] = "dp_shard"
    return Spelling({name: spelled for name, spelled in names.items() if name != spelled})


def argument_fields() -> dict[str, str]:
    """The strategies' argument -> the ParallelConfig field it sets, where the two differ; ``data_parallel_size`` is
    ``dp``, the number of ranks that read different samples (``dp_replicate x dp_shard``)."""
    arguments = {row.argument: row.field for row in DIMENSIONS}
    arguments.update({argument: knob for row in DIMENSIONS for knob, argument in row.knobs.items()})
    arguments["data_parallel_size"] = "dp"
    return {argument: name for argument, name in arguments.items() if argument != name}


__all__ = ["AUTO_SIZES", "DIMENSIONS", "FIELD_NAMES", "FLATTENED_DIMS", "MESH_DIM_NAMES", "DataParallelSize",
           "Dimension", "Spelling", "argument_fields", "dimension", "strategy_spelling"]
