"""Faults injected into a running job: every rank exits within a bounded time, the message names the rank and the
cause, no rank outlives the command that launched it, and no visible checkpoint is incomplete.

The bounds (``lightning_par/health/fault_monitor.py``): once a rank has reported a failure, the others leave within three
heartbeat intervals (1.5 s each under the 15 s timeout used here, 2 s at most); a rank waiting on a peer that
neither answers nor fails leaves when the process group's timeout expires. Each test bounds the exit by the wait
of its launch (``WAIT``, ten times what it takes here, so that only a hang fails it on a loaded machine) and prints
how long after the fault the last rank had gone (``pytest -s``): the figures docs/errors.md quotes.

The diagnosis itself (which rank stopped beating, which is behind, what is a communication error) is tested first,
with two monitors on one store in this process (no process group needed).
"""

from __future__ import annotations

import itertools
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import free_port
from rank_processes import SCRIPT, WORLD_SIZE, launch, launch_command
from installed import PYTHON, TORCHRUN

from lightning_par.health import fault_monitor as fault
from lightning_par.checkpoint.format import STAGING_DIR, export_consolidated, read_metadata
from lightning_par.health.fault_monitor import FaultMonitor, is_communication_error

TIMEOUT = "15"  # seconds a collective may wait: the process group's timeout (a rank starting up takes up to 10 s here)
WAIT = 150.0  # seconds within which every rank of a launch must have exited, start-up and training included
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



def _report(name: str, after_fault: float | None, output: str) -> None:
    assert after_fault is not None, f"{name}: the run ended before its fault\n{output[-3000:]}"
    print(f"\n{name}: every rank had exited {after_fault:.1f} s after the fault")


def _command(launcher: str, out: Path, *args: str) -> list[str]:
    run = [str(SCRIPT), "--dir", str(out.parent / "ckpt"), "--out", str(out), "--timeout", TIMEOUT, *args]
    if launcher == "torchrun":
        return [*TORCHRUN, "--standalone", "--nproc-per-node", str(WORLD_SIZE),
                *run]
    return [PYTHON, *run, "--devices", str(WORLD_SIZE)]  # Lightning's subprocess launcher starts rank 1


def _visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _assert_complete(checkpoint: Path, step: int, tmp_path: Path) -> None:
    """``checkpoint`` passes every check before loading and holds the state of ``step``."""
    export_consolidated(checkpoint, tmp_path / f"{checkpoint.name}.pt")  # validates it, reads every shard
    assert read_metadata(checkpoint / "meta.pt")["global_step"] == step


@pytest.mark.parametrize("launcher", ["subprocess", "torchrun"])
def test_a_rank_failing_in_set_up_leaves_no_rank_behind(tmp_path: Path, launcher: str) -> None:
    """Rank 0 raises during set-up (after the process group is up). The command returns only once every rank has
    exited: under Lightning's subprocess launcher rank 0 waits for the ranks it started (they leave on their own,
    naming rank 0's error) and kills what is left; torchrun's agent stops the others itself."""
    run = launch_command(tmp_path / "out", _command(launcher, tmp_path / "out", "--fail-setup-rank", "0"), WAIT)
    _report(f"rank 0 failing in set-up ({launcher})", run["after_fault"], run["output"])
    assert run["code"] != 0
    assert len(run["pids"]) == WORLD_SIZE and run["running"] == [], run
    assert "RuntimeError: injected: rank 0 fails during set-up" in run["output"], run["output"][-3000:]
    if launcher == "subprocess":
        assert ("[rank 1] lightning-par: rank 0 failed in set-up with RuntimeError: injected: rank 0 fails during "
                "set-up; rank 1 stopped waiting in set-up") in run["output"], run["output"][-3000:]


def test_a_rank_stopped_inside_a_collective(tmp_path: Path) -> None:
    """Rank 1 is stopped (SIGSTOP) inside backward while DDP's all-reduce runs. Rank 0's all-reduce times out; it
    names the collective and rank 1, whose heartbeat stopped in the same step, and kills the stopped rank it had
    launched before it returns."""
    run = launch_command(tmp_path / "out", _command("subprocess", tmp_path / "out", "--stop-in-backward", "2"), WAIT)
    _report("rank 1 stopped in a collective", run["after_fault"], run["output"])
    assert run["code"] != 0
    assert run["running"] == [], run
    output = run["output"]
    assert "lightning-par: rank 0 failed in training step 1 (all_reduce on process group" in output, output[-3000:]
    assert "rank 1 is gone (last heartbeat" in output and "in training step 1)" in output, output[-3000:]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_save(tmp_path: Path, asynchronous: bool) -> None:
    """Rank 1's write of the step-6 checkpoint fails with ENOSPC. Every rank stops with one message naming rank 1,
    the error and the checkpoint; the checkpoints of step 3 stay complete and the failed one stays out of sight."""
    ranks = launch(tmp_path / "ckpt", tmp_path / "out", "--disk-full", "6", "--timeout", TIMEOUT,
                   *(["--async-save"] if asynchronous else []), wait=WAIT)
    _report(f"a full disk ({'async' if asynchronous else 'sync'})", ranks[-1]["after_fault"], ranks[0]["stderr"])
    failed = (f"saving checkpoint {str(tmp_path / 'ckpt' / 'epoch=1-step=6.ckpt')!r} failed: rank 1: OSError: "
              "[Errno 28] No space left on device")
    for rank in ranks:
        assert rank["code"] != 0
        assert failed in rank["stderr"], rank["stderr"][-3000:]
        assert "the checkpoints saved before it are intact" in rank["stderr"]
    assert _visible(tmp_path / "ckpt") == [STAGING_DIR, "epoch=0-step=3.ckpt", "last.ckpt"]
    for name in ("epoch=0-step=3.ckpt", "last.ckpt"):
        _assert_complete(tmp_path / "ckpt" / name, 3, tmp_path)


def test_a_rank_killed_during_an_asynchronous_save(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while its background thread writes the step-6 checkpoint. Rank 0, in the save's own
    collectives or in training's (whichever notices first), names rank 1 and where it was; the half-written
    checkpoint stays out of sight, the earlier ones complete."""
    ranks = launch(tmp_path / "ckpt", tmp_path / "out", "--kill-in-save", "6", "--async-save", "--timeout", TIMEOUT,
                   wait=WAIT)
    _report("rank 1 killed in an asynchronous save", ranks[-1]["after_fault"], ranks[0]["stderr"])
    assert ranks[1]["code"] == -signal.SIGKILL
    assert ranks[0]["code"] != 0
    message = ranks[0]["stderr"]
    assert "lightning-par: rank 0 failed in " in message, message[-3000:]
    assert "rank 1 is gone (last heartbeat" in message and "after step 6" in message, message[-3000:]
    assert _visible(tmp_path / "ckpt") == [STAGING_DIR, "epoch=0-step=3.ckpt", "last.ckpt"]
    _assert_complete(tmp_path / "ckpt" / "last.ckpt", 3, tmp_path)


def test_a_loader_raising_mid_epoch(tmp_path: Path) -> None:
    """Rank 1's dataset raises in epoch 1. Rank 1 names its error; rank 0, left in a collective, names rank 1's
    report; the checkpoints written before are complete and nothing is left staged."""
    ranks = launch(tmp_path / "ckpt", tmp_path / "out", "--loader-fails-at", "6", "--timeout", TIMEOUT, wait=WAIT)
    _report("rank 1's loader raising", ranks[-1]["after_fault"], ranks[0]["stderr"])
    own = "rank 1 failed in training after step 6 with RuntimeError: injected: sample"
    assert ranks[1]["code"] != 0 and f"lightning-par: {own}" in ranks[1]["stderr"], ranks[1]["stderr"][-3000:]
    assert ranks[0]["code"] != 0 and f"rank 1 reported: {own}" in ranks[0]["stderr"], ranks[0]["stderr"][-3000:]
    assert _visible(tmp_path / "ckpt") == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    _assert_complete(tmp_path / "ckpt" / "last.ckpt", 6, tmp_path)
