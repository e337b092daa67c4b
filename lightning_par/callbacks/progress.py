"""A progress bar that says which layout is training, next to the loss and tokens/s."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_par.callbacks._group import strategy_mesh

from lightning_par.parallel.mesh import MESH_DIM_NAMES

__all__ = ["ParallelProgressBar", "layout_name"]


class ParallelProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar plus ``layout=dp2·tp2·pp2`` (the mesh dimensions larger than one); tokens/s shows
    when :class:`~lightning_par.callbacks.ThroughputMonitor` runs (it logs to the bar)."""

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        mesh = strategy_mesh(trainer)
        if mesh is not None:
            metrics["layout"] = layout_name(mesh.sizes())
        return metrics


def layout_name(sizes: dict[str, int]) -> str:
    """``dp2·tp2`` for the dimensions larger than one (``dp_replicate``/``dp_shard`` as ``dp``), or ``1``."""
    parts = [f"{name}{sizes[name]}" for name in MESH_DIM_NAMES if sizes[name] > 1]
    return "·".join(parts).replace("dp_replicate", "dp").replace("dp_shard", "dp") or "1"
