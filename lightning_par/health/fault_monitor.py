"""Which rank died or hangs, in which collective, and a bounded exit for every other rank.

When a rank is killed or hangs, its peers are left inside a collective. Gloo notices a closed connection
at once and every backend raises once the process group's timeout has passed, but the error names a
socket, not a rank, and ranks that were not talking to the lost one go on waiting. ``FaultMonitor``
adds what is missing, in the spirit of torchelastic's health checks and NCCL's watchdog:

- heartbeats: a daemon thread on every rank publishes to the rendezvous store, every ``interval``
  seconds, a counter of the phases the rank has entered and the phase it is in ("training step 12");
- a diagnosis when a rank fails: ranks whose heartbeat stopped are dead; live ranks behind the others
  are stuck; the collective that failed (operation, process group, sequence number) comes from
  PyTorch's flight recorder; a rank that raised an error of its own publishes it for the others;
- a bounded exit: once any rank has reported a failure, every other rank leaves within ``exit_grace``
  (three heartbeat intervals: 6 s by default) with that message, even if it is blocked in a collective that
  would never return; when the store (on rank 0 or the launcher's agent) stops answering, within ``timeout / 2``.
  A failing rank itself exits within ``timeout`` of its failure. A rank that started the others (Lightning's
  subprocess launcher) waits for them and kills what is left (:func:`stop_processes`), so the launching
  command returns only after every rank is gone.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_par.parallel.comm import flight_recorder_trace

__all__ = ["FaultMonitor", "FLIGHT_RECORDER_ENTRIES", "failed_collective", "heartbeat_interval", "stop_processes"]

# Collectives the flight recorder keeps (PyTorch reads TORCH_FR_BUFFER_SIZE when a process group starts).
FLIGHT_RECORDER_ENTRIES = 2000
_KEY_PREFIX = "lightning_par/fault"
# Monitors are created in the same order on every rank: one key space per run, so a failure a test caught
# (or an earlier fit in the same processes) is not taken for a failure of the next run.
_RUNS = itertools.count()
# What gloo and NCCL say when a peer is gone or a collective timed out.
_COMMUNICATION_ERRORS = ("gloo", "nccl", "connection closed by peer", "connection reset", "timed out waiting")


class FaultMonitor:
    """Heartbeats of one rank over the rendezvous store, and the diagnosis when the run fails.

    Args:
        store: the default process group's store (every rank can reach it).
        rank, world_size: this rank and the world's size.
        timeout: seconds after a failure within which every rank has exited (the process group's timeout).
        interval: seconds between heartbeats; by default a tenth of ``timeout``, between 0.2 and 2.
        exit_grace: how long a rank waits, once a peer has reported a failure, for its own collective to fail and
            report (which gives the user its side of the diagnosis) before it leaves anyway; three intervals by
            default.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, timeout: float,
                 interval: float | None = None, exit_grace: float | None = None) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.interval = interval if interval is not None else heartbeat_interval(timeout)
        self.exit_grace = exit_grace if exit_grace is not None else 3 * self.interval
        # Own connection with a short timeout: the process group's store waits as long as a collective may.
        client = store.clone()
        client.set_timeout(timedelta(seconds=max(1.0, 2 * self.interval)))
        self._store = dist.PrefixStore(f"{_KEY_PREFIX}/{next(_RUNS)}", client)
        self.phase = "set-up"
        self.progress = 0  # phases entered: the same sequence on every rank
        self.last_checkpoint: str | None = None
        self._published_at = 0.0
        self._failing = False  # this rank's own error path runs: leave the exit to it (and the deadline)
        self.failed_first = False  # this rank's failure was the run's first (its traceback is the one to print)
        self._exit_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="lightning_par-heartbeat", daemon=True)

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeats, and the exit deadline a failure set (the run has torn down)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)

    def enter(self, phase: str) -> None:
        """Record that this rank starts ``phase`` (called from the training loop). Published at once when the phase
        changes (one store write a step), else at most twice an interval, so that a rank that dies or is stopped
        between heartbeats is reported where it was."""
        self.progress += 1
        changed, self.phase = phase != self.phase, phase
        if changed or time.monotonic() - self._published_at > self.interval / 2:
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the heartbeat thread deals with a lost store
                pass

    # ------------------------------------------------------------------ the failing rank
    def report(self, exception: BaseException) -> str:
        """Publish this rank's failure, diagnose the others, and return the message for the user.

        From here this rank exits within ``timeout`` even if tearing down blocks on a lost peer.
        """
        self._failing = True
        self._exit_at = time.monotonic() + self.timeout
        communication = is_communication_error(exception)
        own = f"rank {self.rank} failed in {self.phase}"
        if communication:
            own += f" ({failed_collective() or 'a collective'})"
        else:
            own += f" with {type(exception).__name__}: {str(exception).splitlines()[0] if str(exception) else ''}"
        try:
            self._store.set(f"failure/{self.rank}", own)
            self.failed_first = self._store.add("failures", 1) == 1
        except Exception:  # noqa: BLE001 - the store may be the thing that is gone
            self.failed_first = True  # no peer can be asked: this rank's traceback may be the only one
        lines = [own]
        if communication:
            # Wait for heartbeats to tell the dead from the living: a rank killed a moment ago beat recently.
            time.sleep(2.5 * self.interval)
            lines += self._peer_report()
        if self.last_checkpoint:
            lines.append(f"the last complete checkpoint this run wrote is {self.last_checkpoint}")
        return "lightning-par: " + "; ".join(lines)

    def _peer_report(self) -> list[str]:
        try:
            peers = {rank: self._read(rank) for rank in range(self.world_size) if rank != self.rank}
        except Exception:  # noqa: BLE001
            return [f"the rendezvous store ({_store_address()}) does not answer: the rank or agent hosting it "
                    "(rank 0 under a plain launch) is gone"]
        now = time.time()
        dead = {r for r, p in peers.items() if p is None or now - p["time"] > 2 * self.interval}
        ahead = max([self.progress] + [p["progress"] for r, p in peers.items() if r not in dead])
        lines = []
        for rank, state in sorted(peers.items()):
            if state is None:
                lines.append(f"rank {rank} never sent a heartbeat")
            elif state["failure"]:
                lines.append(f"rank {rank} reported: {state['failure']}")
            elif rank in dead:
                lines.append(f"rank {rank} is gone (last heartbeat {now - state['time']:.1f} s ago, "
                             f"in {state['phase']})")
            elif state["progress"] < ahead:
                lines.append(f"rank {rank} is alive but stuck in {state['phase']} (others are further on)")
        return lines or ["every other rank is alive and at the same point"]

    def _read(self, rank: int) -> dict[str, Any] | None:
        if not self._store.check([f"beat/{rank}"]):
            return None
        progress, stamp, phase = self._store.get(f"beat/{rank}").decode().split("\t", 2)
        failure_key = f"failure/{rank}"
        failure = self._store.get(failure_key).decode() if self._store.check([failure_key]) else None
        return {"progress": int(progress), "time": float(stamp), "phase": phase, "failure": failure}

    # ------------------------------------------------------------------ every rank
    def _publish(self) -> None:
        self._published_at = time.monotonic()
        self._store.set(f"beat/{self.rank}", f"{self.progress}\t{time.time():.3f}\t{self.phase}")

    def _beat(self) -> None:
        unreachable_since: float | None = None
        peer_failure_since: float | None = None
        peer_failures = ""
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if self._exit_at is not None and now > self._exit_at:
                self._exit(f"rank {self.rank} did not finish exiting within {self.timeout:.0f} s of its failure")
            try:
                self._publish()
                if not peer_failures and self._store.add("failures", 0):
                    peer_failures, peer_failure_since = self._reported_failures(), now
                unreachable_since = None
            except Exception:  # noqa: BLE001
                unreachable_since = unreachable_since or now
                if self._failing:
                    continue
                if peer_failures:  # the rank hosting the store has gone after the failure it reported
                    self._exit(f"{peer_failures}; rank {self.rank} stopped waiting in {self.phase}")
                if now - unreachable_since > self.timeout / 2:
                    self._exit(f"the rendezvous store ({_store_address()}) has not answered for "
                               f"{now - unreachable_since:.0f} s: the rank or agent hosting it is gone; "
                               f"rank {self.rank} was in {self.phase}")
                continue
            # A peer failed. This rank's own collective usually fails soon after and reports; if it does not
            # (it waits on ranks that are fine, or computes), leave after a grace period.
            if peer_failures and not self._failing and now - peer_failure_since > self.exit_grace:
                self._exit(f"{peer_failures}; rank {self.rank} stopped waiting in {self.phase}")

    def _reported_failures(self) -> str:
        reports = []
        for rank in range(self.world_size):
            key = f"failure/{rank}"
            if self._store.check([key]):
                reports.append(self._store.get(key).decode())
        return "; ".join(reports) or "a rank reported a failure"

    def _exit(self, message: str) -> None:
        sys.stderr.write(f"[rank {self.rank}] lightning-par: {message}\n")
        sys.stderr.flush()
        os._exit(1)  # the main thread may be blocked in a collective that never returns


def heartbeat_interval(timeout: float) -> float:
    """Seconds between heartbeats for a process group of ``timeout`` seconds: a tenth of it, between 0.2 and 2."""
    return min(2.0, max(0.2, timeout / 10))


def stop_processes(processes: list[subprocess.Popen], *, grace: float) -> None:
    """Give ``processes`` (ranks this process launched) ``grace`` seconds to exit on their own, then kill the rest
    and reap them all. SIGKILL, since a rank blocked in a collective or stopped (SIGSTOP) acts on nothing else."""
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()


def is_communication_error(exception: BaseException) -> bool:
    """Whether ``exception`` (or one it was raised from) says a collective failed or a peer went away."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exception]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, dist.DistError) or any(marker in str(error).lower() for marker in _COMMUNICATION_ERRORS):
            return True
        pending += [error.__cause__, error.__context__]
        # DCP gathers every rank's exception of a failed save or load into one CheckpointException.
        failures = getattr(error, "failures", {}).values()  # {rank: (exception, traceback)}
        pending += [f[0] if isinstance(f, tuple) else f for f in failures]
    return False


def failed_collective() -> str | None:
    """The last collective this process issued that had not completed, from PyTorch's flight recorder:
    operation, process group and sequence number; None when the recorder is off or empty."""
    trace = flight_recorder_trace()
    entries = trace["entries"] if trace else []
    if not entries:
        return None
    pending = [entry for entry in entries if not entry.get("retired", True)]
    entry = (pending or entries)[-1]
    operation = entry["profiling_name"].split(":")[-1]
    group = entry["process_group"][1] or entry["process_group"][0]
    sequence = entry["p2p_seq_id"] if entry.get("is_p2p") else entry["collective_seq_id"]
    return f"{operation} on process group {group!r}, call #{sequence} there"


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
