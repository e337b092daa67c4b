"""FaultMonitor's diagnosis, with two monitors on one store in this process (no process group needed)."""

from __future__ import annotations

import itertools
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness import free_port
from lightning_par import fault
from lightning_par.fault import FaultMonitor, is_communication_error

PEER_LOST = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer")


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


def _monitors(store: dist.Store, run: int, monkeypatch: pytest.MonkeyPatch, interval: float = 0.1) -> list[FaultMonitor]:
    """Ranks 0 and 1 of one run. (Processes number their runs alike; here both ranks live in one process.)"""
    monitors = []
    for rank in range(2):
        monkeypatch.setattr(fault, "_RUNS", itertools.repeat(run))
        # A long timeout and grace: no monitor gives up on its own (and ends this process) while the test runs.
        monitors.append(FaultMonitor(store, rank, 2, timeout=100.0, interval=interval, exit_grace=100.0))
    for monitor in monitors:
        monitor.start()
    return monitors


def test_names_a_rank_that_stopped_beating_and_the_last_checkpoint(store: dist.Store, monkeypatch) -> None:
    survivor, lost = _monitors(store, 0, monkeypatch)
    lost.enter("training step 4")
    time.sleep(0.25)  # the next heartbeat carries the phase
    lost.stop()  # its heartbeats end, as when the process is killed
    survivor.enter("training step 4")
    survivor.last_checkpoint = "ckpt/last.ckpt"
    message = survivor.report(PEER_LOST)
    survivor.stop()
    assert message.startswith("lightning-par: rank 0 failed in training step 4 (")
    assert "rank 1 is gone (last heartbeat" in message and "in training step 4)" in message
    assert message.endswith("the last complete checkpoint this run wrote is ckpt/last.ckpt")


def test_names_a_live_rank_that_is_behind_and_a_rank_that_reported_its_own_error(store: dist.Store,
                                                                                 monkeypatch) -> None:
    survivor, stuck = _monitors(store, 0, monkeypatch)
    stuck.enter("training step 2")
    survivor.enter("training step 2")
    survivor.enter("training step 3")
    time.sleep(0.3)
    message = survivor.report(PEER_LOST)
    assert "rank 1 is alive but stuck in training step 2 (others are further on)" in message

    first, second = _monitors(store, 1, monkeypatch)
    second.enter("validation")
    own = second.report(ValueError("the batch has 3 columns\nmore detail"))
    assert own == "lightning-par: rank 1 failed in validation with ValueError: the batch has 3 columns"
    message = first.report(PEER_LOST)
    assert "rank 1 reported: rank 1 failed in validation with ValueError: the batch has 3 columns" in message
    for monitor in (survivor, stuck, first, second):
        monitor.stop()


def test_communication_errors_are_told_from_others() -> None:
    assert is_communication_error(PEER_LOST)
    assert is_communication_error(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    try:
        try:
            raise PEER_LOST
        except RuntimeError as error:
            raise KeyError("wrapped") from error
    except KeyError as wrapped:
        assert is_communication_error(wrapped)
    assert not is_communication_error(ValueError("bad shape"))
