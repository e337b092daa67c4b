"""Human-readable output of a search: a ranked table and why the first layout won."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_par.layout.config import ParallelConfig
from lightning_par.layout.context_methods import CONTEXT_METHODS
from lightning_par.layout.schedules import SCHEDULES
from lightning_par.planner.cluster import GiB
from lightning_par.planner.search import Candidate
from lightning_par.planner.time import spans


def layout_name(candidate: Candidate) -> str:
    """Compact sizes, e.g. ``pp4 dp2 tp8+sp`` (dimensions of size 1 left out; HSDP as replicas x shards,
    ``dp2x4``)."""
    c = candidate.config
    parts = []
    if c.pp > 1:
        parts.append(f"pp{c.pp}")
    rep, shard = int(c.dp_replicate), int(c.dp_shard)
    if rep > 1 and c.zero.shards_optimizer_states:  # HSDP: replicas x shards (the shards may be only the cp ranks)
        parts.append(f"dp{rep}x{shard}")
    elif rep * shard > 1:
        parts.append(f"dp{rep * shard}")
    if c.cp > 1:
        parts.append(f"cp{c.cp}{CONTEXT_METHODS[c.cp_method].label}")
    if c.tp > 1:
        parts.append(f"tp{c.tp}" + ("+sp" if c.sequence_parallel else "") + ("+lp" if c.loss_parallel else ""))
    if c.ep > 1:
        parts.append(f"ep{c.ep}")
    return " ".join(parts) or "1 device"


def schedule_name(candidate: Candidate) -> str:
    c = candidate.config
    if c.pp == 1:
        return f"acc {candidate.microbatches}" if candidate.microbatches > 1 else "-"
    label = SCHEDULES[c.pp_schedule].label.format(v=c.pp_virtual_stages)
    return f"{label} m{candidate.microbatches}"


def _unit(candidates: Sequence[Candidate]) -> tuple[str, float]:
    # GiB for real models; MiB for the small ones a CPU run trains, whose GiB would all read 0.0.
    largest = max((c.memory.total for c in candidates), default=0.0)
    return ("GiB", GiB) if largest >= GiB else ("MiB", 2**20)


def _time_unit(candidates: Sequence[Candidate]) -> tuple[str, float]:
    slowest = max((c.time.total for c in candidates), default=0.0)
    return ("s", 1.0) if slowest >= 1 else ("ms", 1e-3)


def describe(candidate: Candidate) -> str:
    """Layout, ZeRO stage, recomputation and schedule in one phrase."""
    c = candidate.config
    return (f"{layout_name(candidate)}, zero_stage={c.zero_stage}"
            f"{', sharded_accumulation' if c.sharded_accumulation else ''}, activation_checkpointing="
            f"{c.activation_checkpointing}, {schedule_name(candidate)}")


def format_table(candidates: Sequence[Candidate], top: int = 10) -> str:
    """The ``top`` candidates as a fixed-width table: layout, ZeRO stage, recomputation, schedule (or gradient
    accumulation), memory per rank in GiB (model states / activations incl. logits / the rest), step time in
    seconds (compute incl. recomputation / bubble / exposed communication), tokens per second and MFU."""
    unit, scale = _unit(candidates[:top])
    tunit, tscale = _time_unit(candidates[:top])
    header = (f"{'#':>2}  {'layout':<22} {'zero':>4} {'AC':<9} {'schedule':<11} {'mbs':>3} {'mem ' + unit:>7} "
              f"{'= states':>8} {'+ act':>6} {'+ other':>7}  {'step ' + tunit:>7} {'= compute':>9} {'+ bubble':>8} "
              f"{'+ comm':>7}  {'tokens/s':>9} {'MFU':>5}")
    lines = [header, "-" * len(header)]
    for rank, c in enumerate(candidates[:top], start=1):
        m, t = c.memory, c.time
        act = m.activations + m.logits
        other = m.total - m.model_states - act
        comm = sum(t.exposed.values())
        lines.append(
            f"{rank:>2}  {layout_name(c):<22} {_zero(c.config):>4} {c.config.activation_checkpointing:<9} "
            f"{schedule_name(c):<11} {c.microbatch_size:>3} {m.total / scale:>7.1f} {m.model_states / scale:>8.1f} {act / scale:>6.1f} "
            f"{other / scale:>7.1f}  {t.total / tscale:>7.2f} {(t.compute + t.recompute) / tscale:>9.2f} "
            f"{t.bubble / tscale:>8.2f} {comm / tscale:>7.2f}  "
            f"{t.tokens_per_second:>9.0f} {c.mfu:>5.1%}")
    if candidates:
        c = candidates[0]
        lines.append(f"({len(candidates)} layouts fit {c.cluster.world_size} x {c.cluster.name}, "
                     f"{c.cluster.usable_memory_bytes / GiB:.1f} of {c.cluster.memory_bytes / GiB:.0f} GiB usable "
                     "per device; 'other' = autocast copies, recomputation, loss workspace, communication buffers"
                     + ("; zero '3s': gradients reduced on every accumulated batch (sharded_accumulation)"
                        if any(x.config.sharded_accumulation for x in candidates[:top]) else "") + ")")
    return "\n".join(lines)


def _zero(config: ParallelConfig) -> str:
    return f"{config.zero_stage}{'s' if config.sharded_accumulation else ''}"


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 0.1 or value == 0 else f"{value * 1e3:.2f} ms"


def explain(candidates: Sequence[Candidate]) -> str:
    """Why the first candidate was chosen, in a few sentences of facts from the models."""
    if not candidates:
        return "no layout fits"
    best = candidates[0]
    c, cluster, m, t = best.config, best.cluster, best.memory, best.time
    node = cluster.devices_per_node
    span = spans(c)
    unit, scale = _unit([best])
    reasons = [f"{describe(best)}: {_seconds(t.total)} per step, "
               f"{t.tokens_per_second:,.0f} tokens/s, MFU {best.mfu:.1%}",
               f"fits in {m.total / scale:.1f} {unit} of {cluster.memory_bytes / GiB:.0f} GiB "
               f"(model states {m.model_states / scale:.1f}, activations {(m.activations + m.logits) / scale:.1f})"]

    def where(dim_span: int) -> str:
        fast = "on NVLink " if cluster.name.startswith(("h100", "h200", "a100")) else ""
        return f"{fast}inside a node" if dim_span <= node else "across nodes over the network"

    if c.tp > 1:
        reasons.append(f"tp={c.tp} keeps tensor-parallel all-reduces {where(span['tp'])} "
                       f"({_seconds(t.exposed.get('tp', 0))} per step)")
    if c.cp > 1:
        reasons.append(f"cp={c.cp} ({c.cp_method}) {where(span['cp'])} ({_seconds(t.exposed.get('cp', 0))})")
    if c.pp > 1:
        reasons.append(f"pp={c.pp} {'over nodes' if span['pp'] > node else 'inside the node'}: point-to-point "
                       f"only ({_seconds(t.exposed.get('pp', 0))}), bubble {_seconds(t.bubble)} with {best.microbatches} "
                       f"micro-batches ({c.pp_schedule})")
    if c.dp > 1 or c.zero.shards_parameters:
        kind = c.zero.label
        group = span["dp_shard_cp"] if c.zero.shards_gradients else span["dp_cp"]
        hsdp = int(c.dp_replicate) > 1 and c.zero.shards_optimizer_states
        shards = int(c.dp_shard) * (c.cp if c.zero.shards_parameters else 1)
        sharded = f"sharded over {shards} ranks {where(group)}, " \
            f"replicated {int(c.dp_replicate)} times {where(span['dp_replicate'])}" if hsdp else where(group)
        reasons.append(f"dp={c.dp} ({kind}) {sharded}: {_seconds(t.comm.get('dp', 0))} of communication, "
                       f"{_seconds(t.exposed.get('dp', 0))} not hidden behind compute"
                       + (f"; gradients reduced on each of the {best.microbatches} accumulated batches to keep them "
                          "sharded" if c.sharded_accumulation else ""))
    if c.activation_checkpointing != "none":
        reasons.append(f"{c.activation_checkpointing} recomputation costs {_seconds(t.recompute)} and buys the memory")
    if len(candidates) > 1:
        runner = next((x for x in candidates[1:] if layout_name(x) != layout_name(best)), candidates[1])
        # By throughput: layouts planned for a per-rank batch (planner.runtime) train different global batches.
        margin = t.tokens_per_second / runner.time.tokens_per_second - 1
        reasons.append(f"{margin:.1%} more tokens/s than the next layout ({describe(runner)})")
    return "Chosen: " + "; ".join(reasons) + "."


__all__ = ["format_table", "explain", "describe", "layout_name", "schedule_name"]
