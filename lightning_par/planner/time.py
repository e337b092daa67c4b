"""Step-time model: compute at a fraction of peak, collectives per mesh dimension, the pipeline bubble.

Compute is the work of the heaviest pipeline rank in three classes, each at its own rate (``ClusterSpec``):
the linear layers' ``6N`` FLOPs per token at ``peak x compute_efficiency`` (Float8 linears, torchao's, at
``peak_flops_fp8 x compute_efficiency x`` :data:`FLOAT8_MATMUL_EFFICIENCY`), attention's ``12·L·h·s`` (PaLM's count, as ``llama_flops_per_token``)
at ``peak x attention_efficiency``, and the element-wise ops' bytes (:data:`ELEMENTWISE_PASSES_H`,
:data:`ELEMENTWISE_PASSES_F`; fewer under ``torch.compile``) over the memory bandwidth. Full activation
checkpointing adds one more forward of the blocks (1/3 of their work), selective a few per cent for the
element-wise ops it reruns (Korthikanti et al. 2022, table 4), per-op that and the forward of the matmuls whose
outputs it drops (about a third of a Llama block's).

Collectives move bytes over rings (bus bandwidth): an all-reduce sends ``2(d-1)/d`` of its tensor per rank,
an all-gather or reduce-scatter ``(d-1)/d`` of the whole tensor, an all-to-all ``(d-1)/d`` of the local one.
A dimension whose ranks fit in one node uses NVLink, otherwise the network. In mesh order
``pp, dp_replicate, dp_shard, cp, tp`` the innermost dimensions are the consecutive ranks, so ``tp``
spans ``tp`` ranks, ``cp`` spans ``tp x cp``, and so on outwards (:func:`spans`).

* tp (Shoeybi et al. 2019): per block two all-reduces of b·s·h forward and two backward (sequence parallel:
  an all-gather and a reduce-scatter in place of each, the same bytes; Korthikanti et al. 2022); the head
  all-gathers the logits unless the loss is vocabulary-parallel. Not overlapped.
* cp: Ulysses, four all-to-alls (q, k, v, output) each way per block; ring, ``cp - 1`` key/value hops
  forward and key/value/gradient hops backward; plus the gather of the sequence after the last block.
  This implementation waits for each exchange, so none of it is overlapped.
* ep: per MoE block four all-to-alls (dispatch and combine, forward and backward) of the routed tokens.
* pp (Narayanan et al. 2021): point-to-point of one micro-batch's hidden states per stage boundary, forward
  and backward; the bubble is ``(p-1)/m`` of the compute for GPipe and 1F1B, ``(p-1)/(v·m)`` interleaved,
  and a residual of ZB-V's ideal zero (Qi et al. 2024) when forward, input- and weight-gradient passes
  differ in length (each schedule's ``bubble`` in ``lightning_par.layout.schedules.SCHEDULES``).
* dp: gradients all-reduced once per step (DDP, ZeRO-1), reduced to their owners (ZeRO-2, and ZeRO-1 where
  they are averaged after backward: pipelines, tensor parallel) or
  reduce-scattered (ZeRO-3, Rajbhandari et al. 2020); ZeRO-1/2 then broadcast the updated parameters;
  ZeRO-3 all-gathers every block's parameters in forward and again in backward, every micro-batch. Gradient
  reduction overlaps the last backward, parameter gathers the compute of their micro-batch, each behind at most
  :data:`COLLECTIVE_OVERLAP` of that compute; what cannot hide (at least the last unit's share) is exposed.
  Under a pipeline, ``torch.distributed.pipelining`` keeps an FSDP stage gathered between its backward passes
  and reduce-scatters once after the schedule (``set_reshard_after_backward(False)``): without
  ``reshard_after_forward`` the parameters are gathered once per step, and the reduction is exposed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from lightning_par.layout.config import ParallelConfig
from lightning_par.layout.context_methods import CONTEXT_METHODS
from lightning_par.layout.schedules import SCHEDULES
from lightning_par.planner.cluster import ClusterSpec
from lightning_par.planner.memory import (
    RankStages,
    block_local_params,
    local_params,
    matmul_activation_bytes,
    param_bytes,
    rank_stages,
    residual_bytes,
    stages_per_rank,
)
from lightning_par.planner.model import ModelSpec
from lightning_par.planner.muon import muon_step

SELECTIVE_RECOMPUTE_OVERHEAD = 0.03  # of the blocks' compute: element-wise ops rerun (Korthikanti, table 4)

# HBM traffic of a block's element-wise ops in eager PyTorch, forward + backward, in reads and writes of an
# activation-sized tensor per token, counted from the block's ops (not fitted): two RMSNorms with their fp32 casts,
# rotary on q and k, the layout copies around attention, two residual adds (about 60 h-wide passes forward, twice that
# backward), and SwiGLU's silu and product (about 5 f-wide passes forward, twice that backward).
ELEMENTWISE_PASSES_H = 180
ELEMENTWISE_PASSES_F = 15

# ---- calibration against published runs (lightning_par.planner.published; docs/planner.md has the table), fitted by
# code (lightning_par.planner.refit.fit) to the rows that name each; tests/test_planner_published.py holds them to it.
# Of the eager element-wise traffic, what is left once torch.compile (Inductor) fuses the chains: torchtitan's
# Llama 3.1 8B on 8 H100s, 5,762 tokens/s/GPU eager and 6,667 compiled.
COMPILED_ELEMENTWISE_FRACTION = 0.304
# Float8 linears (torchao, dynamic tensorwise scaling), as a share of the doubled float8 peak against bf16's share of
# the bf16 peak, casts and scaling included: torchtitan's 8B from 6,667 tokens/s/GPU compiled to 8,532 with Float8
# (the casts and amax reductions around each GEMM, and GEMMs too small to fill the tensor cores at twice the rate).
FLOAT8_MATMUL_EFFICIENCY = 0.729
# Collectives overlapped with compute slow it (NCCL kernels take SMs and memory bandwidth) and wait for their
# inputs: at most this fraction of the compute they run under hides them. Megatron's ZeRO-3 comparison
# (Narayanan et al. 2021, table 2: 144 TFLOP/s at 384 A100s, 44 at 1,536), with INFINIBAND_BUS_EFFICIENCY.
COLLECTIVE_OVERLAP = 0.676


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest rank. ``comm`` holds each dimension's whole
    communication time, ``exposed`` the part not hidden behind compute, ``comm_bytes`` the bytes one rank
    sends per step."""

    compute: float
    recompute: float
    bubble: float
    comm: dict[str, float] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)
    model_flops: float = 0.0  # per step, the whole cluster, without recomputation (for MFU)
    tokens: float = 0.0  # per step
    work: dict[str, float] = field(default_factory=dict)  # ``compute`` by kind: linear, attention, elementwise, head
    optimizer: float = 0.0  # the optimizer step; 0 unless the cluster has an ``optimizer_rate``

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.bubble + sum(self.exposed.values()) + self.optimizer

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.total

    def mfu(self, cluster: ClusterSpec, precision: str = "bf16-mixed") -> float:
        """Model FLOPs utilisation (Chowdhery et al. 2022): useful FLOP/s over the cluster's peak."""
        return self.model_flops / (self.total * cluster.world_size * cluster.flops(precision))

    def as_dict(self) -> dict[str, Any]:
        return {"compute": self.compute, "recompute": self.recompute, "bubble": self.bubble,
                "optimizer": self.optimizer,
                **{f"{k}_exposed": v for k, v in self.exposed.items()},
                **{f"{k}_comm": v for k, v in self.comm.items()},
                **{f"{k}_bytes": v for k, v in self.comm_bytes.items()}, "total": self.total}


def spans(config: ParallelConfig) -> dict[str, int]:
    """How many consecutive global ranks each dimension's group spans (innermost dimension first)."""
    tp, cp, shard, rep = config.tp, config.cp, int(config.dp_shard), int(config.dp_replicate)
    return {"tp": tp, "cp": tp * cp, "ep": tp * config.ep, "dp_shard_cp": tp * cp * shard,
            "dp_cp": tp * cp * shard * rep, "dp_replicate": tp * cp * shard * rep,
            # neighbouring stages are world/pp ranks apart: the whole pipeline fits a node only if the world does
            "pp": tp * cp * shard * rep * config.pp}


def _all_reduce(nbytes: float, d: int) -> float:
    return 2 * (d - 1) / d * nbytes if d > 1 else 0.0


def _gather(nbytes: float, d: int) -> float:
    """All-gather or reduce-scatter of a ``nbytes`` whole tensor, or all-to-all of a ``nbytes`` local one."""
    return (d - 1) / d * nbytes if d > 1 else 0.0


def _exposed(comm: float, overlap_with: float, units: int, overlap: float = COLLECTIVE_OVERLAP) -> float:
    """Communication overlapped with ``overlap_with`` seconds of compute, issued in ``units`` pieces: what
    ``overlap`` (:data:`COLLECTIVE_OVERLAP` unless the cluster says otherwise) of the compute cannot hide is
    exposed, and at least the last piece (nothing is left to hide it behind)."""
    if comm <= 0:
        return 0.0
    return max(comm - overlap * overlap_with, comm / max(units, 1))


def _compiled_fraction(cluster: ClusterSpec) -> float:
    if cluster.compiled_elementwise_fraction is None:
        return COMPILED_ELEMENTWISE_FRACTION
    return cluster.compiled_elementwise_fraction


@functools.lru_cache(maxsize=4096)
def _recomputed_matmul_share(model: ModelSpec, moe: bool) -> float:
    """The share of a block's matmul FLOPs that per-op recomputation runs again in backward: the even matmuls of
    ``ModelSpec.block_matmuls``, but a dense block's down projection, whose output backward never needs (the
    recomputation stops once it has what backward needs)."""
    matmuls = model.block_matmuls(moe)
    rerun = sum(weights for name, weights, _ in matmuls[1::2] if moe or name != "down")
    return rerun / sum(weights for _, weights, _ in matmuls)


def _block_seconds(model: ModelSpec, cluster: ClusterSpec, moe: bool, *, tp: int, cp: int, sequence_parallel: bool,
                   seq_len: int, precision: str, compiled: bool, float8: bool) -> dict[str, float]:
    """Seconds of one block's forward + backward per token of the whole sequence on one tp x cp rank, by kind of
    work: its linear layers, its attention, its element-wise ops. Cached (the search costs thousands of layouts
    with the same few tp x cp splits): callers read the dict and never change it."""
    peak = cluster.flops(precision)
    attention = 12 * model.hidden * seq_len
    linear = model.block_flops_per_token(moe, seq_len) - attention
    linear_rate = peak * cluster.compute_efficiency
    if float8:
        if cluster.peak_flops_fp8 is None:
            raise ValueError(f"float8 on {cluster.name}: the device has no float8 tensor cores (peak_flops_fp8 is "
                             "None); plan without float8, or give the cluster's float8 peak")
        float8_share = FLOAT8_MATMUL_EFFICIENCY if cluster.float8_matmul_efficiency is None \
            else cluster.float8_matmul_efficiency
        linear_rate = cluster.peak_flops_fp8 * cluster.compute_efficiency * float8_share
    seconds = {"linear": linear / linear_rate,
               "attention": attention / (peak * cluster.attention_rate_fraction)}
    seconds = {kind: value / (tp * cp) for kind, value in seconds.items()}
    seconds["elementwise"] = 0.0
    if cluster.memory_bandwidth is not None:
        ffn = model.moe_top_k * model.expert_hidden if moe else model.ffn_hidden
        h = model.hidden / (tp if sequence_parallel else 1)  # norms, residual adds: split by tp only under SP
        passes = ELEMENTWISE_PASSES_H * h + ELEMENTWISE_PASSES_F * ffn / tp
        seconds["elementwise"] = passes * matmul_activation_bytes(precision) / cluster.memory_bandwidth / cp \
            * (_compiled_fraction(cluster) if compiled else 1.0)
    return seconds


def estimate_step_time(model: ModelSpec, config: ParallelConfig, cluster: ClusterSpec, *, seq_len: int,
                       microbatch_size: int, microbatches: int, precision: str = "bf16-mixed",
                       compiled: bool = False, float8: bool = False, optimizer: str = "adamw") -> StepTime:
    """Seconds per optimizer step of ``config`` on ``cluster``: ``microbatches`` micro-batches of
    ``microbatch_size`` sequences per data-parallel rank (global batch = that x dp). ``compiled``: the
    blocks run under ``torch.compile``; ``float8``: their linear layers in Float8 (torchao), the head in bf16;
    ``optimizer="muon"``: Muon's Newton-Schulz iterations and gathers (planner/muon.py) in the optimizer step."""
    config.mesh_shape()
    tp, cp, pp, ep = config.tp, config.cp, config.pp, config.ep
    dp = config.dp
    m, mbs = microbatches, microbatch_size
    rate = cluster.flops(precision) * cluster.compute_efficiency
    a, r = matmul_activation_bytes(precision), residual_bytes(precision)
    span = spans(config)
    h = model.hidden
    kinds = dict(tp=tp, cp=cp, sequence_parallel=config.sequence_parallel, seq_len=seq_len, precision=precision,
                 compiled=compiled, float8=float8)
    dense_s, moe_s = (_block_seconds(model, cluster, moe, **kinds) for moe in (False, True))

    # ---- compute per micro-batch on each pipeline rank; the slowest sets the pace
    # Ranks with the same blocks and ends do the same work: each is costed once, by the first of them (the one max
    # would pick among their equal sums).
    per_rank: dict[tuple[int, int, bool], tuple[dict[str, float], RankStages]] = {}
    for stages in rank_stages(model, config):
        key = (stages.n_dense, stages.n_moe, stages.head)
        if key in per_rank:
            continue
        work = {kind: (stages.n_dense * dense_s[kind] + stages.n_moe * moe_s[kind]) * mbs * seq_len
                for kind in dense_s}
        # this rank's tokens: under cp the logits are gathered after the head (parallel.context.GatherAtHead)
        work["head"] = model.head_flops_per_token * mbs * seq_len / (tp * cp) / rate if stages.head else 0.0
        per_rank[key] = (work, stages)
    work, stages = max(per_rank.values(), key=lambda x: sum(x[0].values()))
    head_seconds = work["head"]
    block_seconds = sum(work.values()) - head_seconds
    compute_mb = block_seconds + head_seconds
    checkpointing = config.activation_checkpointing
    recompute_mb = {"none": 0.0, "full": block_seconds / 3}.get(checkpointing,
                                                                SELECTIVE_RECOMPUTE_OVERHEAD * block_seconds)
    if checkpointing == "op":  # and the forward of the matmuls whose outputs it drops
        recompute_mb += mbs * seq_len / 3 * (
            stages.n_dense * dense_s["linear"] * _recomputed_matmul_share(model, False)
            + (stages.n_moe * moe_s["linear"] * _recomputed_matmul_share(model, True) if stages.n_moe else 0.0))
    compute, recompute = m * compute_mb, m * recompute_mb
    forward_mb, backward_mb = compute_mb / 3, 2 * compute_mb / 3 + recompute_mb

    bubble = 0.0
    if pp > 1:  # the schedule's row of layout.schedules.SCHEDULES: its bubble as a share of the compute
        bubble = SCHEDULES[config.pp_schedule].bubble(pp, m, config.pp_virtual_stages) * (compute + recompute)

    comm: dict[str, float] = {}
    volume: dict[str, float] = {}
    exposed: dict[str, float] = {}
    n_blocks = stages.n_blocks
    tokens = mbs * seq_len / cp  # per micro-batch in the blocks of this rank

    # ---- tensor parallel: not overlapped
    if tp > 1:
        activation = tokens * h * a
        per_block = (4 + (2 if config.activation_checkpointing == "full" else 0)) * _all_reduce(activation, tp)
        ends = 0.0
        if stages.embedding:
            ends += _all_reduce(mbs * seq_len * h * r, tp) / (2 if config.sequence_parallel else 1)
        if stages.head:
            # the head's input: gathered forward and reduce-scattered backward (sequence parallel), or
            # all-reduced backward: the same bytes
            ends += _all_reduce(mbs * seq_len * h * a, tp)
            if not config.loss_parallel:
                ends += _gather(mbs * seq_len * model.vocab_size * a, tp)
        volume["tp"] = m * (n_blocks * per_block + ends)
        comm["tp"] = exposed["tp"] = volume["tp"] / cluster.bandwidth(span["tp"])

    # ---- context parallel (lightning_par.parallel.context), per tensor-parallel rank: its heads; the method's row of
    # layout.context_methods.CONTEXT_METHODS gives its exchanges and whether they hide behind attention
    if cp > 1:
        method = CONTEXT_METHODS[config.cp_method]
        local = tokens * h * a / tp  # one (B, H/tp, T/cp, D) tensor
        per_block = method.exchange_bytes(local, model.heads // tp, max(model.kv_heads // tp, 1), cp,
                                          config.activation_checkpointing == "full")
        gather = _gather(mbs * seq_len * model.vocab_size / tp * a, cp) if stages.head else 0.0  # the logits
        volume["cp"] = m * (n_blocks * per_block + gather)
        comm["cp"] = exposed["cp"] = volume["cp"] / cluster.bandwidth(span["cp"])
        if method.hides_behind_attention:  # each exchange behind the attention of the blocks at hand
            attention = m * n_blocks * dense_s["attention"] * mbs * seq_len * (cp - 1) / cp  # this rank's, per step
            hiding = COLLECTIVE_OVERLAP if cluster.collective_overlap is None else cluster.collective_overlap
            exposed["cp"] = _exposed(comm["cp"] - m * gather / cluster.bandwidth(span["cp"]), attention,
                                     m * n_blocks, hiding) + m * gather / cluster.bandwidth(span["cp"])

    # ---- expert parallel
    moe_blocks = stages.n_moe
    if ep > 1 and moe_blocks:
        routed = tokens * model.moe_top_k * h * a
        count = 4 + (2 if config.activation_checkpointing == "full" else 0)
        volume["ep"] = m * moe_blocks * count * _gather(routed, ep)
        comm["ep"] = exposed["ep"] = volume["ep"] / cluster.bandwidth(span["ep"])

    # ---- pipeline point-to-point
    if pp > 1:
        hidden = tokens * h * r / (tp if config.sequence_parallel else 1)
        volume["pp"] = m * 2 * hidden * stages_per_rank(config)
        comm["pp"] = exposed["pp"] = volume["pp"] / cluster.bandwidth(span["pp"])

    # ---- data parallel / ZeRO
    params, _, experts = local_params(model, config, stages)
    dense = params - experts
    pbytes = param_bytes(precision)
    gbytes = pbytes / (2 if config.gradient_compression != "none" and pbytes == 4 else 1)
    shard, rep = int(config.dp_shard), int(config.dp_replicate)
    partition = shard * cp  # the ranks ZeRO-1/2 partition over (lightning_par.parallel.zero.PARTITION_GROUP)
    stage = config.zero_stage
    units = n_blocks + 1
    reductions = m if config.sharded_accumulation else 1  # ZeRO-2/3 gradient reductions per optimizer step
    dp_seconds = exposed_dp = dp_bytes = 0.0
    hiding = COLLECTIVE_OVERLAP if cluster.collective_overlap is None else cluster.collective_overlap

    def add(nbytes: float, group_span: int, overlap: float | None) -> None:
        share([(nbytes, group_span)], overlap)

    def share(parts: list[tuple[float, int]], overlap: float | None) -> None:
        """Collectives that hide behind the same ``overlap`` seconds of compute (None: exposed)."""
        nonlocal dp_seconds, exposed_dp, dp_bytes
        seconds = sum(nbytes / cluster.bandwidth(group_span) for nbytes, group_span in parts)
        dp_bytes += sum(nbytes for nbytes, _ in parts)
        dp_seconds += seconds
        exposed_dp += seconds if overlap is None else _exposed(seconds, overlap, units, hiding)

    # ZeRO-1/2: each owner broadcasts what it stepped (ZeroRedundancyOptimizer), the experts' owners to the ranks
    # holding the same experts (lightning_par.parallel.zero_experts).
    expert_partition = max(partition // ep, 1)
    broadcast = _gather(dense * pbytes, partition) + _gather(experts * pbytes, expert_partition)
    if stage in (0, 1):
        # DDP overlaps its bucketed all-reduce with backward; pipeline stages and tensor-parallel DTensors are
        # reduced in one flat all-reduce after the last backward instead (lightning_par.parallel.ddp.
        # reduce_gradients, as Megatron-LM does under pipeline parallelism): nothing left to hide it behind.
        after_backward = config.reduces_gradients_after_backward
        if stage == 1 and after_backward:
            # ZeRO-1 there reduces each gradient to its owner only (parallel.zero.reduce_gradients_to_owners):
            # half an all-reduce, then averaged across dp_replicate.
            add(_gather(dense * gbytes, partition), span["dp_shard_cp"], None)
            add(_all_reduce(dense * gbytes / partition, rep), span["dp_replicate"], None)
        else:
            add(_all_reduce(dense * gbytes, dp * cp), span["dp_cp"], None if after_backward else backward_mb)
        if stage == 1:
            add(broadcast, span["dp_shard_cp"], None)
    elif stage == 2:
        add(reductions * _gather(dense * gbytes, partition), span["dp_shard_cp"], reductions * backward_mb)
        add(reductions * _all_reduce(dense * gbytes / partition, rep), span["dp_replicate"],  # HSDP: across groups
            reductions * backward_mb)
        add(broadcast, span["dp_shard_cp"], None)
    else:
        fsdp = shard * cp
        gather_bytes = 2 if config.param_dtype in ("bf16", "fp16") else pbytes
        reduce_bytes = {None: gather_bytes, "fp32": 4, "bf16": 2, "fp16": 2}[config.reduce_dtype]
        # Every micro-batch gathers again, each gather hidden behind its own micro-batch's compute. Blocks are
        # gathered for forward and again for backward; the root unit (embedding, norm, head) stays gathered.
        blocks = stages.n_dense * block_local_params(model, config, False) \
            + stages.n_moe * block_local_params(model, config, True)
        # Under a pipeline (torch.distributed.pipelining) a stage stays gathered from its first backward to the end
        # of the schedule and reduces once after it: one gather per step (plus a re-gather per backward with
        # reshard_after_forward), and the reduction exposed.
        gathers = 1 if pp > 1 else m  # under a pipeline later forwards find the stage gathered by a backward

        def sharded(per_param: float) -> float:
            # Experts split over ep are sharded over the dp_shard x cp / ep ranks holding the same experts
            # (lightning_par.parallel.zero.fully_shard_model), the rest over all dp_shard x cp.
            return _gather(dense * per_param, fsdp) + _gather(experts * per_param, max(fsdp // ep, 1))

        add(gathers * sharded(gather_bytes), span["dp_shard_cp"], gathers * forward_mb)
        resharded = 1 - min(config.keep_gathered_blocks, stages.n_dense + stages.n_moe) / max(
            stages.n_dense + stages.n_moe, 1)  # the blocks kept gathered are not gathered again for backward
        regather = [(m * _gather(blocks * gather_bytes * resharded, fsdp), span["dp_shard_cp"])] \
            if config.reshard_after_forward and not config.gathers_into_the_weight_pass else []
        reduce = [(reductions * sharded(reduce_bytes), span["dp_shard_cp"]),
                  (reductions * _all_reduce(params * reduce_bytes / fsdp, rep), span["dp_replicate"])]  # + HSDP
        if pp > 1:
            share(regather, m * backward_mb)
            share(reduce, None)
        else:  # backward's re-gathers and reductions hide behind the same backward compute
            share(regather + reduce, max(m if regather else 0, reductions) * backward_mb)
    if ep > 1 and experts and stage != 3:  # (ZeRO-3 reduce-scatters experts over their replicas, above)
        replicas = shard * cp // ep
        add(_all_reduce(experts * gbytes, replicas), span["dp_shard_cp"], backward_mb)
    if dp_bytes:
        volume["dp"], comm["dp"], exposed["dp"] = dp_bytes, dp_seconds, exposed_dp

    # ---- the optimizer step, where the cluster gives its rate (measured clusters; the published runs' presets
    # leave it out, as their calibration did): AdamW updates this rank's share of the parameters, which ZeRO
    # divides by the ranks that shard the optimizer states (memory.py's accounting).
    optimizer_seconds = 0.0
    if cluster.optimizer_rate is not None:
        stepped = params if stage == 0 else dense / partition + experts / expert_partition
        optimizer_seconds = stepped / cluster.optimizer_rate

    if optimizer == "muon":  # its iterations (bf16, as torch's Muon) and its gathers of sharded matrices, exposed
        flops, gathered = muon_step(model, config, stages.n_dense, stages.n_moe)
        optimizer_seconds += flops / (cluster.flops("bf16-mixed") * cluster.compute_efficiency)
        if gathered:
            group = span["dp_shard_cp"] if config.zero.shards_parameters else span["tp"]
            volume["muon"] = gathered
            comm["muon"] = exposed["muon"] = gathered / cluster.bandwidth(group)

    step_tokens = mbs * m * dp * seq_len
    return StepTime(compute=compute, recompute=recompute, bubble=bubble, comm=comm, exposed=exposed,
                    optimizer=optimizer_seconds,
                    comm_bytes=volume, model_flops=model.flops_per_token(seq_len) * step_tokens, tokens=step_tokens,
                    work={kind: m * seconds for kind, seconds in work.items()})


__all__ = ["StepTime", "estimate_step_time", "spans", "COLLECTIVE_OVERLAP", "FLOAT8_MATMUL_EFFICIENCY",
           "ELEMENTWISE_PASSES_H", "ELEMENTWISE_PASSES_F", "COMPILED_ELEMENTWISE_FRACTION"]
