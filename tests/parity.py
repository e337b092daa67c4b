"""Numerical parity: K steps under a layout vs the same K steps in one plain PyTorch process.

Every strategy proves itself with this helper (docs/architecture.md, "Testing"). Both runs start from the same seed
and consume the same global batches:

- the layout run is a real ``Trainer.fit`` on ``world_size`` gloo ranks. The training set is dealt by
  ``DistributedSampler(num_replicas=dp, rank=dp_rank, shuffle, seed=0)``, so global micro-batch
  ``m`` is positions ``[m*B*dp, (m+1)*B*dp)`` of the sampler's order (``randperm(n, seed 0)`` when
  shuffling, else ``arange(n)``), split across the dp ranks;
- the reference reads those same positions in one process with a plain loop over the model contract
  (``split_batch`` -> ``forward`` -> ``loss_fn``), scaling by 1/accumulate like Lightning does.

Losses are compared per micro-batch (mean over the global micro-batch) and weights after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import lightning
import torch
from harness import run_distributed
from torch import Tensor
from torch.utils.data import default_collate


@dataclass
class ParityRun:
    losses: list[float]  # one per micro-batch: the mean loss over the global micro-batch
    state_dict: dict[str, Tensor]


def global_order(num_samples: int, shuffle: bool) -> Tensor:
    """The order in which Lightning's DistributedSampler hands out samples in epoch 0."""
    if shuffle:
        return torch.randperm(num_samples, generator=torch.Generator().manual_seed(0))
    return torch.arange(num_samples)


def reference_run(make_module: Callable[[], Any], make_datamodule: Callable[[], Any], *, dp: int, steps: int,
                  accumulate: int = 1, seed: int = 1234, gradient_clip_val: float | None = None,
                  pieces_like_ranks: bool = False, pipeline_microbatches: int = 1,
                  skipped_steps: frozenset[int] = frozenset()) -> ParityRun:
    """The single-process run the layout must reproduce (``gradient_clip_val``: clip by total 2-norm).
    ``skipped_steps``: steps whose batches the run leaves out (no loss recorded, no optimizer or scheduler step).

    ``pieces_like_ranks`` runs each global micro-batch in the pieces the layout multiplies: one per data-parallel
    rank (rank ``r`` reads every ``dp``-th sample from ``r``), each cut into ``pipeline_microbatches``; gradients
    are summed at 1/pieces each, the same mean. For computations whose rounding depends on what is multiplied
    together, such as float8's scale from the amax of a whole activation tensor. Such a run also computes on one
    thread, as each rank does (tests/harness.py): a layer norm's weight gradient sums over the tokens in an order
    that depends on the thread count, and float8's rounding would grow that last-bit difference."""
    threads = torch.get_num_threads()
    if pieces_like_ranks:
        torch.set_num_threads(1)
    try:
        return _reference_run(make_module, make_datamodule, dp=dp, steps=steps, accumulate=accumulate, seed=seed,
                              gradient_clip_val=gradient_clip_val, pieces_like_ranks=pieces_like_ranks,
                              pipeline_microbatches=pipeline_microbatches, skipped_steps=skipped_steps)
    finally:
        torch.set_num_threads(threads)


def _reference_run(make_module: Callable[[], Any], make_datamodule: Callable[[], Any], *, dp: int, steps: int,
                   accumulate: int, seed: int, gradient_clip_val: float | None, pieces_like_ranks: bool,
                   pipeline_microbatches: int, skipped_steps: frozenset[int]) -> ParityRun:
    datamodule = make_datamodule()
    datamodule.setup("fit")
    dataset = datamodule.train_dataloader().dataset
    # The same permutation of the whole split at every data-parallel size: the data-parallel samplers leave out its
    # last samples (drop_last), which the steps of one epoch never reach.
    order = global_order(len(dataset), datamodule.shuffle)
    micro = datamodule.batch_size * dp  # samples in one global micro-batch
    if (steps * accumulate) * micro > len(dataset):
        raise ValueError("the parity run would need more than one epoch of data; use more samples")

    torch.manual_seed(seed)
    module = make_module()
    if hasattr(module, "load_pretrained"):  # HFCausalLM: built on the meta device, then its weights are read
        module._trainer = _DataOnly(datamodule)  # what it reads of a trainer there (the data's packing separator)
        module.configure_model()
        module.load_pretrained()
        module._trainer = None
    optimizer, scheduler = _optimizer_and_scheduler(module.configure_optimizers())
    losses: list[float] = []
    for step in range(steps):
        if step in skipped_steps:
            continue
        for micro_step in range(accumulate):
            m = step * accumulate + micro_step
            batch = default_collate([dataset[int(i)] for i in order[m * micro:(m + 1) * micro]])
            chunk_losses = []
            pieces = ([p for r in range(dp) for p in batch[r::dp].chunk(pipeline_microbatches)]
                      if pieces_like_ranks else [batch])
            for piece in pieces:
                inputs, targets = module.split_batch(piece)
                loss = module.loss_fn(module(inputs), targets)
                (loss / (accumulate * len(pieces))).backward()
                chunk_losses.append(loss.item())
            losses.append(sum(chunk_losses) / len(pieces))
        if gradient_clip_val is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return ParityRun(losses, {k: v.detach().clone() for k, v in module.state_dict().items()})


@dataclass
class _DataOnly:
    """What a module set up outside a Trainer may read of one: the datamodule, and no checkpoint to resume."""

    datamodule: Any
    ckpt_path: None = None


def _optimizer_and_scheduler(configured: Any) -> tuple[torch.optim.Optimizer, Any]:
    if isinstance(configured, torch.optim.Optimizer):
        return configured, None
    scheduler = configured.get("lr_scheduler")
    if isinstance(scheduler, dict):
        scheduler = scheduler["scheduler"]
    return configured["optimizer"], scheduler


class RecordLoss(lightning.Callback):
    """Keeps this rank's loss of every micro-batch (Lightning hands it over divided by accumulate)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)


def _layout_rank(rank: int, world_size: int, make_module: Callable, make_datamodule: Callable,
                 make_strategy: Callable, steps: int, accumulate: int, seed: int,
                 trainer_kwargs: dict) -> tuple[list[float], dict[str, Tensor] | None]:
    import lightning_par  # noqa: F401 - registers the strategy names

    torch.manual_seed(seed)
    module = make_module()
    recorder = RecordLoss()
    trainer_kwargs = dict(trainer_kwargs)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=world_size, strategy=make_strategy(), max_steps=steps,
        accumulate_grad_batches=accumulate, callbacks=[recorder, *trainer_kwargs.pop("callbacks", [])], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, **trainer_kwargs,
    )
    trainer.fit(module, datamodule=make_datamodule())
    state = trainer.strategy.consolidated_state_dict()
    return recorder.losses, (state if rank == 0 else None)


def _fit_until_value_error(rank: int, world_size: int, make_module: Callable, make_datamodule: Callable,
                           make_strategy: Callable) -> str:
    import torch.distributed as dist

    import lightning_par  # noqa: F401 - registers the strategy names

    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=make_strategy(), max_steps=1,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False)
    try:
        trainer.fit(make_module(), datamodule=make_datamodule())
    except (ValueError, TypeError) as error:
        if dist.is_initialized():  # layouts are checked before the process group starts
            dist.barrier()  # every rank got here: nobody is left waiting in a collective
        return f"{type(error).__name__}: {error}"
    raise AssertionError("no ValueError or TypeError")


def assert_fails_on_every_rank(make_module: Callable[[], Any], make_datamodule: Callable[[], Any],
                               make_strategy: Callable[[], Any], *, world_size: int, message: str) -> None:
    """``Trainer.fit`` raises the same ``ValueError`` (or ``TypeError``) containing ``message`` on every rank,
    and no rank hangs."""
    messages = run_distributed(_fit_until_value_error, world_size, make_module, make_datamodule, make_strategy)
    assert len(set(messages)) == 1, messages
    assert message in messages[0], messages[0]


def layout_run(make_module: Callable[[], Any], make_datamodule: Callable[[], Any], make_strategy: Callable[[], Any],
               *, world_size: int, steps: int, accumulate: int = 1, seed: int = 1234,
               trainer_kwargs: dict | None = None, timeout: float = 240.0) -> ParityRun:
    """``Trainer.fit`` under ``make_strategy()`` on ``world_size`` ranks. Factories must be picklable."""
    per_rank = run_distributed(_layout_rank, world_size, make_module, make_datamodule, make_strategy, steps,
                               accumulate, seed, trainer_kwargs or {}, timeout=timeout)
    # Ranks that read the same sample (tensor/pipeline groups) report the same loss, so the plain mean
    # over all ranks is the mean over the data-parallel ranks.
    losses = torch.tensor([rank_losses for rank_losses, _ in per_rank], dtype=torch.float64).mean(0).tolist()
    return ParityRun(losses, per_rank[0][1])


def _layout_ranks(rank: int, world_size: int, runs: dict[str, tuple], steps: int, accumulate: int, seed: int,
                  trainer_kwargs: dict) -> dict[str, tuple[list[float], dict[str, Tensor] | None]]:
    results = {}
    for name, (make_module, make_datamodule, make_strategy) in runs.items():
        try:
            results[name] = _layout_rank(rank, world_size, make_module, make_datamodule, make_strategy, steps,
                                         accumulate, seed, trainer_kwargs)
        except Exception as error:
            raise RuntimeError(f"layout {name} failed on rank {rank}") from error
    return results


def layout_runs(runs: dict[str, tuple[Callable, Callable, Callable]], *, world_size: int, steps: int,
                accumulate: int = 1, seed: int = 1234, trainer_kwargs: dict | None = None,
                timeout: float = 240.0) -> dict[str, ParityRun]:
    """:func:`layout_run` for several layouts on the same ``world_size`` ranks, one after the other in one launch:
    ``runs`` maps a name to (make_module, make_datamodule, make_strategy)."""
    per_rank = run_distributed(_layout_ranks, world_size, runs, steps, accumulate, seed, trainer_kwargs or {},
                               timeout=timeout)
    return {name: ParityRun(torch.tensor([ranks[name][0] for ranks in per_rank], dtype=torch.float64).mean(0).tolist(),
                            per_rank[0][name][1])
            for name in runs}


def max_relative_error(actual: ParityRun, expected: ParityRun) -> tuple[float, float]:
    """(worst loss error, worst weight error), each relative to the magnitude of the expected value."""
    if len(actual.losses) != len(expected.losses):
        raise AssertionError(f"{len(actual.losses)} losses recorded, {len(expected.losses)} expected")
    loss_error = max(abs(a - e) / max(abs(e), 1e-12) for a, e in zip(actual.losses, expected.losses))
    if actual.state_dict.keys() != expected.state_dict.keys():
        raise AssertionError(f"state dict keys differ: {sorted(actual.state_dict.keys() ^ expected.state_dict.keys())}")
    weight_error = 0.0
    # A tensor that stays at rounding noise (a key bias: its gradient is zero in exact arithmetic) is compared
    # against the size of the model's weights, not its own.
    floor = 1e-6 * max((float(t.abs().max()) for t in expected.state_dict.values() if t.numel()), default=0.0)
    for name, expected_tensor in expected.state_dict.items():
        actual_tensor = actual.state_dict[name].to(expected_tensor.dtype)
        scale = max(float(expected_tensor.abs().max()), floor, 1e-12)
        weight_error = max(weight_error, float((actual_tensor - expected_tensor).abs().max()) / scale)
    return loss_error, weight_error


def assert_parity(actual: ParityRun, expected: ParityRun, *, rtol: float,
                  weight_atol: float | None = None) -> tuple[float, float]:
    """Losses within ``rtol``; weights within ``rtol`` of each tensor's magnitude, or within ``weight_atol``.

    ``weight_atol`` is for Adam: it normalises each element's step by that element's gradient size, so an element
    whose gradient is near zero (a key bias's is exactly zero: softmax ignores it) turns rounding differences into
    differences of a sizeable part of the learning rate. Its bound is then a small share of the farthest Adam can
    move a weight (learning rate x steps), where a missing or doubled gradient would move it by a large share."""
    loss_error, weight_error = max_relative_error(actual, expected)
    assert loss_error <= rtol, f"loss differs by {loss_error:.2e} relative (> {rtol:.0e}): {actual.losses} vs {expected.losses}"
    if weight_atol is None:
        assert weight_error <= rtol, f"weights differ by {weight_error:.2e} relative to each tensor's max (> {rtol:.0e})"
        return loss_error, weight_error
    weight_error = max(float((actual.state_dict[name].to(t.dtype) - t).abs().max()) for name, t in
                       expected.state_dict.items())
    assert weight_error <= weight_atol, f"weights differ by {weight_error:.2e} (> {weight_atol:.0e})"
    return loss_error, weight_error


def assert_layout_matches(make_module: Callable[[], Any], make_datamodule: Callable[[], Any],
                          make_strategy: Callable[[], Any], *, world_size: int, dp: int, steps: int,
                          accumulate: int = 1, clip: float | None = None, rtol: float, label: str,
                          weight_atol: float | None = None) -> tuple[float, float]:
    """The layout run matches the single-process reference over the same global batches (``dp`` replicas
    read different samples); prints and returns (loss error, weight error)."""
    expected = reference_run(make_module, make_datamodule, dp=dp, steps=steps, accumulate=accumulate,
                             gradient_clip_val=clip)
    actual = layout_run(make_module, make_datamodule, make_strategy, world_size=world_size, steps=steps,
                        accumulate=accumulate, trainer_kwargs={"gradient_clip_val": clip})
    loss_error, weight_error = assert_parity(actual, expected, rtol=rtol, weight_atol=weight_atol)
    print(f"{label}: loss rel err {loss_error:.1e}, weights {weight_error:.1e}"
          + (" absolute" if weight_atol is not None else ""))
    return loss_error, weight_error
