"""Save the trained model as a Hugging Face model directory (or a LoRA run's adapters as a peft one) when training
ends."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_par.checkpoint.format import on_rank_zero

__all__ = ["HuggingFaceExport"]


class HuggingFaceExport(Callback):
    """At the end of ``fit``, write the trained :class:`~lightning_par.models.HFCausalLM` to ``dirpath``.

    ``format="hf"``: as ``save_pretrained`` would, ``config.json``, safetensors (sharded with an index above
    ``max_shard_size``) and the tokenizer files of ``tokenizer`` (default: the pretrained directory); a LoRA run's
    adapters are merged into the base weights first. ``format="peft"`` (LoRA runs): the adapters as peft writes them,
    ``adapter_config.json`` and ``adapter_model.safetensors``, for ``PeftModel.from_pretrained(base, dirpath)``.
    Under any layout: the whole tensors are gathered on rank 0, which writes the directory atomically; every rank
    raises if the write fails.

    The same as ``lightning-par-export --format hf [--merge]`` or ``--format peft`` on the last checkpoint, without
    the checkpoint.
    """

    def __init__(self, dirpath: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
                 max_shard_size: str | int = "5GB", format: Literal["hf", "peft"] = "hf") -> None:
        if format not in ("hf", "peft"):
            raise ValueError(f"HuggingFaceExport format={format!r} must be 'hf' (a model directory) or 'peft' (a LoRA "
                             "run's adapters)")
        self.dirpath = Path(dirpath)
        self.tokenizer = tokenizer
        self.max_shard_size = max_shard_size
        self.format = format

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if getattr(pl_module, "model_config", None) is None:
            raise ValueError(f"HuggingFaceExport saves Hugging Face models (lightning_par.models.HFCausalLM); "
                             f"{type(pl_module).__name__} has no model_config to write as config.json")
        if self.format == "peft" and getattr(pl_module, "lora", None) is None:
            raise ValueError("HuggingFaceExport(format='peft') writes LoRA adapters, and this HFCausalLM trains the "
                             "whole model (no lora=...): use format='hf'")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_par.checkpoint.huggingface import save_huggingface

        strategy = trainer.strategy
        if hasattr(strategy, "consolidated_state_dict"):
            weights = strategy.consolidated_state_dict()  # collective
        else:
            weights = {name: tensor.detach().cpu() for name, tensor in pl_module.state_dict().items()}
        tokenizer = self.tokenizer or pl_module.hparams.get("pretrained")
        lora = getattr(pl_module, "lora", None)  # HFCausalLM's settings, defaults filled in

        def write() -> None:
            if lora is None:
                save_huggingface(weights, pl_module.model_config, self.dirpath, tokenizer_from=tokenizer,
                                 max_shard_size=self.max_shard_size)
                return
            from lightning_par.checkpoint.adapters import lora_model, merged_weights, save_adapter

            model = lora_model(pl_module.model_config, lora, weights)
            if self.format == "peft":
                save_adapter(model, self.dirpath)
            else:
                save_huggingface(merged_weights(model), pl_module.model_config, self.dirpath,
                                 tokenizer_from=tokenizer, max_shard_size=self.max_shard_size)

        on_rank_zero(write)
