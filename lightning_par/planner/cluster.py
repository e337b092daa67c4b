"""ClusterSpec: what one device can hold and compute, and how fast devices talk inside and across nodes.

Numbers are public data-sheet figures per device:

* H100 SXM: 80 GB HBM3, 989 TFLOP/s dense bf16; NVLink 4 at 900 GB/s bidirectional (450 GB/s each way);
  one 400 Gb/s InfiniBand NDR adapter per GPU (50 GB/s) in a DGX H100 / HGX node.
* H200 SXM: the H100's compute with 141 GB HBM3e (about 140 GiB usable), same NVLink and network.
* A100 SXM: 312 TFLOP/s dense bf16, 80 or 40 GB; NVLink 3 at 600 GB/s bidirectional (300 GB/s each way);
  one 200 Gb/s HDR adapter per GPU (25 GB/s) in a DGX A100.
* cpu: a modest CPU "device" (one process of a multi-process gloo run), for planning laptop runs.

Collective times in :mod:`lightning_par.planner.time` use these as the per-device bandwidth of the ring
(NCCL's "bus bandwidth"), so they are the unidirectional figures.

* h100-96gb-500w: the H100s torchtitan's published Llama 3.1 benchmarks ran on (Meta's Grand Teton hosts:
  96 GB HBM2e at 2.4 TB/s, capped at 500 W, 400 Gb/s RDMA per GPU; ``benchmarks/llama3_h100_202412_torchtitan.md``
  in pytorch/torchtitan, whose footnote puts the peak "between SXM and NVL").

Peak FLOP/s are never reached. The time model distinguishes three kinds of work, each with its own achievable
rate: matmuls (the linear layers, ``compute_efficiency`` of peak), attention (the PaLM-counted ``12·L·h·s`` FLOPs
of the fused kernel, ``attention_efficiency`` of peak) and element-wise ops (norms, rotary, activations,
residual adds: bytes over ``memory_bandwidth``). Collectives run at ``bus_efficiency`` of the link's bandwidth,
NVLink inside a node and the network across nodes (:meth:`ClusterSpec.bandwidth`). The presets' values are
calibrated against published training runs (``lightning_par.planner.published``, docs/planner.md): each named
constant below says which runs set it. :func:`calibrate` fits them, and optionally the bandwidths, to a
measured step time.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GiB = 1024**3


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster of ``nodes x devices_per_node`` devices.

    Bandwidths are bytes/s per device, one direction. ``peak_flops_fp32`` is what full-precision
    ("32-true") matmuls run at (TF32 tensor cores on GPUs: half the bf16 rate); None means the bf16 figure.
    ``peak_flops_fp8`` is the dense float8 tensor-core rate (Ada, Hopper: twice bf16's); None: the device has no
    float8 units, and a plan with float8 linear layers is refused.
    ``usable_memory_fraction`` leaves room for the CUDA context, the allocator's fragmentation and
    temporaries the memory model does not itemise. ``*_bus_efficiency`` is the fraction of a link's bandwidth a
    large NCCL collective reaches (its "bus bandwidth" over the link's), 1.0 for a ``ClusterSpec`` built by hand.
    ``optimizer_rate`` (parameters per second of an AdamW step) and ``collective_overlap`` (the share of the compute
    that hides overlapped collectives) are set by :func:`lightning_par.planner.measure.measured_cluster`; the
    presets leave them None (the optimizer step not costed, :data:`~lightning_par.planner.time.COLLECTIVE_OVERLAP`).
    """

    name: str
    nodes: int
    devices_per_node: int
    memory_bytes: int
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    compute_efficiency: float = 0.5
    usable_memory_fraction: float = 0.9
    peak_flops_fp32: float | None = None
    peak_flops_fp8: float | None = None
    attention_efficiency: float | None = None  # None: the matmuls' compute_efficiency
    memory_bandwidth: float | None = None  # HBM bytes/s; None: element-wise ops are not costed
    intra_node_bus_efficiency: float = 1.0
    inter_node_bus_efficiency: float = 1.0
    optimizer_rate: float | None = None  # parameters/s an AdamW step updates; None: the step is not costed
    collective_overlap: float | None = None  # share of compute that hides collectives; None: time.COLLECTIVE_OVERLAP
    # Float8 GEMMs' share of the float8 peak over bf16's share; None: time.FLOAT8_MATMUL_EFFICIENCY
    float8_matmul_efficiency: float | None = None
    # Element-wise HBM traffic left under torch.compile; None: time.COMPILED_ELEMENTWISE_FRACTION
    compiled_elementwise_fraction: float | None = None
    accelerator: bool = True  # collectives on streams of their own beside the compute; False: CPUs

    def __post_init__(self) -> None:
        for field in ("nodes", "devices_per_node", "memory_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterSpec.{field} must be a positive integer, got {value!r}")
        for field in ("peak_flops", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"ClusterSpec.{field} must be positive, got {getattr(self, field)!r}")
        for field in ("compute_efficiency", "usable_memory_fraction", "intra_node_bus_efficiency",
                      "inter_node_bus_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"ClusterSpec.{field} must be in (0, 1], got {getattr(self, field)!r}")
        if self.peak_flops_fp8 is not None and not self.peak_flops_fp8 > 0:
            raise ValueError(f"ClusterSpec.peak_flops_fp8 must be positive or None, got {self.peak_flops_fp8!r}")
        if self.attention_efficiency is not None and not 0 < self.attention_efficiency <= 1:
            raise ValueError(f"ClusterSpec.attention_efficiency must be in (0, 1], got {self.attention_efficiency!r}")
        if self.optimizer_rate is not None and not self.optimizer_rate > 0:
            raise ValueError(f"ClusterSpec.optimizer_rate must be positive, got {self.optimizer_rate!r}")
        if self.collective_overlap is not None and not 0 <= self.collective_overlap <= 1:
            raise ValueError(f"ClusterSpec.collective_overlap must be in [0, 1], got {self.collective_overlap!r}")
        for field in ("float8_matmul_efficiency", "compiled_elementwise_fraction"):
            value = getattr(self, field)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"ClusterSpec.{field} must be in (0, 1] or None, got {value!r}")
        if self.memory_bandwidth is not None and not self.memory_bandwidth > 0:
            raise ValueError(f"ClusterSpec.memory_bandwidth must be positive, got {self.memory_bandwidth!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def flops(self, precision: str) -> float:
        """Peak matmul FLOP/s for a Lightning precision string."""
        if precision.startswith("32") or precision.startswith("64"):
            return self.peak_flops_fp32 if self.peak_flops_fp32 is not None else self.peak_flops / 2
        return self.peak_flops

    def bandwidth(self, span: int) -> float:
        """Per-device bus bandwidth of a group whose ranks lie within ``span`` consecutive global ranks: NVLink when
        the span fits in a node, the network otherwise (its slowest link sets a ring's pace), each at the fraction
        of the link a large collective reaches."""
        if span <= self.devices_per_node:
            return self.intra_node_bandwidth * self.intra_node_bus_efficiency
        return self.inter_node_bandwidth * self.inter_node_bus_efficiency

    @property
    def attention_rate_fraction(self) -> float:
        """Fraction of peak the fused attention kernels sustain (the matmuls' when not given)."""
        return self.attention_efficiency if self.attention_efficiency is not None else self.compute_efficiency

    @classmethod
    def from_preset(cls, device: str, nodes: int = 1, devices_per_node: int = 8, **overrides: Any) -> ClusterSpec:
        """A cluster of ``nodes x devices_per_node`` devices of a known kind (:data:`DEVICE_PRESETS`)."""
        key = device.lower()
        if key not in DEVICE_PRESETS:
            raise ValueError(f"unknown device preset {device!r}; presets: {sorted(DEVICE_PRESETS)} (or build "
                             "ClusterSpec(...) with your own figures)")
        spec = dict(DEVICE_PRESETS[key])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ClusterSpec fields {sorted(unknown)}")
        spec.update(overrides)
        spec.setdefault("name", key)
        return cls(nodes=nodes, devices_per_node=devices_per_node, **spec)


# ---- calibration against published runs (lightning_par.planner.published; docs/planner.md has the table)
# Fitted by code: lightning_par.planner.refit.fit sets each of these to the value at which the published rows naming
# it in their ``fits`` are predicted exactly on average; tests/test_planner_published.py fails when a value here
# leaves its fit. Fraction of peak the linear layers' GEMMs sustain in a whole training step:
A100_MATMUL_EFFICIENCY = 0.616  # Megatron-LM PTD-P on A100 (Narayanan et al. 2021, table 2: 141-159 TFLOP/s)
H100_MATMUL_EFFICIENCY = 0.713  # Megatron-Core Mixtral 8x7B on H100 SXM (438 TFLOP/s, Megatron-LM MoE README)
H100_500W_MATMUL_EFFICIENCY = 0.586  # torchtitan's power-capped H100s (Llama 3.1 8B FSDP, 5,762 tokens/s/GPU)
# Bus efficiency of a large NCCL collective across nodes: Megatron's ZeRO-3 rows (Narayanan et al. 2021, table 2:
# 1,536 A100s gathering GPT 175B, gather-bound), fitted with COLLECTIVE_OVERLAP (time.py) to both ZeRO-3 rows.
INFINIBAND_BUS_EFFICIENCY = 0.677
# Not fitted (no published row isolates them), with their sources:
# Attention, as a fraction of peak over PaLM's 12·L·h·s FLOPs (which count the causal half a fused kernel
# skips): FlashAttention-2-class kernels reach 50-70% of A100 peak and ~35% of H100 peak on the causal work
# (Dao 2023, figs. 4-6), i.e. about twice that over the PaLM count.
A100_ATTENTION_EFFICIENCY = 1.0
H100_ATTENTION_EFFICIENCY = 0.65
# Inside a node: nccl-tests' all-reduce bus bandwidth on DGX A100 / H100 reaches about 80% of NVLink's unidirectional
# bandwidth for large messages (NVIDIA's nccl-tests README defines the bus bandwidth; the fraction is a round figure
# of such runs, not a published table: docs/planner.md shows the 405B plan's sensitivity to it).
NVLINK_BUS_EFFICIENCY = 0.8

_CALIBRATED = dict(intra_node_bus_efficiency=NVLINK_BUS_EFFICIENCY,
                   inter_node_bus_efficiency=INFINIBAND_BUS_EFFICIENCY)
_H100 = dict(peak_flops=989e12, peak_flops_fp8=1979e12, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
             compute_efficiency=H100_MATMUL_EFFICIENCY, attention_efficiency=H100_ATTENTION_EFFICIENCY, **_CALIBRATED)
_A100 = dict(peak_flops=312e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
             compute_efficiency=A100_MATMUL_EFFICIENCY, attention_efficiency=A100_ATTENTION_EFFICIENCY, **_CALIBRATED)
DEVICE_PRESETS: dict[str, dict[str, Any]] = {
    "h100-80gb": dict(memory_bytes=80 * GiB, memory_bandwidth=3.35e12, **_H100),
    # torchtitan's Grand Teton H100s: between the SXM's 989 and the NVL's 835 TFLOP/s bf16 (torchtitan's own
    # footnote): the midpoint. 96 GB HBM2e at 2.4 TB/s; 400 Gb/s RDMA per GPU; NVLink as the SXM's.
    "h100-96gb-500w": dict(_H100, memory_bytes=96 * GiB, memory_bandwidth=2.4e12, peak_flops=912e12,
                           peak_flops_fp8=2 * 912e12,
                           compute_efficiency=H100_500W_MATMUL_EFFICIENCY),
    "h200-141gb": dict(memory_bytes=140 * GiB, memory_bandwidth=4.8e12, **_H100),
    "a100-80gb": dict(memory_bytes=80 * GiB, memory_bandwidth=2.039e12, **_A100),
    "a100-40gb": dict(memory_bytes=40 * GiB, memory_bandwidth=1.555e12, **_A100),
    # One gloo process on a CPU: ~1 TFLOP/s of fp32/bf16 matmul on a few AVX-512 cores, shared memory inside
    # the machine, 10 Gb/s Ethernet between machines. Nothing published to calibrate against: raw figures.
    # No float8 units: torch._scaled_mm's CPU kernel is a reference (~1,000x slower than a matmul).
    "cpu": dict(memory_bytes=16 * GiB, peak_flops=1e12, peak_flops_fp32=1e12, intra_node_bandwidth=10e9,
                inter_node_bandwidth=1.25e9, accelerator=False),
}


def calibrate(cluster: ClusterSpec, *, measured_step_time: float | Sequence[float],
              predicted: Any, bandwidths: bool = False) -> ClusterSpec:
    """Rescale ``cluster`` so that the step-time model matches a measured step time.

    ``measured_step_time``: seconds per optimizer step, one value or several (their median is used, so a
    slow first step does not skew it). ``predicted``: either the
    :class:`~lightning_par.planner.time.StepTime` the model gave for the measured layout on ``cluster``, or a
    function ``cluster -> StepTime`` that re-runs the model (then the fit is exact, found by bisection).

    By default only the compute rates change, all by one factor: ``compute_efficiency``,
    ``attention_efficiency`` and ``memory_bandwidth``. From a ``StepTime`` it is solved in closed form: the
    compute-bound part (compute, recomputation, pipeline bubble, all proportional to 1 / that factor) is
    stretched so that, with the exposed communication as predicted, the total is the measurement; since a
    longer compute hides more communication, re-predicting lands close to, not exactly on, the measurement.
    With ``bandwidths=True`` both bandwidths scale by the same factor as the efficiency (every part of the
    prediction scales by ``measured / predicted``). Efficiencies never exceed 1 (peak).
    """
    measured = statistics.median(measured_step_time) if isinstance(measured_step_time, Sequence) \
        else float(measured_step_time)
    if not measured > 0:
        raise ValueError(f"measured_step_time must be positive seconds, got {measured_step_time!r}")
    if callable(predicted):
        return _fit(cluster, measured, predicted, bandwidths)
    if bandwidths:
        return _scaled(cluster, predicted.total / measured)  # > 1: the cluster is faster than modelled
    compute_bound = predicted.compute + predicted.recompute + predicted.bubble
    room = measured - (predicted.total - compute_bound)
    return _faster(cluster, 1.0 / cluster.compute_efficiency if room <= 0 else compute_bound / room)


def _faster(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    """Every compute rate (matmul and attention efficiency, memory bandwidth) times ``factor``; efficiencies
    stop at 1 (peak)."""
    attention = None if cluster.attention_efficiency is None else min(1.0, cluster.attention_efficiency * factor)
    memory = None if cluster.memory_bandwidth is None else cluster.memory_bandwidth * factor
    return dataclasses.replace(cluster, compute_efficiency=min(1.0, cluster.compute_efficiency * factor),
                               attention_efficiency=attention, memory_bandwidth=memory)


def _scaled(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    return dataclasses.replace(_faster(cluster, factor), intra_node_bandwidth=cluster.intra_node_bandwidth * factor,
                               inter_node_bandwidth=cluster.inter_node_bandwidth * factor)


def _fit(cluster: ClusterSpec, measured: float, predict: Any, bandwidths: bool) -> ClusterSpec:
    """Bisection (in log space) on the factor that scales the rates: the predicted time falls as it grows."""
    def make(factor: float) -> ClusterSpec:
        if bandwidths:
            return _scaled(cluster, factor)
        return _faster(cluster, factor)

    low, high = 1e-4, 1e4
    if not bandwidths:
        high = 1.0 / cluster.compute_efficiency  # efficiency 1: as fast as compute can get
        if predict(make(high)).total > measured:
            return make(high)
    for _ in range(60):
        middle = (low * high) ** 0.5
        if predict(make(middle)).total > measured:
            low = middle
        else:
            high = middle
    return make((low * high) ** 0.5)


__all__ = ["ClusterSpec", "DEVICE_PRESETS", "GiB", "calibrate", "NVLINK_BUS_EFFICIENCY", "INFINIBAND_BUS_EFFICIENCY"]
