"""Callbacks that CLI tests add with ``--trainer.callbacks+=...``, and a user's own LightningModule for
``--model.class_path`` (importable via PYTHONPATH=tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.models import LlamaLM


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


class TinyCausalTransformer(lightning.LightningModule):
    """A user's own next-token model, nothing of lightning_par in it: ``torch.nn.TransformerEncoderLayer`` blocks
    under a causal mask, trained on batches of token ids (B, T + 1)."""

    def __init__(self, vocab_size: int = 256, dim: int = 32, n_layers: int = 2, n_heads: int = 2,
                 learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, n_heads, 2 * dim, dropout=0.0, batch_first=True)
                                    for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            hidden = block(hidden, src_mask=mask, is_causal=True)
        return self.head(hidden)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits = self(batch[:, :-1])
        self.log("val_loss", F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


class LlamaWithoutPipelineContract(LlamaLM):
    """The reference model less the two methods a pipeline schedule calls (split_batch, loss_fn)."""

    split_batch = loss_fn = None
