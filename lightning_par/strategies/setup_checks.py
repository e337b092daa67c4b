"""What the LightningModule and its data must offer the layout, checked at set-up so that a mismatch fails on every
rank before the first step: the module's part of the model contract, and the first batch of the data (as the
contract's ``(inputs, targets)``, which the techniques that check, trace or time the model at set-up also run it
on). Lightning side: it reads the trainer's loops."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.compose import check_batch_fits, runs_on_a_sample
from lightning_par.parallel.pipeline.split import check_microbatches
from lightning_par.parallel.initialize import RandomState
from lightning_par.parallel.model_call import ModelCall
from lightning_par.parallel.model_map import ModelMap, network_prefix
from lightning_par.parallel.small_copy import model_dtype, small_copy
from lightning_par.strategies.pipeline_contract import complete_pipeline_contract

__all__ = ["check_module", "data_of_this_run", "layout_sample", "sample_for_layout", "step_call"]


def check_module(module: LightningModule, config: ParallelConfig, trainer: Trainer, *, fitting: bool) -> None:
    """Raise when ``module`` cannot be trained or run in ``config``'s layout (the pipeline's contract, completed where
    it can be derived; something to train); warn about settings that cost what the user may not expect."""
    if config.pp > 1:
        complete_pipeline_contract(module)
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


def _first_batch_and_size(module: LightningModule, broadcast: Callable[[Any], Any]) -> tuple[Any, int | None] | None:
    """Rank 0's first batch and the loader's batch size (``broadcast`` hands the batch to every rank: a shuffling loader
    would give each rank another, and ranks that check or cut the model together must run it on the same sample);
    None without data."""
    loader = data_of_this_run(module.trainer)
    if loader is None:
        return None
    batch = broadcast(next(iter(loader)))
    batch_size = getattr(loader, "batch_size", None)
    return batch, batch_size if isinstance(batch_size, int) else None


def layout_sample(module: LightningModule, config: ParallelConfig, batch: Any, *,
                  batch_size: int | None) -> tuple[Tensor, Tensor | None] | None:
    """The (inputs, targets) of ``batch`` that the layout runs at set-up, checked against what the layout needs of every
    batch of ``batch_size`` samples (None: the batch's own size). Through ``split_batch`` when the module defines it
    (one micro-batch under pipeline parallel: what a stage runs at a time), else a batch of token ids, a dict's
    ``input_ids`` or a tuple's first tensor as the inputs. None with batches of another kind."""
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
    check_batch(config, batch_size=batch_size if batch_size is not None else inputs.shape[0],
                seq_len=inputs.shape[1] if inputs.dim() == 2 else None)
    if callable(split) and config.pp > 1:
        size = max(1, inputs.shape[0] // config.microbatches)
        inputs, targets = inputs[:size], targets[:size]
    return inputs, targets


def check_batch(config: ParallelConfig, *, batch_size: int | None, seq_len: int | None) -> None:
    """``parallel.compose.check_batch_fits``, its refusal in the names the user gave the strategy."""
    try:
        check_batch_fits(config, batch_size=batch_size, seq_len=seq_len)
    except ValueError as refusal:
        config.spelling.spell_error(refusal)
        raise


def sample_for_layout(module: LightningModule, config: ParallelConfig, model_map: ModelMap | None,
                      broadcast: Callable[[Any], Any],
                      device: torch.device | None = None) -> tuple[Tensor, Tensor | None] | ModelCall | None:
    """The first batch where the layout runs the model at set-up (checking a tensor-parallel split, the layout's
    forward and a mixture-of-experts model's routing, cutting pipeline stages, finding blocks that ZeRO-3 must not
    gather alone) or splits batches (context parallel), else None: as the model contract's ``(inputs, targets)``
    where the module defines ``split_batch``, else as the call its ``training_step`` makes of the model
    (:func:`step_call`, on ``device``). Raises when a tensor-parallel split needs one and the data gives none the
    model contract can read."""
    if not runs_on_a_sample(module, config, model_map):
        return None
    device = device or torch.device("cpu")
    # One process never takes this batch nor runs the copy: the user's random stream (which a loader's iterator draws
    # its seed from) must not move, or dropout would draw other masks than under Lightning's own strategies.
    random_state = RandomState(device)
    try:
        taken = _first_batch_and_size(module, broadcast)
        call = (step_call(module, taken[0], model_map, device)
                if taken is not None and model_map is not None and not callable(getattr(module, "split_batch", None))
                else None)
    finally:
        random_state.restore()
    if call is not None:
        inputs = call.sample
        check_batch(config, batch_size=taken[1] if taken[1] is not None else inputs.shape[0],
                    seq_len=inputs.shape[1] if inputs.dim() == 2 else None)
        return call
    sample = None if taken is None else layout_sample(module, config, taken[0], batch_size=taken[1])
    if config.tp > 1 and model_map is not None and sample is None:
        raise ValueError(f"{config.named('tp')}: the tensor-parallel split is checked on one sample of the data before "
                         "training, and none could be taken: define split_batch(batch) -> (inputs, targets) on the "
                         "LightningModule, or use batches of token tensors, of (inputs, ...) tuples or of dicts with "
                         "'input_ids' (see docs/models.md)")
    return sample


class _Caught(Exception):
    """Raised by the hook that catches the step's call of the model (of the module at ``path``), to stop the step
    there."""

    def __init__(self, path: str, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.path, self.args, self.kwargs = path, args, kwargs


def step_call(module: LightningModule, batch: Any, model_map: ModelMap, device: torch.device) -> ModelCall | None:
    """How ``module.training_step(batch, 0)`` calls the model: the first call it makes of the network (the module that
    holds the model map's blocks, head and embedding) or of a module around it (the LightningModule's own forward, a
    wrapper), with its arguments (``self.model(x)``, ``self(inputs, target)``, ``self.model(input_ids=x,
    attention_mask=m)``). Caught on a small copy of the module (one block of each kind, random weights, evaluation
    mode) and stopped there, so that nothing the step does after it (its loss, its logging) runs. The set-up's runs of
    small copies then make the same call, with the first tensor given as the sample's inputs. None where the step calls
    none of them, or fails before it (the set-up then takes the batch's first tensor as the model's inputs)."""
    model_copy = small_copy(module, model_map.blocks, device, model_dtype(module))
    parts = network_prefix(model_map).rstrip(".").split(".")
    around = ["", *(".".join(parts[:depth]) for depth in range(1, len(parts) + 1) if parts[0])]

    def catch(path: str) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            raise _Caught(path, args, kwargs)
        return hook

    handles = [model_copy.get_submodule(path).register_forward_pre_hook(catch(path), with_kwargs=True)
               for path in around]
    step = model_copy.training_step
    takes_index = len(inspect.signature(step).parameters) > 1
    try:
        # The copy has no trainer: what the step logs before it calls the model is not logged, and not warned about.
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            batch = move_data_to_device(batch, device)
            step(batch, 0) if takes_index else step(batch)
    except _Caught as caught:
        return ModelCall.first_tensor_as_inputs(caught.path, caught.args, caught.kwargs)
    except Exception:  # noqa: BLE001 - a step the copy cannot run: the batch's first tensor stands for the inputs
        return None
    finally:
        for handle in handles:
            handle.remove()
    return None
