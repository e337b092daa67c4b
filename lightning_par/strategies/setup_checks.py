"""What the LightningModule and its data must offer the layout, checked at set-up so that a mismatch fails on every
rank before the first step: the module's part of the model contract, and the first batch of the data (as the
contract's ``(inputs, targets)``, which the techniques that check, trace or time the model at set-up also run it
on). Lightning side: it reads the trainer's loops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.experts import moe_layers
from lightning_par.parallel.compose import check_batch_fits
from lightning_par.parallel.pipeline.split import check_microbatches
from lightning_par.parallel.model_map import ModelMap

__all__ = ["check_module", "data_of_this_run", "first_batch", "sample_for_layout"]


def check_module(module: LightningModule, config: ParallelConfig, trainer: Trainer, *, fitting: bool) -> None:
    """Raise when ``module`` cannot be trained or run in ``config``'s layout (the pipeline's contract, something to
    train); warn about settings that cost what the user may not expect."""
    if config.pp > 1:
        missing = [f"{name}()" for name in ("split_batch", "loss_fn") if not callable(getattr(module, name, None))]
        if missing:
            raise TypeError(f"pipeline parallel needs {type(module).__name__} to define {' and '.join(missing)}; the "
                            "schedule runs split_batch(batch) -> (inputs, targets), forward(inputs) -> logits and "
                            "loss_fn(logits, targets) itself (see docs/pipeline_parallel.md)")
        check_microbatches(config)
    if fitting and not any(p.requires_grad for p in module.parameters()):
        raise ValueError(f"{type(module).__name__} has no trainable parameters (it has none, or every one has "
                         "requires_grad=False): there is nothing to train. Unfreeze some, or add them in "
                         "configure_model()")
    if fitting and config.ddp_static_graph and trainer.accumulate_grad_batches > 1:
        rank_zero_warn("static_graph=True with accumulate_grad_batches > 1: gradients are all-reduced on every "
                       "micro-batch, because PyTorch's DDP cannot skip the all-reduce (no_sync) under a static graph")


def data_of_this_run(trainer: Trainer) -> Any:
    """The dataloader of what ``trainer`` is running (fit: training data), or None when there is none."""
    loop = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}.get(trainer.state.fn)
    source = getattr(loop, "_data_source", None)
    if source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    if isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    elif isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    return loader


def first_batch(module: LightningModule, config: ParallelConfig,
                broadcast: Callable[[Any], Any]) -> tuple[Tensor, Tensor | None] | None:
    """Rank 0's first batch (``broadcast`` hands it to every rank: a shuffling loader would give each rank another,
    and ranks that check or cut the model together must run it on the same sample), checked against what the layout
    needs of every batch. Through ``split_batch`` when the module defines it (one micro-batch under pipeline
    parallel: what a stage runs at a time), else a batch of token ids, a dict's ``input_ids`` or a tuple's first
    tensor as the inputs. None without data or with batches of another kind."""
    loader = data_of_this_run(module.trainer)
    if loader is None:
        return None
    batch = broadcast(next(iter(loader)))
    batch_size = getattr(loader, "batch_size", None)
    return layout_sample(module, config, batch, batch_size=batch_size if isinstance(batch_size, int) else None)


def layout_sample(module: LightningModule, config: ParallelConfig, batch: Any, *,
                  batch_size: int | None) -> tuple[Tensor, Tensor | None] | None:
    """The (inputs, targets) of ``batch`` that the layout runs at set-up (:func:`first_batch`), checked against what
    the layout needs of every batch of ``batch_size`` samples (None: the batch's own size)."""
    split = getattr(module, "split_batch", None)
    targets = None
    if callable(split):
        inputs, targets = split(batch)
    elif isinstance(batch, Tensor):
        inputs = batch
    elif isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        inputs = batch["input_ids"]
    elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):  # (inputs, targets, ...)
        inputs = batch[0]
    else:
        return None
    check_batch_fits(config, batch_size=batch_size if batch_size is not None else inputs.shape[0],
                     seq_len=inputs.shape[1] if inputs.dim() == 2 else None)
    if callable(split) and config.pp > 1:
        size = max(1, inputs.shape[0] // config.microbatches)
        inputs, targets = inputs[:size], targets[:size]
    return inputs, targets


def sample_for_layout(module: LightningModule, config: ParallelConfig, model_map: ModelMap | None,
                      broadcast: Callable[[Any], Any]) -> tuple[Tensor, Tensor | None] | None:
    """The first batch where the layout runs the model at set-up (checking a tensor-parallel split, the layout's
    forward and a mixture-of-experts model's routing, cutting pipeline stages, finding blocks that ZeRO-3 must not
    gather alone) or splits batches (context parallel), else None. Raises when a tensor-parallel split needs one and
    the data gives none the model contract can read."""
    if (config.tp == 1 and config.pp == 1 and config.cp == 1 and config.ep == 1 and config.zero_stage != 3
            and not moe_layers(module, model_map)):
        return None
    sample = first_batch(module, config, broadcast)
    if config.tp > 1 and model_map is not None and sample is None:
        raise ValueError(f"{config.named('tp')}: the tensor-parallel split is checked on one sample of the data before "
                         "training, and none could be taken: define split_batch(batch) -> (inputs, targets) on the "
                         "LightningModule, or use batches of token tensors, of (inputs, ...) tuples or of dicts with "
                         "'input_ids' (see docs/models.md)")
    return sample
