"""Tokens and samples per second, model FLOP/s and MFU, for any layout.

A sample's tokens are its inputs' second dimension (token ids), or the model's ``tokens_per_sample`` where it has one
(the patches of an image).

Model FLOPs utilisation (MFU; Chowdhery et al. 2022, *PaLM*, appendix B) is the FLOP/s the model's
arithmetic needs at the measured throughput, per device, over the device's peak: recomputation and
padding do not count, so layouts are compared on the work that matters. The model's FLOPs per token
come from its ``flops_per_token(seq_len)`` when it has one (the reference Llama counts only the experts a
token is routed to, so a mixture of experts is not credited with work it skips), else ``6 x`` its
trainable parameters.

Peak FLOP/s per device: ``peak_flops_per_device`` if given, else Lightning's table of accelerators for the
training precision (H100, H200, A100, L4, ...), else, on a CPU, a dense matmul measured at the start of
training with this process's threads. When the strategy trains in float8, MFU is also reported against the float8
peak (``perf/mfu_float8_peak``; Micikevicius et al. 2022): ``peak_float8_flops_per_device`` if given, else on GPUs
with float8 tensor cores (compute capability 8.9 and above) the table's int8 rate, which is float8's on Ada and
Hopper. Elsewhere there is no float8 peak to report against (a CPU's ``torch._scaled_mm`` is a reference kernel,
and emulated float8 multiplies at the high-precision rate).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_par.callbacks._group import strategy_mesh
from lightning_par.planner.measure import timed

__all__ = ["ThroughputMonitor", "measure_matmul_flops"]

_PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64,
                     "transformer-engine": torch.bfloat16}


class ThroughputMonitor(Callback):
    """Logs ``perf/tokens_per_sec``, ``perf/samples_per_sec`` (global and ``..._per_device``),
    ``perf/tflops_per_device`` and ``perf/mfu`` after every training batch.

    Args:
        peak_flops_per_device: the device's peak FLOP/s for MFU; looked up or measured when omitted.
        window: batches the rates are averaged over (a sliding window smooths data-loading jitter).
        peak_float8_flops_per_device: the device's float8 peak for ``perf/mfu_float8_peak`` (logged when the strategy
            trains in float8); looked up when omitted (GPUs with float8 tensor cores).
    """

    def __init__(self, peak_flops_per_device: float | None = None, window: int = 10,
                 peak_float8_flops_per_device: float | None = None) -> None:
        for name, value in (("peak_flops_per_device", peak_flops_per_device),
                            ("peak_float8_flops_per_device", peak_float8_flops_per_device)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if window < 1:
            raise ValueError(f"window must be at least 1 batch, got {window}")
        self.peak_flops_per_device = peak_flops_per_device
        self.peak_float8_flops_per_device = peak_float8_flops_per_device
        self._float8 = False  # whether the strategy trains in float8 (known at fit start)
        self.window = window
        self._intervals: list[tuple[float, int, int]] = []  # (seconds, tokens, samples) per batch, global
        self._last: float | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.peak_flops_per_device is None:
            device = trainer.strategy.root_device
            dtype = _PRECISION_DTYPES.get(str(trainer.precision).split("-")[0], torch.float32)
            self.peak_flops_per_device = get_available_flops(device, dtype) if device.type == "cuda" else None
            if self.peak_flops_per_device is None:
                trainer.strategy.barrier("measure peak flops")  # every process measures under the same load
                self.peak_flops_per_device = measure_matmul_flops(device, dtype)
                rank_zero_info(f"MFU is relative to a measured {self.peak_flops_per_device / 1e9:.1f} GFLOP/s "
                               f"per process ({dtype} matmul on {device.type}); set peak_flops_per_device to fix it")
        config = getattr(trainer.strategy, "parallel_config", None)
        self._float8 = getattr(config, "float8", None) is not None
        if self._float8 and self.peak_float8_flops_per_device is None:
            device = trainer.strategy.root_device
            if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
                self.peak_float8_flops_per_device = get_available_flops(device, torch.int8)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._last is None:
            self._last = _now(trainer)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = _now(trainer)
        tokens, samples, seq_len = _batch_size(pl_module, batch)
        replicas = _data_parallel_size(trainer)
        self._intervals = (self._intervals + [(now - self._last, tokens * replicas, samples * replicas)])[-self.window:]
        self._last = now
        seconds = sum(interval[0] for interval in self._intervals)
        if seconds <= 0:
            return
        tokens_per_sec = sum(interval[1] for interval in self._intervals) / seconds
        samples_per_sec = sum(interval[2] for interval in self._intervals) / seconds
        devices = trainer.world_size
        flops_per_sec_per_device = tokens_per_sec * _flops_per_token(pl_module, seq_len) / devices
        metrics = {
            "perf/tokens_per_sec": tokens_per_sec,
            "perf/samples_per_sec": samples_per_sec,
            "perf/tokens_per_sec_per_device": tokens_per_sec / devices,
            "perf/samples_per_sec_per_device": samples_per_sec / devices,
            "perf/tflops_per_device": flops_per_sec_per_device / 1e12,
        }
        if self.peak_flops_per_device:
            metrics["perf/mfu"] = flops_per_sec_per_device / self.peak_flops_per_device
        if self._float8 and self.peak_float8_flops_per_device:
            metrics["perf/mfu_float8_peak"] = flops_per_sec_per_device / self.peak_float8_flops_per_device
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name == "perf/tokens_per_sec")


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of a dense ``size x size`` matmul on ``device`` in ``dtype`` (the best of ``repeats``)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        dtype = torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / timed(lambda: torch.matmul(a, b), time.perf_counter, sync, repeats, best=True)


def _now(trainer: Trainer) -> float:
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize(trainer.strategy.root_device)
    return time.perf_counter()


def _batch_size(pl_module: LightningModule, batch: Any) -> tuple[int, int, int]:
    """(tokens, samples, sequence length) of this rank's micro-batch."""
    inputs = pl_module.split_batch(batch)[0] if hasattr(pl_module, "split_batch") else batch
    if isinstance(inputs, dict):
        inputs = inputs.get("input_ids", next(iter(inputs.values())))
    elif isinstance(inputs, (list, tuple)):
        inputs = inputs[0]
    if not isinstance(inputs, Tensor):
        raise TypeError(f"ThroughputMonitor counts tokens of a tensor batch, got {type(inputs).__name__}")
    samples = inputs.shape[0]
    # A model whose inputs are not token ids says how many tokens a sample makes (a ViT's patches).
    per_sample = getattr(pl_module, "tokens_per_sample", None)
    seq_len = int(per_sample) if per_sample else inputs.shape[1] if inputs.dim() > 1 else 1
    return samples * seq_len, samples, seq_len


def _data_parallel_size(trainer: Trainer) -> int:
    """Ranks reading different samples: the mesh's ``dp`` under lightning_par, else every rank."""
    mesh = strategy_mesh(trainer)
    return mesh.size("dp") if mesh is not None else trainer.world_size


def _flops_per_token(pl_module: LightningModule, seq_len: int) -> float:
    if hasattr(pl_module, "flops_per_token"):
        return float(pl_module.flops_per_token(seq_len))
    return 6.0 * sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
