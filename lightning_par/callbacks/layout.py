"""Which rank holds which mesh coordinates, once at the start of training."""

from __future__ import annotations

import socket

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_par.callbacks._group import monitoring_group, strategy_mesh
from lightning_par.parallel.mesh import MESH_DIM_NAMES

__all__ = ["LayoutSummary", "layout_table"]


class LayoutSummary(Callback):
    """Prints the mesh as a table (one row per rank: host and coordinate on every dimension larger than 1)
    and writes it to TensorBoard's text tab as ``layout``. Needs a lightning_par strategy."""

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        mesh = strategy_mesh(trainer)
        if mesh is None:
            return
        mine = {"host": socket.gethostname(), **mesh.coordinates()}
        rows = [mine]
        group = monitoring_group()
        if group is not None:
            rows = [None] * trainer.world_size
            dist.all_gather_object(rows, mine, group=group)
        table = layout_table(mesh.sizes(), rows)
        rank_zero_info(f"lightning-par layout\n{table}")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                logger.experiment.add_text("layout", table, global_step=trainer.global_step)


def layout_table(sizes: dict[str, int], rows: list[dict]) -> str:
    """A markdown table: rank, host and the coordinate on each dimension of size > 1 (``sizes`` in a header)."""
    dims = [name for name in MESH_DIM_NAMES if sizes[name] > 1]
    header = "| rank | host | " + " | ".join(f"{name} ({sizes[name]})" for name in dims) + " |"
    rule = "|---|---|" + "---|" * len(dims)
    lines = [f"| {rank} | {row['host']} | " + " | ".join(str(row[name]) for name in dims) + " |"
             for rank, row in enumerate(rows)]
    return "\n".join([header, rule, *lines])
