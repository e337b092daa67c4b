"""Stragglers: a rank made slow is named within one window of steps, a uniformly loaded run names nobody."""

from __future__ import annotations

import time
import warnings

import lightning
import pytest
from harness import run_distributed

from lightning_par.callbacks import StragglerMonitor
from lightning_par.data import TokenDataModule
from lightning_par.models import LlamaLM
from lightning_par.health.stragglers import arrivals_in_steps, own_step_times

WINDOW = 4


class Load(lightning.Callback):
    """Each rank sleeps its ``seconds[rank]`` before each step's work, as a rank on a throttled device falls behind."""

    def __init__(self, *seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        time.sleep(self.seconds[trainer.global_rank])


def _fit(world_size: int, strategy, callbacks: list) -> tuple[StragglerMonitor, list[str], dict]:
    monitor = StragglerMonitor(every_n_steps=WINDOW)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2 * WINDOW,
                                callbacks=[*callbacks, monitor], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    module = LlamaLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    data = TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=2, num_samples=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    named = [str(w.message) for w in caught if "straggler" in str(w.message)]
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("faults/")}
    return monitor, named, logged


def _ranks(rank: int, world_size: int) -> dict:
    from lightning_par import DataParallelStrategy, ZeroStrategy

    slow, slow_named, slow_logged = _fit(world_size, ZeroStrategy(zero_stage=3), [Load(0.0, 0.3)])
    even, even_named, _ = _fit(world_size, DataParallelStrategy(), [Load(0.05, 0.05)])
    return {"slow": slow.last, "slow_named": slow_named, "slow_logged": slow_logged, "even": even.last,
            "even_named": even_named}


def test_a_slow_rank_is_named_and_an_even_run_names_nobody() -> None:
    outcome = run_distributed(_ranks, 2, timeout=300)[0]
    slow, even = outcome["slow"], outcome["even"]
    print(f"slowed rank 1: own step times {slow.own}, spread {slow.spread:.2f}; even run: {even.own}, "
          f"spread {even.spread:.2f}")
    assert slow.stragglers == [1] and slow.slowest_rank == 1
    assert slow.own[1] - slow.own[0] > 0.2  # most of the 0.3 s it slept
    assert len(outcome["slow_named"]) == 2  # once per window
    assert "rank 1 (on " in outcome["slow_named"][0] and "is a straggler: its own step time" in outcome["slow_named"][0]
    assert outcome["slow_logged"]["faults/slowest_rank"] == 1.0
    assert outcome["slow_logged"]["faults/step_time_spread"] == pytest.approx(slow.spread) and slow.spread > 1.5
    assert even.stragglers == [] and outcome["even_named"] == []


def test_own_step_times_from_arrivals() -> None:
    """Rank 2 arrives 0.4 s late at the first collective of each step; the others then wait for it. A group that
    not every member reported (evicted from a flight recorder) does not count."""
    reports = [[], [], []]
    for step in range(3):
        base = 10.0 * step
        for rank in range(3):
            reports[rank].append(("0", 2 * step, step, base + (0.4 if rank == 2 else 0.01 * rank)))
            reports[rank].append(("0", 2 * step + 1, step, base + 0.5 + 0.001 * rank))
    reports[0].append(("7", 1, 0, 100.0))  # a group only rank 0 reported
    times = own_step_times(reports, step_seconds=1.0, factor=1.5)
    assert [round(t, 6) for t in times.own] == [0.6, 0.61, 1.0]
    assert times.stragglers == [2] and times.slowest_rank == 2 and round(times.spread, 6) == round(1 / 0.6, 6)
    assert own_step_times(reports, step_seconds=1.0, factor=2.0).stragglers == []


def test_arrivals_leave_out_sends_and_earlier_collectives() -> None:
    entry = {"process_group": ("3", "dp"), "collective_seq_id": 5, "is_p2p": False}
    trace = {"entries": [{**entry, "time_created_ns": 50}, {**entry, "time_created_ns": 150},
                         {**entry, "time_created_ns": 250, "is_p2p": True}, {**entry, "time_created_ns": 350}]}
    assert arrivals_in_steps(trace, [100, 300]) == [("3", 5, 0, 150e-9), ("3", 5, 1, 350e-9)]
    assert arrivals_in_steps(None, [100]) == []
