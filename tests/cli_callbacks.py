"""Callbacks that CLI tests add with ``--trainer.callbacks+=...`` (importable via PYTHONPATH=tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning


class RecordEnvironment(lightning.Callback):
    """Writes which cluster environment and mesh each rank ended up with to ``$RECORD_DIR/rank<N>.json``."""

    def on_train_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        strategy = trainer.strategy
        record = {
            "environment": type(strategy.cluster_environment).__name__,
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "mesh": strategy.mesh.sizes(),
        }
        Path(os.environ["RECORD_DIR"], f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class MarkSteps(lightning.Callback):
    """Rank 0 writes the last finished step to ``$RECORD_DIR/step``, so a test can act while training runs."""

    def on_train_batch_end(self, trainer: lightning.Trainer, *args: object) -> None:
        if trainer.is_global_zero:
            Path(os.environ["RECORD_DIR"], "step").write_text(str(trainer.global_step))
