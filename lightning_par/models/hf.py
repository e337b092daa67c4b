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

from lightning_par.data.text import TOKENIZER_MARKERS, load_tokenizer
from lightning_par.checkpoint.huggingface import config_from_arguments, load_huggingface_weights
from lightning_par.checkpoint.adapters import FROZEN_BASE_KEY, LORA_DEFAULTS, lora_settings, with_lora
from lightning_par.models.lightning_module import (ContractModule, NewtonSchulzDtype, OptimizerName,
                                                   check_optimizer_hparams)
from lightning_par.parallel.model_map import derive_model_map
from lightning_par.models.packing import DocumentPositions, check_document_masking, cross_document_targets
from lightning_par.parallel.adapters import initialize_lora

__all__ = ["HFCausalLM", "LORA_DEFAULTS", "lora_settings"]

IGNORE_INDEX = -100  # Hugging Face's label for positions that take no loss


class HFCausalLM(ContractModule):
    """Next-token training of a Hugging Face causal LM, from a local pretrained directory or from a config.

    Args:
        pretrained: a local directory with ``config.json`` and the weights as safetensors (one file, or sharded
            with ``model.safetensors.index.json``), as ``save_pretrained`` writes it. Nothing is downloaded.
        config: instead of ``pretrained``, the model's configuration as keyword arguments of
            ``AutoConfig.for_model`` (``model_type`` first), with random initial weights.
        learning_rate, weight_decay, betas, warmup_steps, min_lr_ratio, max_steps: AdamW with warmup and cosine
            decay, as ``LlamaLM``.
        optimizer, muon_ns_dtype: ``adamw``, ``adamw_bf16``, ``adamw_8bit``, ``adamw_4bit`` or ``muon`` (Muon on the
            matrices of the decoder layers the model map finds, AdamW on the rest), as ``LlamaLM``
            (docs/optimizers.md).
        lora: fine-tune LoRA adapters (Hu et al. 2021) instead of the whole model, built by ``peft`` once the model
            exists, before any layout applies: ``{r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, v_proj],
            bias: none, seed: 0}`` (see :data:`LORA_DEFAULTS`; ``target_modules`` None lets peft choose by model
            type). The base model is frozen; the optimizer holds the adapters only. Adapters start as peft starts
            them (``lora_B`` zero), drawn from ``seed`` and each adapter's name, so every layout starts alike.
        packed_documents: the batches are windows of packed documents, each closed by a separator token: the data
            module's ``document_separator`` (``TextDataModule``, ``InstructionDataModule``), else the end-of-sequence
            token of the pretrained directory's tokenizer. Positions restart at every document, attention stays inside
            it and a separator's target takes no loss (``lightning_par.models.packing``), in every layout; a model
            family whose attention transformers does not keep apart this way is refused.
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
        packed_documents: bool = False,
        optimizer: OptimizerName = "adamw",
        muon_ns_dtype: NewtonSchulzDtype = "bf16",
    ) -> None:
        super().__init__()
        if (pretrained is None) == (config is None):
            raise ValueError("HFCausalLM needs exactly one of pretrained (a local model directory) and config (the "
                             f"arguments of AutoConfig.for_model); got pretrained={pretrained!r}, config={config!r}")
        # Checked, with every default filled in (LightningCLI saves the hyper-parameters as the config gave them).
        self.lora = lora_settings(lora)
        self.save_hyperparameters()
        check_optimizer_hparams(self.hparams)
        self.model_config = (_pretrained_config(Path(pretrained)) if pretrained is not None
                             else config_from_arguments(config))
        self.model: torch.nn.Module | None = None
        self.blocks_path: str | None = None  # the decoder layers' (configure_model)
        self._parameter_count = 0  # the whole model's, counted when it is built (a pipeline stage holds only a part)
        self._pretrained_loaded = False
        self._base_outside_checkpoint = False  # resumed from a LoRA checkpoint: the base is read from `pretrained`
        # The token that closes each packed document (from configure_model on), or None when they are not packed.
        self.document_separator: int | None = None

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
        if self.hparams.packed_documents:  # on the model itself: pipeline stages run its forward, not ours
            self.document_separator = self._packing_separator()
            check_document_masking(self.model)
            self.model.register_forward_pre_hook(DocumentPositions(self.document_separator), with_kwargs=True)
        if self.lora is not None:
            self.model = with_lora(self.model, self.lora)
        # Where the decoder layers are, read off the whole model: optimizer='muon' steps their matrices, and a pipeline
        # stage, which holds some of them, no longer looks like a decoder.
        model_map = derive_model_map(self)
        self.blocks_path = model_map.blocks if model_map is not None else None

    def _packing_separator(self) -> int:
        """The token the data closes each packed document with: the data module's (``document_separator``), else the
        end-of-sequence token of the pretrained directory's tokenizer (the config's without one)."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        separator = getattr(datamodule, "document_separator", None)
        if separator is not None:
            return int(separator)
        return _document_separator(self.hparams.pretrained, self.model_config)

    def split_batch(self, batch: Tensor | Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        """A batch -> inputs (B, T) and next-token targets (B, T), -100 where no loss is taken."""
        if isinstance(batch, Tensor) and batch.dim() == 2:
            return self._within_documents(batch[:, :-1], batch[:, 1:])
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
            return self._within_documents(ids[:, :-1], targets)
        raise TypeError("HFCausalLM expects token ids (B, T + 1) or a dict with 'input_ids', got "
                        f"{type(batch).__name__}")

    def _within_documents(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if self.document_separator is not None:
            targets = cross_document_targets(inputs, targets, self.document_separator)
        return inputs, targets

    @override
    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids).logits

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over the positions that take a loss (:meth:`loss_tokens`), on fp32 logits; 0 for a batch
        with none (a window of prompt alone), where a plain mean would be NaN."""
        total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX,
                                reduction="sum")
        return total / self.loss_tokens(targets).clamp(min=1)

    def loss_tokens(self, targets: Tensor) -> Tensor:
        """How many positions of ``targets`` take a loss (not -100): what :meth:`loss_fn` averages over, and what the
        strategies weigh each data-parallel rank's and micro-batch's loss by, so that the loss of a batch is the mean
        over all its tokens in every layout."""
        return (targets != IGNORE_INDEX).sum()

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

    @property
    def frozen_base(self) -> str | None:
        """The directory this module's frozen parameters are read from when only LoRA adapters train: its checkpoints
        then hold the adapters and a reference to it, not the base (``lightning_par.checkpoint.adapters.FROZEN_BASE_KEY``)."""
        return self.hparams.pretrained if self.lora is not None else None

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._base_outside_checkpoint = FROZEN_BASE_KEY in checkpoint

    def load_pretrained(self) -> None:
        """Read the pretrained weights into the model as this rank holds it (its shards, its pipeline stages), and
        start the LoRA adapters. Collective under a process group. Runs once, after the strategy has applied the
        layout. A run resumed from a checkpoint (``ckpt_path``) has its weights from there, but for the frozen base of
        a LoRA run, which its checkpoints leave out: that is read again, the adapters kept as loaded."""
        if self._pretrained_loaded:
            return
        self._pretrained_loaded = True
        trainer = self._trainer
        resumed = trainer is not None and trainer.ckpt_path is not None
        if resumed and not self._base_outside_checkpoint:
            return
        if self.hparams.pretrained is not None:
            load_huggingface_weights(self.model, Path(self.hparams.pretrained), device=self.device)
        if self.lora is not None and not resumed:
            initialize_lora(self.model, self.lora["seed"])

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (PaLM appendix B): 6 per parameter outside the embedding, plus attention's
        12 x layers x hidden size x sequence length."""
        config = self.model_config
        embedding = config.vocab_size * config.hidden_size
        seq_len = seq_len or getattr(config, "max_position_embeddings", 0)
        return 6 * (self._parameter_count - embedding) + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def _document_separator(pretrained: str | None, config: Any) -> int:
    """The end-of-sequence token packed documents end with: the pretrained directory's tokenizer's, as the data
    modules pack with it, else the model config's."""
    if pretrained is not None and any((Path(pretrained) / name).is_file() for name in TOKENIZER_MARKERS):
        return int(load_tokenizer(pretrained).eos_token_id)
    separator = getattr(config, "eos_token_id", None)
    if not isinstance(separator, int):
        raise ValueError(f"packed_documents=True needs the token that ends each document: the model has no tokenizer "
                         f"in pretrained={pretrained!r} and its config's eos_token_id is {separator!r}, not one token")
    return separator


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
