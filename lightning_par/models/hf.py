"""HFCausalLM: any Hugging Face ``AutoModelForCausalLM`` as a LightningModule, built on the meta device and filled
from a local pretrained directory only once its layout is applied.

No rank ever holds the whole pretrained model: ``configure_model`` builds it on the meta device, the strategy
splits and shards it (allocating each rank's part), and then ``torch.distributed.checkpoint`` reads the
safetensors through ``HuggingFaceStorageReader``, each rank only the slices its shards need. Tied weights (a
head tied to the embedding, which safetensors stores once) stay one tensor.

Model contract (as :class:`~lightning_par.models.LlamaLM`): ``split_batch``, ``forward(input_ids) -> logits``,
``loss_fn``. Batches are token tensors (B, T + 1) or Hugging Face-style dicts with ``input_ids`` and optional
``labels`` (-100 where no loss is taken) and ``attention_mask`` (0 marks padding, which takes no loss).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_par.huggingface import config_from_arguments, load_huggingface_weights
from lightning_par.models.lightning_module import NextTokenLM
from lightning_par.parallel.adapters import adapted_layers, base_layer, initialize_lora, unused_lora_weights

IGNORE_INDEX = -100  # Hugging Face's label for positions that take no loss


class HFCausalLM(NextTokenLM):
    """Next-token training of a Hugging Face causal LM, from a local pretrained directory or from a config.

    Args:
        pretrained: a local directory with ``config.json`` and the weights as safetensors (one file, or sharded
            with ``model.safetensors.index.json``), as ``save_pretrained`` writes it. Nothing is downloaded.
        config: instead of ``pretrained``, the model's configuration as keyword arguments of
            ``AutoConfig.for_model`` (``model_type`` first), with random initial weights.
        learning_rate, weight_decay, betas, warmup_steps, min_lr_ratio, max_steps: AdamW with warmup and cosine
            decay, as ``LlamaLM``.
        lora: fine-tune LoRA adapters (Hu et al. 2021) instead of the whole model, built by ``peft`` once the model
            exists, before any layout applies: ``{r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, v_proj],
            bias: none, seed: 0}`` (see :data:`LORA_DEFAULTS`; ``target_modules`` None lets peft choose by model
            type). The base model is frozen; the optimizer holds the adapters only. Adapters start as peft starts
            them (``lora_B`` zero), drawn from ``seed`` and each adapter's name, so every layout starts alike.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        learning_rate: float = 3e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        max_steps: int | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if (pretrained is None) == (config is None):
            raise ValueError("HFCausalLM needs exactly one of pretrained (a local model directory) and config (the "
                             f"arguments of AutoConfig.for_model); got pretrained={pretrained!r}, config={config!r}")
        lora = lora_settings(lora)
        self.save_hyperparameters()
        self.model_config = (_pretrained_config(Path(pretrained)) if pretrained is not None
                             else config_from_arguments(config))
        self.model: torch.nn.Module | None = None
        self._parameter_count = 0  # the whole model's, counted when it is built (a pipeline stage holds only a part)
        self._pretrained_loaded = False

    @override
    def configure_model(self) -> None:
        """Build the model on the meta device: the strategy allocates each rank's part once the layout is applied."""
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        # Parameters in the default dtype, which Lightning's precision sets ("bf16-true": bfloat16), not in the dtype
        # the checkpoint was stored in: bf16 safetensors fine-tuned under "32-true" or "bf16-mixed" train in fp32.
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(self.model_config, attn_implementation="sdpa",
                                                          dtype=torch.get_default_dtype())
        self._parameter_count = sum(p.numel() for p in self.model.parameters())
        if self.hparams.lora is not None:
            self.model = _with_lora(self.model, self.hparams.lora)

    def split_batch(self, batch: Tensor | Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        """A batch -> inputs (B, T) and next-token targets (B, T), -100 where no loss is taken."""
        if isinstance(batch, Tensor) and batch.dim() == 2:
            return batch[:, :-1], batch[:, 1:]
        if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
            ids = batch["input_ids"]
            targets = batch.get("labels", ids)[:, 1:]
            mask = batch.get("attention_mask")
            if mask is not None:
                # The model runs on input_ids alone (the pipeline contract), causally: padding after the last real
                # token is never attended to, but padding before or between real tokens would be.
                if bool((mask[:, 1:] > mask[:, :-1]).any()):
                    raise ValueError("HFCausalLM takes attention_mask padding only at the end of a sequence (right "
                                     "padding); this batch has padding before real tokens: pad on the right "
                                     "(tokenizer.padding_side = 'right') or pack the sequences")
                targets = targets.masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
            return ids[:, :-1], targets
        raise TypeError("HFCausalLM expects token ids (B, T + 1) or a dict with 'input_ids', got "
                        f"{type(batch).__name__}")

    @override
    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids).logits

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over the positions that take a loss, on fp32 logits."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX)

    # ---------------------------------------------------------------------------- pretrained weights
    @override
    def on_fit_start(self) -> None:
        self.load_pretrained()

    @override
    def on_validation_start(self) -> None:
        self.load_pretrained()

    @override
    def on_test_start(self) -> None:
        self.load_pretrained()

    @override
    def on_predict_start(self) -> None:
        self.load_pretrained()

    def load_pretrained(self) -> None:
        """Read the pretrained weights into the model as this rank holds it (its shards, its pipeline stages), and
        start the LoRA adapters. Collective under a process group. Runs once, after the strategy has applied the
        layout; not when the run resumes from a checkpoint (``ckpt_path``), whose weights Lightning loads instead."""
        if self._pretrained_loaded:
            return
        self._pretrained_loaded = True
        trainer = self._trainer
        if trainer is not None and trainer.ckpt_path is not None:
            return
        if self.hparams.pretrained is not None:
            load_huggingface_weights(self.model, Path(self.hparams.pretrained), device=self.device)
        if self.hparams.lora is not None:
            initialize_lora(self.model, self.hparams.lora["seed"])

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (PaLM appendix B): 6 per parameter outside the embedding, plus attention's
        12 x layers x hidden size x sequence length."""
        config = self.model_config
        embedding = config.vocab_size * config.hidden_size
        seq_len = seq_len or getattr(config, "max_position_embeddings", 0)
        return 6 * (self._parameter_count - embedding) + 12 * config.num_hidden_layers * config.hidden_size * seq_len


# HFCausalLM's LoRA settings and their defaults (peft's LoraConfig: r, lora_alpha, lora_dropout, target_modules, bias).
LORA_DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": None, "bias": "none",
                                 "seed": 0}


def lora_settings(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    """``lora`` with every setting of :data:`LORA_DEFAULTS`, checked; None stays None (full fine-tuning)."""
    if lora is None:
        return None
    if not isinstance(lora, Mapping):
        raise ValueError(f"lora={lora!r} must be a mapping of LoRA settings, e.g. {{r: 8, alpha: 16, target_modules: "
                         "[q_proj, v_proj]}}")
    unknown = sorted(set(lora) - set(LORA_DEFAULTS))
    if unknown:
        raise ValueError(f"lora has unknown settings {unknown}; the settings are {sorted(LORA_DEFAULTS)}")
    settings = {**LORA_DEFAULTS, **lora}
    if not isinstance(settings["r"], int) or settings["r"] < 1:
        raise ValueError(f"lora r={settings['r']!r} must be a positive integer (the adapters' rank), e.g. 8")
    if not 0.0 <= float(settings["dropout"]) < 1.0:
        raise ValueError(f"lora dropout={settings['dropout']!r} must be in [0, 1)")
    if settings["bias"] not in ("none", "all", "lora_only"):
        raise ValueError(f"lora bias={settings['bias']!r} must be one of 'none', 'all', 'lora_only' (peft's)")
    targets = settings["target_modules"]
    if targets is not None and not (isinstance(targets, str) or (isinstance(targets, (list, tuple)) and targets
                                                                  and all(isinstance(t, str) for t in targets))):
        raise ValueError(f"lora target_modules={targets!r} must be module names (e.g. [q_proj, v_proj]), a regular "
                         "expression, 'all-linear', or None for peft's choice by model type")
    settings["target_modules"] = list(targets) if isinstance(targets, (list, tuple)) else targets
    return settings


def _with_lora(model: torch.nn.Module, settings: dict[str, Any]) -> torch.nn.Module:
    """``model`` as a peft model with LoRA adapters on ``settings['target_modules']`` (everything else frozen)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("HFCausalLM(lora=...) builds the adapters with peft: pip install 'lightning-par[hf]'") from error
    config = LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                        target_modules=settings["target_modules"], bias=settings["bias"])
    try:
        model = get_peft_model(model, config)
    except ValueError as error:  # targets that match nothing, or a model type peft has no default targets for
        raise ValueError(f"lora target_modules={settings['target_modules']!r} on {type(model).__name__}: {error}") \
            from error
    others = sorted({f"{name} ({type(base_layer(layer)).__name__})" for name, layer in adapted_layers(model)
                     if unused_lora_weights(layer)})
    if others:
        raise ValueError(f"lora target_modules={settings['target_modules']!r} adapt layers that are not projections: "
                         f"{others[:3]}; target linear layers (q_proj, v_proj, ...), not embeddings")
    return model


def _pretrained_config(directory: Path) -> Any:
    from transformers import AutoConfig

    if not directory.is_dir():
        raise ValueError(f"pretrained={str(directory)!r} is not a directory: give a local model directory as "
                         "save_pretrained writes it (config.json and safetensors); nothing is downloaded")
    if not (directory / "config.json").is_file():
        raise ValueError(f"pretrained={str(directory)!r} has no config.json: it is not a model directory written by "
                         "save_pretrained")
    if not any(directory.glob("*.safetensors")):
        found = sorted(p.name for p in directory.iterdir())[:6]
        raise ValueError(f"pretrained={str(directory)!r} holds no .safetensors weights (it holds {found}); save the "
                         "model with save_pretrained(safe_serialization=True)")
    return AutoConfig.from_pretrained(directory)
