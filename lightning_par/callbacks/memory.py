"""Peak memory of every rank: what decides whether a layout fits."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_par.callbacks._group import gather_floats

__all__ = ["MemoryMonitor", "peak_memory_bytes"]

_GIB = 2**30


class MemoryMonitor(Callback):
    """Logs the peak memory of every rank after each training batch: ``memory/peak_gib_max`` and
    ``memory/peak_gib_mean`` over the ranks, and ``memory/peak_gib_rank<N>`` for up to ``max_ranks_logged``.

    On CUDA it is the peak of ``torch.cuda.max_memory_allocated`` since the previous batch (tensors only,
    as the planner models them); on CPU the process's peak resident set size since it started (tensors,
    interpreter and libraries: an upper bound).
    """

    def __init__(self, max_ranks_logged: int = 16) -> None:
        self.max_ranks_logged = max_ranks_logged

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        peaks = [value / _GIB for value in gather_floats(float(peak_memory_bytes(trainer.strategy.root_device)))]
        pl_module.log("memory/peak_gib_max", max(peaks), on_step=True, on_epoch=False)
        pl_module.log("memory/peak_gib_mean", sum(peaks) / len(peaks), on_step=True, on_epoch=False)
        if len(peaks) <= self.max_ranks_logged:
            for rank, peak in enumerate(peaks):
                pl_module.log(f"memory/peak_gib_rank{rank}", peak, on_step=True, on_epoch=False)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes of this process on ``device`` (see :class:`MemoryMonitor`); resets the CUDA peak."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
