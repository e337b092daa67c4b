"""A ClusterSpec measured on this machine at start-up: what one rank reaches at the model's own shapes.

The ``cpu`` preset is a data sheet for a CPU nobody measured (1 TFLOP/s, 10 GB/s): on the 2-core machine this
project is developed on it predicted 184k tokens/s for ``configs/data_parallel.yaml``, which trains at about
10k. A CPU's achievable rates depend on its cores, its vector units, the threads each rank
gets and the load of the other ranks on the same cores, none of which a preset can know. So the ranks measure
them, all at once (the load training will see), in the quantities the step-time model
(:mod:`lightning_par.planner.time`) divides by:

* ``peak_flops``: a 1024 x 1024 x 1024 matmul in the run's dtype, the best of a few: the reference MFU is
  reported against (``lightning_par.callbacks.ThroughputMonitor`` measures the same matmul on CPUs), so predicted
  and logged MFU mean the same thing.
* ``linear_flops``: forward and backward (input and weight gradients) of one block's projections (q, k, v, o and
  the feed-forward) on one micro-batch: the model's ``6 x weights`` FLOPs per token over the median time. Small
  matrices run far below the large matmul's rate, which is what ``compute_efficiency`` stands for.
* ``attention_flops``: forward and backward of causal ``scaled_dot_product_attention`` at the model's heads,
  head width and sequence, over PaLM's ``12 x hidden x seq`` FLOPs per token (the time model's count).
* ``memory_bandwidth``: the element-wise ops' rate, found as the rest of a whole block. A Llama block (RMSNorm,
  q/k/v/o, rotary, attention, residual, RMSNorm, SwiGLU, residual; Touvron et al. 2023) is timed forward and
  backward; what its projections and attention do not explain is its element-wise work, and the bandwidth is the
  bytes the time model counts for it (``ELEMENTWISE_PASSES_H x hidden + ELEMENTWISE_PASSES_F x ffn`` passes per
  token) over that time. By construction the time model then predicts the measured block exactly.
* ``optimizer_rate``: parameters per second a ``torch.optim.AdamW`` step (PyTorch's default implementation)
  updates, timed on the probe block's weights: the time model then costs the step's update of each rank's share.
* ``link_bandwidth``: bus bandwidth (``2(d-1)/d`` of the bytes, over the time: nccl-tests' definition) of an
  all-reduce over every rank, of one DDP bucket's size; None with one rank.
* ``memory_bytes``: physical memory over the ranks on a node (CPU) or the device's memory (CUDA).

Every rank must plan the same layout, or the ranks wait on different collectives forever. :func:`measure_rates`
therefore measures on every rank at the same moment (after a barrier) and keeps, for each rate, the slowest
rank's: an all-reduce ``MIN`` of the figures, whose result is the same bits everywhere. Synchronous training goes
at the pace of its slowest rank too.

:func:`measured_cluster` turns the rates into a :class:`ClusterSpec` (the preset it starts from keeps the figures
nothing here measures: the other link, the usable memory fraction). The timings are the only inputs that depend on
the clock; :func:`rates_from_timings` is the pure arithmetic, which the tests drive with chosen timings.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_par.planner.cluster import ClusterSpec
from lightning_par.planner.model import ModelSpec

# The probes' size limit. A block's weights beyond this many parameters are probed at a narrower width (same head
# width, fewer heads and features) and sequences beyond MAX_PROBE_TOKENS per micro-batch are cut: the rates of a
# 70B block on a laptop are what the plan needs, not a minute of start-up and 6 GB of weights.
MAX_PROBE_BLOCK_PARAMS = 32 * 1024**2
MAX_PROBE_TOKENS = 8192
PEAK_MATMUL_SIZE = 1024  # as ThroughputMonitor's measure_matmul_flops
DDP_BUCKET_BYTES = 25 * 1024**2  # DDP's default bucket_cap_mb: the size the gradient all-reduce moves at a time
# The share of a block's time at least left to its element-wise ops when the projections' and attention's probes,
# timed separately, add up to the whole block or more (noise on a loaded machine).
MIN_ELEMENTWISE_SHARE = 0.05
PROBE_REPEATS = 5

Clock = Callable[[], float]


@dataclass(frozen=True)
class ProbeShape:
    """The work one probe block does: ``sequences x seq_len`` tokens through one block of the model's widths."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    ffn_matrices: int
    seq_len: int
    sequences: int
    precision: str = "32-true"

    @classmethod
    def of(cls, model: ModelSpec, *, seq_len: int, microbatch_size: int, precision: str = "32-true") -> ProbeShape:
        """One micro-batch through one dense block of ``model``, within the probe limits."""
        heads, kv_heads, head_dim, hidden = model.heads, model.kv_heads, model.head_dim, model.hidden
        # An all-MoE model has no dense feed-forward: probe one expert's width (the rates are what matters).
        ffn = model.expert_hidden if model.is_moe and model.moe_layers == model.layers else model.ffn_hidden
        params = model.attention_params + model.ffn_matrices * hidden * ffn
        if params > MAX_PROBE_BLOCK_PARAMS:
            # Narrower by a factor k in every width: kv heads stay a divisor of heads, head_dim stays.
            k = math.sqrt(params / MAX_PROBE_BLOCK_PARAMS)
            kv_heads = max(1, int(kv_heads / k))
            heads = kv_heads * (model.heads // model.kv_heads)
            hidden = max(heads * head_dim if model.attention_head_dim is None else int(hidden / k), 1)
            ffn = max(1, int(ffn / k))
        sequences = max(1, min(microbatch_size, MAX_PROBE_TOKENS // seq_len))
        seq = min(seq_len, MAX_PROBE_TOKENS)
        return cls(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn_hidden=ffn,
                   ffn_matrices=model.ffn_matrices, seq_len=seq, sequences=sequences, precision=precision)

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    @property
    def block_params(self) -> int:
        """The probe block's weights: projections and two norm gains."""
        attention = 2 * self.hidden * (self.heads + self.kv_heads) * self.head_dim
        return attention + self.ffn_matrices * self.hidden * self.ffn_hidden + 2 * self.hidden

    @property
    def linear_flops(self) -> float:
        """Forward + backward FLOPs of the block's projections: 6 x their weights per token (ModelSpec's count)."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return 6.0 * (q_o + k_v + self.ffn_matrices * self.hidden * self.ffn_hidden) * self.tokens

    @property
    def attention_flops(self) -> float:
        """PaLM's 12 x hidden x seq per token, as :func:`lightning_par.planner.time.estimate_step_time` counts."""
        return 12.0 * self.hidden * self.seq_len * self.tokens

    @property
    def elementwise_bytes(self) -> float:
        """The bytes the time model counts for the block's element-wise ops (eager, tp = cp = 1)."""
        from lightning_par.planner.memory import matmul_activation_bytes
        from lightning_par.planner.time import ELEMENTWISE_PASSES_F, ELEMENTWISE_PASSES_H

        passes = ELEMENTWISE_PASSES_H * self.hidden + ELEMENTWISE_PASSES_F * self.ffn_hidden
        return float(passes * matmul_activation_bytes(self.precision) * self.tokens)


@dataclass(frozen=True)
class ProbeTimings:
    """Seconds each probe took (see the module docstring): the measurement, before any arithmetic."""

    peak: float  # one PEAK_MATMUL_SIZE^3 matmul, the best of the repeats
    linear: float  # the block's projections, forward + backward, median
    attention: float  # SDPA forward + backward, median
    block: float  # the whole block forward + backward, median
    optimizer: float  # an AdamW step over the block's weights, median
    link: float | None = None  # one all-reduce of link_bytes, median; None with one rank
    link_bytes: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class MachineRates:
    """What one rank of this machine reaches (see the module docstring); every rank holds the same figures."""

    peak_flops: float
    linear_flops: float
    attention_flops: float
    memory_bandwidth: float
    optimizer_rate: float
    link_bandwidth: float | None = None
    memory_bytes: int | None = None

    def as_list(self) -> list[float]:
        """The figures in field order, unmeasured ones as +inf (neutral under MIN)."""
        return [math.inf if getattr(self, f.name) is None else float(getattr(self, f.name))
                for f in dataclasses.fields(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> MachineRates:
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs: dict[str, Any] = {name: (None if math.isinf(v) else v) for name, v in zip(names, values)}
        if kwargs["memory_bytes"] is not None:
            kwargs["memory_bytes"] = int(kwargs["memory_bytes"])
        return cls(**kwargs)

    def slowest(self, other: MachineRates) -> MachineRates:
        """Each figure the smaller of the two (what :func:`measure_rates` does across ranks)."""
        return MachineRates.from_list([min(a, b) for a, b in zip(self.as_list(), other.as_list())])


def rates_from_timings(shape: ProbeShape, timings: ProbeTimings, memory_bytes: int | None = None) -> MachineRates:
    """The rates the probes' timings mean. Pure arithmetic: the only clock-dependent inputs are ``timings``."""
    for name in ("peak", "linear", "attention", "block", "optimizer"):
        if not getattr(timings, name) > 0:
            raise ValueError(f"probe timing {name}={getattr(timings, name)!r} must be positive seconds")
    linear = shape.linear_flops / timings.linear
    attention = shape.attention_flops / timings.attention
    # The rest of the block is its element-wise work, at least MIN_ELEMENTWISE_SHARE of it (separately timed
    # probes of a loaded machine may add up to more than the block they are part of).
    rest = max(timings.block - timings.linear - timings.attention, MIN_ELEMENTWISE_SHARE * timings.block)
    link = None
    if timings.link is not None and timings.world_size > 1:
        d = timings.world_size
        link = 2 * (d - 1) / d * timings.link_bytes / timings.link
    # A peak below what a probe reached (a noisy peak probe) would put an efficiency above 1.
    peak = max(2 * PEAK_MATMUL_SIZE**3 / timings.peak, linear, attention)
    return MachineRates(peak_flops=peak, linear_flops=linear, attention_flops=attention,
                        memory_bandwidth=shape.elementwise_bytes / rest,
                        optimizer_rate=shape.block_params / timings.optimizer, link_bandwidth=link,
                        memory_bytes=memory_bytes)


def measured_cluster(rates: MachineRates, *, nodes: int = 1, devices_per_node: int = 1,
                     base: str | ClusterSpec = "cpu", collective_overlap: float | None = None) -> ClusterSpec:
    """A :class:`ClusterSpec` with ``rates`` in place of ``base``'s compute figures.

    ``peak_flops`` (both precisions: the probes ran in the run's) is the measured large matmul;
    ``compute_efficiency`` and ``attention_efficiency`` are the probes' rates over it, so the time model's
    ``peak x efficiency`` is the measured rate; ``memory_bandwidth`` the element-wise rate. The measured all-reduce
    bandwidth, already a bus bandwidth (efficiency 1), replaces the link it crossed: inside a node for one node,
    across nodes otherwise (the other keeps ``base``'s figure). ``memory_bytes`` replaces ``base``'s when measured,
    ``optimizer_rate`` costs the optimizer step.

    ``collective_overlap``: the share of compute that hides overlapped collectives (None: the time model's
    calibrated default). Pass 0 for CPU ranks that use every core: gloo reduces on those same cores, so a
    gradient all-reduce "overlapped" with backward takes its time from the backward (the benchmark in
    docs/planner.md measured it not hidden).
    """
    cluster = base if isinstance(base, ClusterSpec) else ClusterSpec.from_preset(base, nodes=nodes,
                                                                                  devices_per_node=devices_per_node)
    links: dict[str, Any] = {}
    if rates.link_bandwidth is not None:
        links = (dict(intra_node_bandwidth=rates.link_bandwidth, intra_node_bus_efficiency=1.0) if nodes == 1 else
                 dict(inter_node_bandwidth=rates.link_bandwidth, inter_node_bus_efficiency=1.0))
    return dataclasses.replace(
        cluster, name=f"{cluster.name} (measured)", nodes=nodes, devices_per_node=devices_per_node,
        peak_flops=rates.peak_flops, peak_flops_fp32=rates.peak_flops,
        compute_efficiency=min(1.0, rates.linear_flops / rates.peak_flops),
        attention_efficiency=min(1.0, rates.attention_flops / rates.peak_flops),
        memory_bandwidth=rates.memory_bandwidth, optimizer_rate=rates.optimizer_rate,
        collective_overlap=collective_overlap if collective_overlap is not None else cluster.collective_overlap,
        memory_bytes=rates.memory_bytes if rates.memory_bytes is not None else cluster.memory_bytes, **links)


# ----------------------------------------------------------------------------------------------------- probes
def measure_rates(model: ModelSpec, *, seq_len: int, microbatch_size: int, precision: str = "32-true",
                  device: Any = "cpu", clock: Clock = time.perf_counter, repeats: int = PROBE_REPEATS,
                  local_world_size: int = 1) -> MachineRates:
    """Measure this rank and agree with the others: the slowest rank's figure for each rate, on every rank.

    With ``torch.distributed`` initialised and more than one rank, every rank probes at the same moment (after a
    barrier), times an all-reduce, and the figures are all-reduced with ``MIN``: every rank returns the same
    :class:`MachineRates`. ``clock`` is read around each timed call (tests pass a fake one). ``local_world_size``:
    ranks sharing this machine's memory (CPU).
    """
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    shape = ProbeShape.of(model, seq_len=seq_len, microbatch_size=microbatch_size, precision=precision)
    if distributed:
        dist.barrier()  # probe together: the load of training is every rank at work
    timings = probe(shape, device=device, clock=clock, repeats=repeats)
    if distributed:
        link_bytes = min(DDP_BUCKET_BYTES, 4 * model.total_params)
        link = _time_all_reduce(link_bytes, device, clock, repeats)
        timings = dataclasses.replace(timings, link=link, link_bytes=link_bytes, world_size=dist.get_world_size())
    rates = rates_from_timings(shape, timings, memory_bytes=_memory_bytes(device, local_world_size))
    if distributed:
        figures = torch.tensor(rates.as_list(), dtype=torch.float64,
                               device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(figures, op=dist.ReduceOp.MIN)  # the same bits on every rank: the same plan
        rates = MachineRates.from_list(figures.tolist())
    return rates


def probe(shape: ProbeShape, *, device: Any = "cpu", clock: Clock = time.perf_counter,
          repeats: int = PROBE_REPEATS) -> ProbeTimings:
    """Time the four compute probes on this rank (no communication)."""
    import torch
    import torch.nn.functional as F

    device = torch.device(device)
    dtype = torch.float32 if shape.precision == "32-true" else torch.bfloat16
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*size: int, grad: bool = False, scale: float = 1.0) -> Any:
        t = (torch.randn(*size, generator=generator) * scale).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    n = PEAK_MATMUL_SIZE
    a, b = randn(n, n), randn(n, n)
    peak = timed(lambda: torch.matmul(a, b), clock, sync, repeats, best=True)

    B, T, h, f = shape.sequences, shape.seq_len, shape.hidden, shape.ffn_hidden
    H, KV, D = shape.heads, shape.kv_heads, shape.head_dim
    w_scale = h**-0.5
    weights = {"q": randn(H * D, h, grad=True, scale=w_scale), "k": randn(KV * D, h, grad=True, scale=w_scale),
               "v": randn(KV * D, h, grad=True, scale=w_scale), "o": randn(h, H * D, grad=True, scale=(H * D)**-0.5),
               "up": randn(f, h, grad=True, scale=w_scale), "down": randn(h, f, grad=True, scale=f**-0.5)}
    if shape.ffn_matrices == 3:
        weights["gate"] = randn(f, h, grad=True, scale=w_scale)
    norms = [torch.ones(h, device=device, dtype=dtype, requires_grad=True) for _ in range(2)]
    x = randn(B, T, h, grad=True)

    # (input features, weight) of every projection, inputs made once: only the matmuls are timed.
    inputs = {name: randn(B * T, w.shape[1], grad=True) for name, w in weights.items()}

    grads = [torch.ones(B * T, w.shape[0], device=device, dtype=dtype) for w in weights.values()]

    def linear() -> None:
        torch.autograd.backward([F.linear(inputs[name], w) for name, w in weights.items()], grads)

    q, k, v = (randn(B, H, T, D, grad=True) for _ in range(3))
    grad_out = torch.ones(B, H, T, D, device=device, dtype=dtype)

    def attention() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        out.backward(grad_out)

    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * torch.ones(D // 2, device=device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # (T, D/2)

    def rms(t: Any, gain: Any) -> Any:
        return t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(t.dtype) * gain

    def rotary(t: Any) -> Any:  # (B, T, heads, D): rotate pairs of features by the position's angle
        t1, t2 = t[..., : D // 2], t[..., D // 2:]
        c, s = cos[None, :, None], sin[None, :, None]
        return torch.cat([t1 * c - t2 * s, t1 * s + t2 * c], dim=-1)

    grad_block = torch.ones(B, T, h, device=device, dtype=dtype)

    def block() -> None:
        hn = rms(x, norms[0])  # (B, T, h)
        qb = rotary(F.linear(hn, weights["q"]).view(B, T, H, D)).transpose(1, 2)  # (B, H, T, D)
        kb = rotary(F.linear(hn, weights["k"]).view(B, T, KV, D))
        vb = F.linear(hn, weights["v"]).view(B, T, KV, D)
        # grouped-query attention: each key/value head serves H / KV query heads (repeated, as models/llama.py)
        kb, vb = (t.repeat_interleave(H // KV, dim=2).transpose(1, 2) for t in (kb, vb))
        y = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True).transpose(1, 2).reshape(B, T, H * D)
        hid = x + F.linear(y, weights["o"])
        hn2 = rms(hid, norms[1])
        up = F.linear(hn2, weights["up"])
        act = F.silu(F.linear(hn2, weights["gate"])) * up if "gate" in weights else F.gelu(up)
        out = hid + F.linear(act, weights["down"])
        out.backward(grad_block)

    params = [*weights.values(), *norms]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-6)  # PyTorch's default implementation (foreach where it can)

    return ProbeTimings(peak=peak, linear=timed(linear, clock, sync, repeats),
                        attention=timed(attention, clock, sync, repeats), block=timed(block, clock, sync, repeats),
                        optimizer=timed(optimizer.step, clock, sync, repeats))


def timed(fn: Callable[[], Any], clock: Clock, sync: Callable[[], None], repeats: int, best: bool = False) -> float:
    """Median (or best) seconds of ``fn`` over ``repeats`` calls after one warm-up call, ``sync`` (waiting for
    the device) after each. Also ThroughputMonitor's timer of its peak matmul."""
    fn()
    sync()
    seconds = []
    for _ in range(max(1, repeats)):
        start = clock()
        fn()
        sync()
        seconds.append(clock() - start)
    return min(seconds) if best else statistics.median(seconds)


def _time_all_reduce(nbytes: int, device: Any, clock: Clock, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=on)
    sync = (lambda: torch.cuda.synchronize(on)) if on.type == "cuda" else (lambda: None)
    return timed(lambda: dist.all_reduce(tensor), clock, sync, repeats)


def _memory_bytes(device: Any, local_world_size: int) -> int | None:
    """This rank's share of the machine's memory (CPU) or its device's memory (CUDA); None when unknown."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None
    return int(total // max(1, local_world_size))


__all__ = ["MachineRates", "ProbeShape", "ProbeTimings", "measure_rates", "measured_cluster", "probe",
           "rates_from_timings", "timed"]
