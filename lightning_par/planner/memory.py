"""Per-rank memory of a layout: model states (ZeRO), activations (Korthikanti et al.), buffers.

Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models"). With AdamW every parameter has a weight, a gradient and two moments. Lightning's "32-true" and
"bf16-mixed" both keep fp32 weights (autocast computes in bf16 from them), so 4 + 4 + 8 = 16 bytes; under
"bf16-true" the weights are bf16 and ``torch.optim.AdamW`` creates its moments in the parameters' dtype,
so 2 + 2 + 4 = 8 bytes. ZeRO-1 divides the moments, ZeRO-2 the gradients too (both by whole tensors,
:func:`zero_owner_params`), ZeRO-3 (FSDP2) all three, by the sharding ranks ``dp_shard x cp`` (context-parallel
ranks hold the same weights and shard with the data-parallel ones, as in ``lightning_par.parallel.zero``); the HSDP
replicate dimension does not shard. Under gradient accumulation this project skips the reduction of all but the
last micro-batch (``Parallelized.no_sync``): ZeRO-2's reducer and FSDP2 then keep the whole local gradient
until the last backward, so the gradient saving of stages 2 and 3 only holds with one micro-batch.

Tensor parallel (Shoeybi et al. 2019, "Megatron-LM") divides the attention and MLP matrices and the
vocabulary of the embedding and head by ``tp``; norms stay whole. Pipeline parallel (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") gives each rank its
stages' blocks, balanced by parameters like ``lightning_par.parallel.pipeline.split.balance`` (the embedding on the
first stage, final norm and head on the last; a tied head is a copy of the embedding on the last stage), and each
stage's model states are sharded by ZeRO over the stage's own data-parallel ranks: ZeRO-1 partitions a stage's
optimizer states, ZeRO-3 makes each stage an FSDP2 root. The schedule's micro-batches accumulate gradients like
gradient accumulation does (FSDP2 keeps a stage's whole until its last backward). Expert parallel divides each MoE
block's experts by ``ep``; ZeRO-3 then shards them over the ``dp_shard x cp / ep`` ranks holding the same experts
only, not over all of ``dp_shard x cp`` like the rest (torchtitan's EP x FSDP). tests/test_planner_memory.py measures
these compositions' model states per rank.

Activations, per token and per block, for THIS architecture (``lightning_par.models.llama``), in the
manner of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
sec. 4.1, which counts 34 bytes x s x b x h for GPT blocks in fp16 plus 5·a·s²·b for attention scores).
Reading the forward op by op, autograd keeps (``a`` = bytes of a matmul activation: 4 in fp32, 2 in bf16):

* each RMSNorm: its input ``x`` (``pow`` and ``x * rsqrt`` need it), the normalised ``x * rsqrt`` (the
  gain's gradient needs it) and the (b, s, 1) ``rsqrt``. Under bf16-mixed the residual stream stays fp32
  (the embedding is not autocast and ``x + attn(...)`` promotes), so a norm keeps 4h + 4h bytes; under
  bf16-true ``x.float()`` is a new fp32 tensor: 4h + 2h. Two norms per block;
* the input of the q/k/v projections (one tensor shared by the three: a·h) and of gate/up (a·h); under
  bf16-mixed autocast casts the fp32 norm output once per projection, so 3 x 2h and 2 x 2h;
* rotary: ``x1 * cos`` keeps only ``cos``/``sin`` (the tables need no gradient), not q or k;
* SDPA keeps q (rotated), k and v (repeated to the query heads under GQA: ``repeat_interleave`` before the
  call, so h wide, not kv_dim), its output and the fp32 logsumexp (4 bytes per head): 4·a·h + 4·heads.
  No s² term: the fused kernel never stores the scores, which is why Korthikanti's "selective"
  recomputation has nothing left to drop here. The o_proj input is a view of the SDPA output;
* SwiGLU: gate output (``silu`` needs it), ``silu`` output and up output (the product needs both), the
  product (down's input): 4·a·f.

Per block and token: 32-true 40h + 16f + 4·heads + 8 bytes; bf16-mixed 34h + 8f + 4·heads + 8. Under
tensor parallel the attention and MLP internals are split by ``tp``; the norms' tensors only with
sequence parallel (Korthikanti sec. 4.2.2), and the projections' inputs never: DTensor saves the
all-gathered input of a column-parallel linear (Megatron re-gathers it in backward instead). Context
parallel divides the tokens by ``cp``; Ulysses keeps its head-split q/k/v/out and a separate o_proj input
(5·a·h), ring attention q/k/v, an fp32 output and the o_proj input. The final norm, head and loss run on the
whole sequence on every context-parallel rank (``_GatherSequence``), and keep the fp32 log-softmax of the
logits (4·V per token; V/tp under loss parallel).

Activation checkpointing: "full" keeps each block's input only and rebuilds one block's working set in
backward; "selective" (``lightning_par.parallel.recompute``) keeps the block input and every matmul and
SDPA output (q, k, v, attention output, o_proj, gate, up, down) and recomputes the element-wise ops; "op" keeps
the attention output and every second matmul output of a block call (``ModelSpec.block_matmuls``: q, v, gate,
down; with grouped experts the router and up) and recomputes the rest. An expert loop of one matmul per expert
(``models.moe``'s fallback without grouped GEMMs) keeps every second expert's instead, which the "op" estimate of
an MoE block does not follow.

Pipeline schedules keep several micro-batches in flight, each schedule's ``in_flight`` of
``lightning_par.layout.schedules.SCHEDULES``: GPipe all ``m``; 1F1B ``p - r`` on rank ``r``; interleaved 1F1B
``2(p - r - 1) + (v - 1)p + 1`` model chunks (Megatron, giving the first rank ``1 + (p - 1)/(p·v)`` times 1F1B's
activations); ZB-V ``2p`` chunks of ``L/2p`` blocks on every rank (the memory of 1F1B, Qi et al. 2024).

Buffers: DDP's gradient buckets (a second copy of the gradients), FSDP2's gathered units (the block being
computed and the one prefetched, plus the root unit, kept gathered after forward), pipeline receive
buffers (torch.distributed.pipelining keeps one per micro-batch, for the activation and for its gradient);
transients: one block's recomputation with its ring-attention scores, or the loss's gradients (the two are never
held at once: the loss's backward runs first). Each figure is held to ``lightning-par check``'s dry run of the real
layout code (tests/test_dry_run.py, docs/planner.md "Checking before the cluster").
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import asdict, dataclass

from lightning_par.layout import schedules
from lightning_par.layout.config import ParallelConfig
from lightning_par.layout.context_methods import CONTEXT_METHODS
from lightning_par.planner.model import ModelSpec
from lightning_par.planner.muon import muon_state_share

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
# Lightning's precision names (Trainer(precision=...)) as the memory model counts them: fp16 like bf16.
LIGHTNING_PRECISIONS = {"32": "32-true", "32-true": "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
                        "16-mixed": "bf16-mixed", "16": "bf16-mixed", "bf16-true": "bf16-true", "16-true": "bf16-true"}
OPTIMIZERS = ("adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit", "muon")
# Bytes of AdamW's two moments a parameter where they are not the parameters' dtype: bf16 (lightning_par.optim), and
# torchao's block-quantised codes with a fp32 scale a block of 256 (8-bit) or 128 (4-bit). Muon keeps one buffer a
# block matrix (planner/muon.py).
MOMENT_BYTES = {"adamw_bf16": 4.0, "adamw_8bit": 2 * (1 + 4 / 256), "adamw_4bit": 2 * (0.5 + 4 / 128)}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank needs (the heaviest pipeline rank, ``stage``). ``resident`` is what lives from the
    forward to the backward of a micro-batch; ``total`` adds the transients and buffers."""

    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    logits: float
    autocast_copies: float
    recompute: float
    loss_workspace: float
    comm_buffers: float
    stage: int = 0
    attention_scores: float = 0.0  # ring attention's chunk-pair scores while a block's attention runs
    # One micro-batch a step: its gradients are made in backward as its activations are freed, never both whole
    gradients_after_activations: bool = False

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def resident(self) -> float:
        return self.model_states + self.activations + self.logits + self.autocast_copies

    @property
    def total(self) -> float:
        # The loss's backward runs before the blocks' (and their recomputation): its workspace and a block's rebuilt
        # activations, or its attention's scores, are never held at once.
        total = self.resident + max(self.recompute + self.attention_scores, self.loss_workspace) + self.comm_buffers
        if not self.gradients_after_activations:
            return total
        # Backward makes the gradients of the blocks it has passed and frees their activations: at any moment a
        # share of each, so the peak is before the first gradient (the loss's backward) or after the last.
        return max(total - self.gradients, self.model_states + self.comm_buffers)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "model_states": self.model_states, "resident": self.resident, "total": self.total}


# ------------------------------------------------------------------------------------------ precisions
def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")


def param_bytes(precision: str) -> int:
    """Bytes per stored weight (and per gradient, and per AdamW moment)."""
    return 2 if precision == "bf16-true" else 4


def matmul_activation_bytes(precision: str) -> int:
    return 4 if precision == "32-true" else 2


def computed_precision(precision: str, config: ParallelConfig) -> str:
    """The precision a layout's activations are in: ZeRO-3 gathering 16-bit parameters computes as ``bf16-true``
    does whatever Lightning's precision (FSDP2's ``MixedPrecisionPolicy`` casts every unit's floating inputs to its
    parameters' dtype, so the residual stream, the stage boundaries and the logits are 16-bit), else ``precision``."""
    return "bf16-true" if config.zero.shards_parameters and config.param_dtype in ("bf16", "fp16") else precision


def residual_bytes(precision: str) -> int:
    """The residual stream between blocks: fp32 under autocast (see the module docstring)."""
    return 2 if precision == "bf16-true" else 4


# --------------------------------------------------------------------------------------- stage layout
@dataclass(frozen=True)
class RankStages:
    """What pipeline rank ``rank`` holds: its blocks (stage by stage) and whether it has the ends."""

    rank: int
    stage_blocks: tuple[tuple[int, ...], ...]
    embedding: bool
    head: bool
    n_moe: int = 0  # how many of its blocks hold experts

    # Cached (frozen, and rank_stages hands out the same instances): the search reads them for every layout.
    @functools.cached_property
    def blocks(self) -> tuple[int, ...]:
        return tuple(b for stage in self.stage_blocks for b in stage)

    @functools.cached_property
    def n_blocks(self) -> int:
        return sum(len(stage) for stage in self.stage_blocks)

    @functools.cached_property
    def n_dense(self) -> int:
        return self.n_blocks - self.n_moe

    @functools.cached_property
    def kind(self) -> tuple[int, int, bool, bool, int]:
        """What a rank's memory depends on besides its rank: (dense blocks, MoE blocks, embedding, head, stages).
        Pipeline ranks of one kind differ only in the micro-batches they hold in flight."""
        return self.n_dense, self.n_moe, self.embedding, self.head, len(self.stage_blocks)


def stages_per_rank(config: ParallelConfig) -> int:
    """Pipeline stages per rank of ``config`` (1 without pipeline parallel)."""
    return 1 if config.pp == 1 else schedules.stages_per_rank(config.pp_schedule, config.pp_virtual_stages)


@functools.lru_cache(maxsize=256)
def _balanced_sizes(costs: tuple[int, ...], n_stages: int, first: int, last: int) -> tuple[int, ...]:
    """Blocks per stage as ``parallel.pipeline`` balances them by parameter counts (cached: the search asks
    for the same split many times)."""
    if n_stages > len(costs):
        raise ValueError(f"{n_stages} pipeline stages need at least {n_stages} blocks, the model has {len(costs)}")
    return tuple(schedules.balance(costs, n_stages, first=first, last=last))


def rank_stages(model: ModelSpec, config: ParallelConfig) -> tuple[RankStages, ...]:
    """The blocks and ends every pipeline rank holds (one entry without pipeline parallel)."""
    return _rank_stages(model, config.pp, config.pp_schedule if config.pp > 1 else "1f1b",
                        stages_per_rank(config))


@functools.lru_cache(maxsize=1024)
def _rank_stages(model: ModelSpec, pp: int, schedule: str, per_rank: int) -> tuple[RankStages, ...]:
    if pp == 1:
        blocks = tuple(range(model.layers))
        return (RankStages(0, (blocks,), True, True, sum(map(model.moe_layer, blocks))),)
    n_stages = pp * per_rank
    costs = tuple(model.block_params(i) for i in range(model.layers))
    sizes = _balanced_sizes(costs, n_stages, model.embedding_params,
                            model.final_norm_params + model.vocab_size * model.hidden)
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    result = []
    for rank in range(pp):
        stages = sorted(schedules.stage_indices(rank, pp, schedule, per_rank))
        blocks = tuple(tuple(range(starts[s], starts[s] + sizes[s])) for s in stages)
        n_moe = sum(model.moe_layer(b) for stage in blocks for b in stage)
        result.append(RankStages(rank, blocks, 0 in stages, n_stages - 1 in stages, n_moe))
    return tuple(result)


def in_flight(config: ParallelConfig, rank: int, microbatches: int) -> float:
    """Micro-batches whose activations rank ``rank`` holds at its peak, in units of the whole rank's blocks
    (the module docstring gives each schedule's rule)."""
    p, m = config.pp, microbatches
    if p == 1:
        return 1.0  # gradient accumulation: each micro-batch's backward frees its activations
    return schedules.SCHEDULES[config.pp_schedule].in_flight(p, rank, m, config.pp_virtual_stages)


# ------------------------------------------------------------------------------- activations per token
def kept_input_bytes(model: ModelSpec, precision: str, *, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes per token of a block's input (the residual stream; split by tp under sequence parallel): what a
    recomputed block keeps, and what a pipeline stage receives."""
    return residual_bytes(precision) * model.hidden / (tp if sequence_parallel else 1)


def block_activation_bytes(model: ModelSpec, *, moe: bool = False, precision: str, tp: int = 1,
                           sequence_parallel: bool = False, cp: int = 1, cp_method: str = "ulysses",
                           checkpointing: str = "none") -> float:
    """Bytes a dense (or, with ``moe``, a mixture-of-experts) block keeps for backward per token this rank
    processes (see the module docstring)."""
    h, heads = model.hidden, model.heads
    a = matmul_activation_bytes(precision)
    outside = tp if sequence_parallel else 1  # the norms' region: split by tp only under sequence parallel
    block_input = kept_input_bytes(model, precision, tp=tp, sequence_parallel=sequence_parallel)
    if checkpointing == "full":
        return block_input
    if checkpointing == "selective":
        q_k_v = a * (h + 2 * model.kv_dim)
        ffn = _ffn_selective_bytes(model, moe, a)
        attention_out = a * h + 4 * heads
        # o_proj and down outputs are partial sums of the whole hidden size on every tensor-parallel rank.
        return block_input + (q_k_v + attention_out + ffn) / tp + 2 * a * h
    if checkpointing == "op":
        # The odd matmuls' outputs (ModelSpec.block_matmuls), the attention output, and the router's fp32 logits and
        # probabilities as "selective" keeps them; o_proj and a dense down are partial sums of the whole hidden size
        # on every tensor-parallel rank.
        kept = model.block_matmuls(moe)[::2]
        whole = sum(width for name, _, width in kept if name in ("o", "down") and not moe)
        split = sum(width for name, _, width in kept if name != "router") - whole
        router = 8 * model.moe_experts if moe else 0
        return block_input + (a * split + a * h + 4 * heads + router) / tp + a * whole
    norm = {"32-true": 8 * h, "bf16-mixed": 8 * h, "bf16-true": 6 * h}[precision] + 4
    if precision == "bf16-mixed":
        attention_input, ffn_input = 3 * 2 * h, (1 if moe else 2) * 2 * h  # an MoE's router casts once
    else:
        attention_input = ffn_input = a * h
    if cp > 1:  # the method's row of layout.context_methods.CONTEXT_METHODS
        attention = CONTEXT_METHODS[cp_method].attention_activation_bytes(a, h, heads, cp)
    else:
        attention = 4 * a * h + 4 * heads
    ffn = _ffn_bytes(model, moe, a)
    return 2 * norm / outside + attention_input + ffn_input + (attention + ffn) / tp


def _ffn_bytes(model: ModelSpec, moe: bool, a: int) -> float:
    if not moe:
        return 4 * a * model.ffn_hidden
    # Router: fp32 logits and probabilities, the chosen experts and weights; each of the top_k copies of a
    # token: the gathered token (a·h), the SwiGLU's four tensors (4·a·f), the expert output and its fp32
    # weighted copy (2 x 4·h).
    k, e = model.moe_top_k, model.moe_experts
    return 8 * e + 16 * k + k * (a * model.hidden + 4 * a * model.expert_hidden + 8 * model.hidden)


def _ffn_selective_bytes(model: ModelSpec, moe: bool, a: int) -> float:
    if not moe:
        return 2 * a * model.ffn_hidden
    return 8 * model.moe_experts + model.moe_top_k * a * (2 * model.expert_hidden + model.hidden)


def final_activation_bytes(model: ModelSpec, *, precision: str, tp: int = 1, sequence_parallel: bool = False,
                           loss_parallel: bool = False) -> tuple[float, float]:
    """(final norm + head input, logits kept by the loss) bytes per token of the whole sequence."""
    h, v = model.hidden, model.vocab_size
    a = matmul_activation_bytes(precision)
    norm = {"32-true": 8 * h, "bf16-mixed": 8 * h, "bf16-true": 6 * h}[precision] + 4
    head_input = a * h
    ids = 8 + 8  # int64 token ids (embedding) and targets (loss)
    logits = 4 * v / (tp if loss_parallel else 1)  # fp32 log-softmax output
    return norm / (tp if sequence_parallel else 1) + head_input + ids, logits


def loss_workspace_bytes(model: ModelSpec, *, precision: str, tp: int = 1, loss_parallel: bool = False) -> float:
    """Transient bytes per token while the loss's backward runs, beside the fp32 log-softmax output that the logits
    term keeps: the gradients of the log-softmax output and of its input, fp32 whatever the precision (the fp32 copy
    of 16-bit logits is not kept for backward, and their 16-bit gradient comes once the first is freed). Under loss
    parallel, PyTorch's fused backward holds three such tensors on the vocabulary shard (its zeros, the exponential and
    their sum)."""
    per_vocab = 12 if loss_parallel and tp > 1 else 8
    return per_vocab * model.vocab_size / (tp if loss_parallel else 1)


# --------------------------------------------------------------------------------------- the estimate
def local_params(model: ModelSpec, config: ParallelConfig, stages: RankStages) -> tuple[float, float, float]:
    """(all, matmul weights, expert weights) this rank holds before ZeRO sharding."""
    tp, ep = config.tp, config.ep
    n, n_moe = stages.n_blocks, stages.n_moe
    experts = n_moe * model.expert_params / ep
    matmul = n * model.attention_params / tp + (n - n_moe) * model.mlp_params / tp + experts \
        + n_moe * model.router_params
    total = matmul + n * model.norm_params
    vocab = model.vocab_size * model.hidden / tp
    if stages.embedding:
        total += vocab
    if stages.head:
        total += model.final_norm_params
        matmul += vocab
        # A tied head shares the embedding's tensor when one rank holds both; a later stage holds a copy.
        if not (model.tie_embeddings and stages.embedding):
            total += vocab
    return total, matmul, experts


def estimate_memory(model: ModelSpec, config: ParallelConfig, *, seq_len: int, microbatch_size: int,
                    precision: str = "bf16-mixed", microbatches: int = 1, optimizer: str = "adamw") -> MemoryBreakdown:
    """Per-rank memory of ``config`` (fully sized) for micro-batches of ``microbatch_size`` sequences of
    ``seq_len`` tokens, ``microbatches`` of them per optimizer step on each data-parallel rank (pipeline
    micro-batches, or gradient accumulation steps). Returns the heaviest pipeline rank's breakdown."""
    # max(rank_memory(...), key=total), without building every rank's breakdown: a rank's total only grows with the
    # micro-batches it holds in flight (its kind fixes the rest, and float sums and products of non-negative bytes
    # are monotonic), so a rank holding no more than an earlier one of its kind cannot be heavier than that one,
    # and max keeps the first of equals.
    heaviest: MemoryBreakdown | None = None
    most: dict[tuple[int, int, bool, bool, int], float] = {}  # the most held in flight so far, by kind of rank
    for stages, one, held in _ranks(model, config, seq_len=seq_len, microbatch_size=microbatch_size,
                                    precision=precision, microbatches=microbatches, optimizer=optimizer):
        if stages.kind in most and held <= most[stages.kind]:
            continue
        most[stages.kind] = held
        breakdown = _on_rank(one, held, stages.rank)
        if heaviest is None or breakdown.total > heaviest.total:
            heaviest = breakdown
    assert heaviest is not None  # every layout has a pipeline rank
    return heaviest


def rank_memory(model: ModelSpec, config: ParallelConfig, *, seq_len: int, microbatch_size: int,
                precision: str = "bf16-mixed", microbatches: int = 1,
                optimizer: str = "adamw") -> tuple[MemoryBreakdown, ...]:
    """The breakdown of every pipeline rank, in rank order (one without pipeline parallel): what
    :func:`estimate_memory` takes the heaviest of, and what a measurement of each stage is compared with."""
    return tuple(_on_rank(one, held, stages.rank) for stages, one, held in _ranks(
        model, config, seq_len=seq_len, microbatch_size=microbatch_size, precision=precision,
        microbatches=microbatches, optimizer=optimizer))


def _ranks(model: ModelSpec, config: ParallelConfig, *, seq_len: int, microbatch_size: int, precision: str,
           microbatches: int, optimizer: str) -> list[tuple[RankStages, MemoryBreakdown, float]]:
    """Every pipeline rank in rank order: (its stages, the breakdown of its kind of rank with ONE micro-batch's
    activations, the micro-batches it holds in flight). Most ranks hold the same blocks (a middle rank's stages are
    alike): each kind of rank is costed once, and its ranks differ only in the micro-batches in flight."""
    _check_precision(precision)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {OPTIMIZERS}")
    config.mesh_shape()  # raises if sizes are still "auto"
    # A block's activations per token, kept for backward and rebuilt by recomputation, are the same on every rank.
    knobs = dict(precision=computed_precision(precision, config), tp=config.tp,
                 sequence_parallel=config.sequence_parallel, cp=config.cp, cp_method=config.cp_method)
    kept = {moe: block_activation_bytes(model, moe=moe, checkpointing=config.activation_checkpointing, **knobs)
            for moe in (False, True)}
    rebuilt = {moe: block_activation_bytes(model, moe=moe, **knobs) for moe in (False, True)} \
        if config.activation_checkpointing != "none" else kept
    kinds: dict[tuple[int, int, bool, bool, int], MemoryBreakdown] = {}
    ranks = []
    for stages in rank_stages(model, config):
        one = kinds.get(stages.kind)
        if one is None:
            one = kinds[stages.kind] = _rank_memory(model, config, stages, seq_len=seq_len, mbs=microbatch_size,
                                                    precision=precision, microbatches=microbatches, kept=kept,
                                                    rebuilt=rebuilt, optimizer=optimizer)
        ranks.append((stages, one, in_flight(config, stages.rank, microbatches)))
    return ranks


def _on_rank(one: MemoryBreakdown, held: float, rank: int) -> MemoryBreakdown:
    """The breakdown of a kind of rank with one micro-batch's activations (:func:`_rank_memory`) on pipeline rank
    ``rank``, which holds ``held`` micro-batches' (built field by field: ``dataclasses.replace`` is slow)."""
    return MemoryBreakdown(parameters=one.parameters, gradients=one.gradients, optimizer_states=one.optimizer_states,
                           activations=one.activations * held, logits=one.logits,
                           autocast_copies=one.autocast_copies, recompute=one.recompute,
                           loss_workspace=one.loss_workspace, comm_buffers=one.comm_buffers, stage=rank,
                           attention_scores=one.attention_scores,
                           gradients_after_activations=one.gradients_after_activations)


def _rank_memory(model: ModelSpec, config: ParallelConfig, stages: RankStages, *, seq_len: int, mbs: int,
                 precision: str, microbatches: int, kept: dict[bool, float],
                 rebuilt: dict[bool, float], optimizer: str = "adamw") -> MemoryBreakdown:
    """The breakdown of ``stages``' kind of rank with the activations of ONE micro-batch in flight. ``kept`` and
    ``rebuilt``: a dense (False) and an MoE (True) block's activation bytes per token, kept for backward and
    rebuilt by recomputation (:func:`block_activation_bytes`)."""
    tp, cp = config.tp, config.cp
    dp_shard = int(config.dp_shard)
    pbytes = param_bytes(precision)
    computed = computed_precision(precision, config)
    params, matmul, experts = local_params(model, config, stages)

    # ---- model states (ZeRO)
    fsdp = dp_shard * cp
    stage = config.zero_stage
    accumulating = microbatches > 1

    def fsdp_shard(nbytes_per_param: float) -> float:
        """This rank's ZeRO-3 share of its parameters at ``nbytes_per_param``. FSDP2 shards the dense ones evenly over
        ``dp_shard x cp``, but the experts (already split over ``ep`` of those ranks) only over the
        ``dp_shard x cp / ep`` ranks holding the same experts (``parallel.zero.fully_shard_model`` on
        ``ParallelMesh.experts(ep).shard``, torchtitan's "dp_shard_mod_ep"): at dp_shard = ep nothing shards them.
        ParallelConfig.validate makes ep divide dp_shard x cp."""
        return ((params - experts) / fsdp + experts / (fsdp // config.ep)) * nbytes_per_param

    parameters = fsdp_shard(pbytes) if stage == 3 else params * pbytes
    # ZeRO-1/2 partition a pipeline stage's states: the dense ones by whole tensors over the stage's dp_shard x cp
    # ranks (the heaviest owner's share, zero_owner_params), the experts' over the ranks holding the same experts
    # (parallel.zero_experts).
    owned = experts / (fsdp // config.ep) + (
        zero_owner_params(model, tp, fsdp, stages.n_dense, stages.n_moe, stages.embedding, stages.head)
        if stage in (1, 2) else 0.0)
    # Under accumulation ZeRO-2/3 keep whole gradients (FSDP2's unsharded, in fp32) until the last micro-batch,
    # unless they are reduced on every one (sharded_accumulation). The micro-batches of a pipeline schedule count
    # too: torch.distributed.pipelining turns FSDP2's gradient sync off for all but a stage's last backward, so a
    # stage holds its whole gradients from its first backward to its last (sharded_accumulation cannot apply).
    whole = accumulating and not config.sharded_accumulation
    if stage == 3:
        gradients = params * 4 if whole else fsdp_shard(pbytes)
    elif stage == 2:  # the reducer keeps the gradients of the parameters this rank steps
        gradients = params * pbytes if whole else owned * pbytes
    else:
        gradients = params * pbytes
    optimizer_states = 2 * (fsdp_shard(pbytes) if stage == 3 else owned * pbytes if stage else params * pbytes)
    if optimizer in MOMENT_BYTES:
        optimizer_states *= MOMENT_BYTES[optimizer] / (2 * pbytes)
    if optimizer == "muon":  # the blocks' matrices (the head's aside) keep one momentum buffer, not two moments
        head = model.vocab_size * model.hidden / tp if stages.head else 0.0
        optimizer_states *= muon_state_share(matmul - head, params)

    # ---- activations of the blocks, one micro-batch (_on_rank multiplies them by the micro-batches in flight)
    tokens = mbs * seq_len / cp
    activations = (stages.n_dense * kept[False] + stages.n_moe * kept[True]) * tokens
    if cp > 1 and config.activation_checkpointing != "none" and stages.embedding and stages.n_blocks:
        # The first block cuts this rank's chunks out of the whole sequence's hidden states (parallel.context), so
        # its recomputation keeps the whole sequence as its input.
        activations += (cp - 1) * tokens * kept_input_bytes(model, computed, tp=tp,
                                                            sequence_parallel=config.sequence_parallel)
    recompute = 0.0
    if config.activation_checkpointing != "none" and stages.n_blocks:
        recompute = tokens * max(rebuilt[moe] for moe, count in ((False, stages.n_dense), (True, stages.n_moe))
                                 if count)

    # ---- the ends: final norm and head on this rank's tokens, the loss on the whole sequence's logits (every cp
    # rank; lightning_par.parallel.context.GatherAtHead)
    logits = loss_workspace = 0.0
    if stages.head:
        whole = mbs * seq_len
        norm_head, log_softmax = final_activation_bytes(model, precision=computed, tp=tp,
                                                 sequence_parallel=config.sequence_parallel,
                                                 loss_parallel=config.loss_parallel)
        forwards_first = config.pp > 1 and schedules.SCHEDULES[config.pp_schedule].forwards_first
        in_flight_losses = microbatches if forwards_first else 1
        if config.pp > 1:  # the schedule keeps the last stage's output, the logits, until their backward
            log_softmax += matmul_activation_bytes(computed) * model.vocab_size / (tp if config.loss_parallel else 1)
        logits = (norm_head / cp + log_softmax) * whole * in_flight_losses
        loss_workspace = loss_workspace_bytes(model, precision=computed, tp=tp,
                                              loss_parallel=config.loss_parallel) * whole

    # ---- bf16 weight copies under autocast: it caches the cast of every block weight it multiplies by
    # until the outermost autocast region ends, the whole forward, whether blocks are checkpointed or not
    # (measured in tests/test_planner.py). A pipeline whose every block is recomputed runs its schedule without the
    # cache (parallel.pipeline.runner): one block's copies at a time. With fp32 FSDP2 parameters the copies are of
    # the gathered, whole weights; with bf16 ones there is nothing to cast.
    autocast_copies = 0.0
    if precision == "bf16-mixed" and not (stage == 3 and config.param_dtype != "fp32"):
        autocast_copies = 2 * (max(block_local_params(model, config, moe) for moe, count in
                                   ((False, stages.n_dense), (True, stages.n_moe)) if count)
                               if config.pipeline_casts_without_cache and stages.n_blocks else matmul)

    # ---- communication buffers
    comm = 0.0
    dp_cp = int(config.dp_replicate) * dp_shard * cp
    if stage in (0, 1) and dp_cp > 1:
        if config.reduces_gradients_after_backward:  # reduce_gradients: one bucket's flat copy at a time
            comm += min((params - experts) * pbytes, config.ddp_bucket_cap_mb * 2**20)
        else:
            comm += (params - experts) * pbytes  # DDP's buckets hold a flat copy of every gradient
    if stage == 3 and fsdp > 1:
        gather = 2 if config.param_dtype in ("bf16", "fp16") else pbytes
        units = {moe: block_local_params(model, config, moe) for moe, count in
                 ((False, stages.n_dense), (True, stages.n_moe)) if count}
        block = max(units.values(), default=0.0)
        blocks = stages.n_dense + stages.n_moe
        per_unit = max(min(config.blocks_per_unit, blocks), 1)  # blocks gathered and reduced together
        unit_gradients = per_unit * block * 4  # one unit's whole gradients, until its reduce-scatter
        # Under pipeline parallel a stage's blocks stay gathered from their first backward to the step's end
        # (torch.distributed.pipelining turns resharding after backward off until the last micro-batch).
        if config.reshard_after_forward and config.pp == 1:
            root = params - stages.n_dense * units.get(False, 0.0) - stages.n_moe * units.get(True, 0.0)
            # the current unit (or the kept blocks), the prefetched units, the root
            ahead = -(-max(config.prefetch_blocks, 1) // per_unit) * per_unit
            gathered = min(max(config.keep_gathered_blocks, per_unit) + ahead, blocks)
            comm += (gathered * block + root) * gather + unit_gradients
        else:
            comm += params * gather + unit_gradients
    if config.pp > 1:
        # torch.distributed.pipelining gives every stage a receive buffer per micro-batch, made once and kept: for
        # the activation (stages after the first) and for its gradient (stages before the last). A micro-batch in
        # flight keeps its activation buffer as its first block's input, counted with the activations above.
        boundary = tokens * kept_input_bytes(model, computed, tp=tp, sequence_parallel=config.sequence_parallel)
        receiving = len(stages.stage_blocks) - int(stages.embedding)
        returning = len(stages.stage_blocks) - int(stages.head)
        comm += boundary * microbatches * (receiving + returning)
        activations -= boundary * receiving
    # ---- the score blocks a context-parallel method attends in (ring attention: one fp32 block per chunk pair)
    attention_scores = 0.0
    if cp > 1 and stages.n_blocks:
        attention_scores = CONTEXT_METHODS[config.cp_method].score_bytes(mbs, model.heads / tp, seq_len, cp)
    return MemoryBreakdown(parameters=parameters, gradients=gradients, optimizer_states=optimizer_states,
                           activations=activations, logits=logits, autocast_copies=autocast_copies,
                           recompute=recompute, loss_workspace=loss_workspace, comm_buffers=comm,
                           stage=stages.rank, attention_scores=attention_scores,
                           gradients_after_activations=config.pp == 1 and not accumulating)


@functools.lru_cache(maxsize=4096)
def zero_owner_params(model: ModelSpec, tp: int, owners: int, n_dense: int, n_moe: int, embedding: bool,
                      head: bool) -> float:
    """The dense parameters (all but the experts) that the heaviest ZeRO-1/2 owner of a rank's stages steps, out of
    ``owners`` ranks. torch's ``ZeroRedundancyOptimizer`` hands out whole tensors, the largest first, each to the
    owner with the fewest elements so far (Graham's LPT rule, 1969; it sorts by a DTensor's global size): a tensor
    larger than an even share, such as a vocabulary-wide embedding on a stage of few blocks, leaves its owner above
    ``params / owners``."""
    split = 1 / tp
    # (global elements, elements on this rank, how many)
    tensors = [(model.heads * model.head_dim * model.hidden, split, 2 * (n_dense + n_moe)),  # q, o
               (model.kv_dim * model.hidden, split, 2 * (n_dense + n_moe)),  # k, v
               (model.ffn_hidden * model.hidden, split, model.ffn_matrices * n_dense),
               (model.hidden, 1.0, 2 * (n_dense + n_moe)),  # the norms
               (model.moe_experts * model.hidden, 1.0, n_moe)]  # the routers
    vocab = model.vocab_size * model.hidden
    tensors.append((vocab, split, int(embedding) + int(head and not (model.tie_embeddings and embedding))))
    tensors.append((model.hidden, 1.0, int(head)))  # the final norm
    ordered = [(size, local) for size, local, count in sorted(tensors, key=lambda t: -t[0]) for _ in range(count)]
    if owners == 1:
        return sum(size * local for size, local in ordered)
    loads = [(0, owner) for owner in range(owners)]  # a heap: the owner with the fewest elements, lowest rank first
    held = [0.0] * owners
    for size, local in ordered:
        load, owner = heapq.heappop(loads)
        held[owner] += size * local
        heapq.heappush(loads, (load + size, owner))
    return max(held)


def block_local_params(model: ModelSpec, config: ParallelConfig, moe: bool) -> float:
    """Parameters of one dense (or MoE) block on a rank, before ZeRO sharding: one FSDP2 unit."""
    ffn = model.expert_params / config.ep + model.router_params if moe \
        else model.mlp_params / config.tp
    return model.norm_params + model.attention_params / config.tp + ffn


__all__ = ["LIGHTNING_PRECISIONS", "MemoryBreakdown", "PRECISIONS", "RankStages", "block_activation_bytes",
           "block_local_params", "computed_precision", "estimate_memory", "final_activation_bytes", "in_flight",
           "kept_input_bytes", "local_params", "loss_workspace_bytes", "param_bytes", "rank_memory", "rank_stages",
           "zero_owner_params"]
