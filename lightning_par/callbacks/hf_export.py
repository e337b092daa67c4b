"""Save the trained model as a Hugging Face model directory when training ends."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_par.checkpoint import on_rank_zero

__all__ = ["HuggingFaceExport"]


class HuggingFaceExport(Callback):
    """At the end of ``fit``, write the trained :class:`~lightning_par.models.HFCausalLM` to ``dirpath`` as
    ``save_pretrained`` would: ``config.json``, safetensors (sharded with an index above ``max_shard_size``) and the
    tokenizer files of ``tokenizer`` (default: the pretrained directory). Under any layout: the whole tensors are
    gathered on rank 0, which writes the directory atomically; every rank raises if the write fails.

    The same as ``lightning-par-export --format hf`` on the last checkpoint, without the checkpoint.
    """

    def __init__(self, dirpath: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
                 max_shard_size: str | int = "5GB") -> None:
        self.dirpath = Path(dirpath)
        self.tokenizer = tokenizer
        self.max_shard_size = max_shard_size

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and getattr(pl_module, "model_config", None) is None:
            raise ValueError(f"HuggingFaceExport saves Hugging Face models (lightning_par.models.HFCausalLM); "
                             f"{type(pl_module).__name__} has no model_config to write as config.json")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_par.huggingface import save_huggingface

        strategy = trainer.strategy
        if hasattr(strategy, "consolidated_state_dict"):
            weights = strategy.consolidated_state_dict()  # collective
        else:
            weights = {name: tensor.detach().cpu() for name, tensor in pl_module.state_dict().items()}
        tokenizer = self.tokenizer or pl_module.hparams.get("pretrained")
        on_rank_zero(lambda: save_huggingface(weights, pl_module.model_config, self.dirpath, tokenizer_from=tokenizer,
                                              max_shard_size=self.max_shard_size))
