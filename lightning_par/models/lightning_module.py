"""LlamaLM: the reference Llama-style decoder as a LightningModule."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from typing_extensions import override

from lightning_par.models.llama import LlamaConfig, Transformer
from lightning_par.models.moe import MoEFeedForward
from lightning_par.layout.config import DTYPES
from lightning_par.optim import AdamWBF16States, MuonWithAdamW, muon_parameter_groups
from lightning_par.parallel.model_map import derive_model_map


@dataclass
class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``.

    Cosine decay as in SGDR (Loshchilov & Hutter 2017) and the Llama recipe (decay to 10%). With
    ``total_steps=None`` the multiplier stays at 1 after warmup. A callable object rather than a closure
    so that ``LambdaLR.state_dict`` records its settings.
    """

    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# The models' ``optimizer`` and ``muon_ns_dtype`` hyper-parameters (warmup_cosine_optimizer).
OptimizerName = Literal["adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit", "muon"]
NewtonSchulzDtype = Literal["bf16", "fp32"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)


def check_optimizer_hparams(hparams: Any) -> None:
    """Raise ``ValueError`` naming the AdamW or schedule hyper-parameter (:func:`warmup_cosine_optimizer`'s) that torch
    would refuse only once the processes started (``Invalid learning rate``, naming no argument), or that would train
    nothing; called by the models' constructors, so the command says it before any process starts."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    ns_dtype = hparams.get("muon_ns_dtype", "bf16")
    choices = get_args(NewtonSchulzDtype)
    if ns_dtype not in choices:
        raise ValueError(f"muon_ns_dtype={ns_dtype!r} is not one of {choices} (Muon's Newton-Schulz precision)")
    name = hparams.get("optimizer", "adamw")
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not one of {OPTIMIZERS} (adamw_bf16/8bit/4bit: AdamW's moments in "
                         "bf16 or quantised; muon: Muon for the blocks' matrices, AdamW for the rest)")
    rate = hparams.get("learning_rate")
    if not number(rate) or rate <= 0:
        raise ValueError(f"learning_rate={rate!r} must be a positive number (AdamW's step size, e.g. 3e-4)")
    decay = hparams.get("weight_decay", 0.0)
    if not number(decay) or decay < 0:
        raise ValueError(f"weight_decay={decay!r} must be a number >= 0 (e.g. 0.1)")
    betas = hparams.get("betas", (0.9, 0.999))
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(number(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"betas={betas!r} must be two numbers in [0, 1) (AdamW's moment decays, e.g. [0.9, 0.95])")
    warmup = hparams.get("warmup_steps", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup_steps={warmup!r} must be an integer >= 0")
    ratio = hparams.get("min_lr_ratio", 0.0)
    if not number(ratio) or not 0 <= ratio <= 1:
        raise ValueError(f"min_lr_ratio={ratio!r} must be in [0, 1] (the cosine's floor, a share of learning_rate)")
    steps = hparams.get("max_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"max_steps={steps!r} must be a positive integer, or None for the trainer's estimate")


def warmup_cosine_optimizer(module: pl.LightningModule) -> dict[str, Any]:
    """The module's ``optimizer`` with warmup + cosine decay, stepped every optimizer step, from its ``learning_rate``,
    ``weight_decay``, ``betas``, ``warmup_steps``, ``min_lr_ratio`` and ``max_steps`` hyper-parameters
    (``max_steps=None``: the trainer's estimate).

    ``adamw`` (the default): AdamW (Loshchilov & Hutter 2019) on every parameter; ``adamw_bf16``: its moments
    stored in bf16 (:class:`~lightning_par.optim.AdamWBF16States`); ``adamw_8bit``, ``adamw_4bit``: torchao's
    ``AdamW8bit`` and ``AdamW4bit`` (block-wise quantised moments, Dettmers et al. 2022). ``muon``:
    :class:`~lightning_par.optim.MuonWithAdamW`, Muon on the matrices of the blocks (the model map's) and AdamW on
    the rest (embedding, head, gains), Muon's update scaled to AdamW's RMS so that both take the same learning rate
    and weight decay; its Newton-Schulz iteration in ``muon_ns_dtype`` (``bf16`` as torch's Muon, or ``fp32``).
    Weight decay applies to matrices only; norm gains are left undecayed, as in GPT-2/nanoGPT and Llama.
    """
    hparams = module.hparams
    params = [p for p in module.parameters() if p.requires_grad]
    if hparams.get("optimizer", "adamw") == "muon":
        matrices = _block_matrices(module)
        others = [p for p in params if all(p is not m for m in matrices)]
        optimizer: torch.optim.Optimizer = MuonWithAdamW(
            muon_parameter_groups(matrices, others, weight_decay=hparams.weight_decay), lr=hparams.learning_rate,
            betas=tuple(hparams.betas), ns_dtype=DTYPES[hparams.get("muon_ns_dtype", "bf16")])
    else:
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = _adamw(hparams.get("optimizer", "adamw"))(groups, lr=hparams.learning_rate,
                                                               betas=tuple(hparams.betas))
    schedule = WarmupCosine(hparams.warmup_steps, _total_steps(module), hparams.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _adamw(name: str) -> Any:
    """The AdamW class of ``optimizer=name``."""
    if name == "adamw_bf16":
        return AdamWBF16States
    if name in ("adamw_8bit", "adamw_4bit"):
        from torchao.optim import AdamW4bit, AdamW8bit

        return AdamW8bit if name == "adamw_8bit" else AdamW4bit
    # fused=False keeps the portable implementation whatever device or DTensor a strategy leaves the parameters on.
    return functools.partial(torch.optim.AdamW, fused=False)


def _block_matrices(module: pl.LightningModule) -> list[torch.Tensor]:
    """The trainable matrices (and stacks of expert matrices) inside the blocks: the module's ``blocks_path``, or its
    model map's. Found by name, which a layout keeps (recomputation's and compilation's wrappers aside), where the
    laid-out module (a pipeline stage, tensor-parallel shards) no longer shows a model map."""
    path = getattr(module, "blocks_path", None)
    if path is None:
        model_map = derive_model_map(module)
        if model_map is None:
            raise ValueError(f"optimizer='muon' steps the matrices of the blocks, and no blocks were found in "
                             f"{type(module).__name__}: set its blocks_path (e.g. 'model.layers'), use "
                             "optimizer='adamw', or return MuonWithAdamW with your own parameter groups")
        path = model_map.blocks
    wrappers = re.compile(rf"(^|\.)({re.escape(_CHECKPOINT_PREFIX)}|_orig_mod\.)")
    return [p for name, p in module.named_parameters() if p.requires_grad and p.dim() in (2, 3)
            and wrappers.sub(r"\1", name).startswith(path + ".")]


def _total_steps(module: pl.LightningModule) -> int | None:
    if module.hparams.max_steps is not None:
        return module.hparams.max_steps
    # `module.trainer` raises when detached; the private attribute lets the module be used on its own.
    if module._trainer is None:
        return None
    estimated = module._trainer.estimated_stepping_batches
    # Infinite training reports inf (or -1 for an iterable dataset without max_steps).
    return int(estimated) if math.isfinite(estimated) and estimated > 0 else None


class ContractModule(pl.LightningModule):
    """Training shared by the project's models (language models, the vision transformer). A subclass gives the model
    contract (``split_batch``, ``forward``, ``loss_fn``) and the optimizer's hyper-parameters; this logs
    ``train_loss`` / ``val_loss`` / ``test_loss`` (averaged over ranks) and configures its ``optimizer`` (AdamW, or
    Muon with AdamW: :func:`warmup_cosine_optimizer`) with warmup and cosine decay."""

    def _shared_step(self, batch: Any) -> Tensor:
        inputs, targets = self.split_batch(batch)
        return self.loss_fn(self(inputs), targets)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._shared_step(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._shared_step(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._shared_step(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> Any:
        return warmup_cosine_optimizer(self)


class LlamaLM(ContractModule):
    """Next-token language modelling with :class:`~lightning_par.models.llama.Transformer`.

    Model contract (pipeline and tensor-parallel strategies rely on these three methods rather than on
    ``training_step``, because a pipeline schedule runs forward and loss itself):

    * ``split_batch(batch) -> (inputs, targets)``: a batch is a LongTensor (B, T + 1) of token ids;
      ``inputs = batch[:, :-1]`` and ``targets = batch[:, 1:]``, both (B, T).
    * ``forward(inputs) -> logits`` of shape (B, T, vocab_size).
    * ``loss_fn(logits, targets) -> scalar``: mean cross-entropy over all B * T tokens, computed on
      logits upcast to fp32.

    The transformer is built in ``__init__`` (so ``self.model`` exists before any strategy runs) and its
    configuration is validated there.
    """

    blocks_path = "model.layers"  # the blocks whose matrices optimizer='muon' steps with Muon

    def __init__(
        self,
        vocab_size: int = 256,
        dim: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        ffn_hidden_size: int | None = None,
        max_seq_len: int = 256,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        tie_embeddings: bool = False,
        init_std: float = 0.02,
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_layers: list[int] | None = None,
        moe_capacity_factor: float | None = None,
        moe_aux_loss_weight: float = 0.01,
        moe_z_loss_weight: float = 0.001,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        max_steps: int | None = None,
        optimizer: OptimizerName = "adamw",
        muon_ns_dtype: NewtonSchulzDtype = "bf16",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_optimizer_hparams(self.hparams)
        self.config = LlamaConfig(
            vocab_size=vocab_size,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            ffn_hidden_size=ffn_hidden_size,
            max_seq_len=max_seq_len,
            rope_theta=rope_theta,
            norm_eps=norm_eps,
            tie_embeddings=tie_embeddings,
            init_std=init_std,
            moe_experts=moe_experts,
            moe_top_k=moe_top_k,
            moe_layers=moe_layers,
            moe_capacity_factor=moe_capacity_factor,
            moe_aux_loss_weight=moe_aux_loss_weight,
            moe_z_loss_weight=moe_z_loss_weight,
        )
        self.model = Transformer(self.config)  # validates the config

    def split_batch(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T + 1) token ids -> inputs (B, T) and next-token targets (B, T)."""
        if not isinstance(batch, Tensor) or batch.dim() != 2:
            raise TypeError(f"LlamaLM expects a batch of token ids of shape (B, T + 1), got {type(batch).__name__}")
        return batch[:, :-1], batch[:, 1:]

    @override
    def forward(self, inputs: Tensor) -> Tensor:
        return self.model(inputs)  # (B, T, V)

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over all tokens (fp32 logits so bf16 training keeps an accurate softmax), plus
        the weighted load-balancing and z-losses of the mixture-of-experts blocks of the same forward."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1)) + self.model.auxiliary_loss()

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self._log_routing()
        return loss

    def _log_routing(self) -> None:
        """Expert load, dropped fraction and auxiliary losses of the MoE blocks (averaged over blocks, and over
        ranks; under pipeline parallel, where ranks hold different blocks, this rank's blocks)."""
        stats = list(self.model.routing_stats().values())
        if not stats:
            return
        pipelined = any(layer.mlp.loss_scale_in_backward is not None for layer in self.model.layers.values()
                        if isinstance(getattr(layer, "mlp", None), MoEFeedForward))
        log = functools.partial(self.log, sync_dist=not pipelined)
        n = len(stats)
        log("moe/aux_loss", sum(s.aux_loss.detach() for s in stats) / n)
        log("moe/z_loss", sum(s.z_loss.detach() for s in stats) / n)
        log("moe/dropped_fraction", sum(s.dropped_fraction for s in stats) / n)
        load = sum(s.tokens_per_expert for s in stats).float()
        for expert, share in enumerate((load / load.sum()).tolist()):
            log(f"moe/load_expert_{expert}", share)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token of the model (PaLM appendix B); used by the MFU callback."""
        return self.model.flops_per_token(seq_len)
