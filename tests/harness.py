"""Multi-process test harness: N CPU ranks with gloo on a free port.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes, gives them the launching test's
environment with what a launcher sets (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK), calls
``fn(rank, world_size, *args)`` in each and returns the per-rank results in rank order. The processes fork from a
server that has imported torch, Lightning and lightning_par once (multiprocessing's forkserver with preloaded
modules): importing them takes about 5 s of CPU per process, which on 2 cores was most of the suite's time.
Nothing else is shared: no process group, no state of a run. Starting the ranks of a case costs 0.03 s for 2
ranks and 0.1 s for 8 (0.07-0.2 s with a process group; measured on 2 cores), so ranks are not kept between
cases: each case gets fresh ones, and no case can see what another left behind. A rank's exception fails the test
with every failing rank's traceback; a rank that does not finish within ``timeout`` seconds fails it too, with
the stack of every thread of every rank still running (dumped by ``faulthandler`` on SIGUSR2) before all are
killed, so a hang costs one test, not the CI run, and says where each rank was.

Inside a rank, Lightning sees ``LOCAL_RANK`` and treats the process as launched externally (exactly what
its own subprocess launcher does), so ``Trainer(devices=world_size)`` joins the group instead of
starting processes.
"""

from __future__ import annotations

import faulthandler
import io
import itertools
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch


_NEXT_PORT = itertools.count()
_LOWEST_PORT = 20000


def _outgoing_ports_start() -> int:
    """The first port of the range the system gives out for outgoing connections and port 0."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port for a rendezvous that no other process is handed before the ranks listen on it: below the range the
    system gives out for outgoing connections and port 0 (``ip_local_port_range``), where a port asked for with 0
    could meanwhile become a gloo connection's local port in the other pytest-xdist worker's ranks; in a stretch of
    its own for each worker, taken in turn (a port just closed may wait in TIME_WAIT)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    span = (_outgoing_ports_start() - _LOWEST_PORT) // 8
    for _ in range(max(span, 0)):
        port = _LOWEST_PORT + worker % 8 * span + next(_NEXT_PORT) % span
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no stretch below that range: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # tensors travel as bytes: no shared-memory handles outliving the child
    return buffer.getvalue()


# Imported once in the server the ranks fork from (what every rank needs, and what takes long to import).
PRELOADED = ["torch", "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.distributed.tensor",
             "lightning", "lightning.pytorch", "lightning_par", "lightning_par.strategies", "lightning_par.callbacks",
             "lightning_par.models", "lightning_par.data", "parity",
             # What the Hugging Face cases import at their first model (about 3 s a rank): Llama's modules, which
             # the other families share, peft and datasets. Left out where they are not installed.
             "transformers.models.llama.modeling_llama", "peft", "datasets", "lightning_par.models.hf",
             "lightning_par.data.text_datamodule"]


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # read when the server starts: at the first launch
    return context


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, results: Any, released: Any,
               stacks: str, environment: dict[str, str], args: tuple, kwargs: dict) -> None:
    # Where this rank writes the stack of each of its threads when the harness gives up waiting for it, or when
    # the process dies of a signal (an abort in C++ leaves no Python traceback otherwise).
    stack_file = open(stacks, "w")  # noqa: SIM115 - kept open for the life of the rank
    faulthandler.register(signal.SIGUSR2, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)
    # The launching test's environment, not the fork server's (a copy of the one an earlier test started it in).
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    # Lightning reads the rank from the environment when it is imported; the server imported it with none.
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

    rank_zero_only.rank = utilities_rank_zero_only.rank = rank
    torch.set_num_threads(1)  # N ranks share 2 cores: oversubscription would only slow every rank
    try:
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", _serialize(value)))
    except BaseException:  # noqa: BLE001 - the traceback is the point
        results.put((rank, "error", traceback.format_exc()))
    # Rank 0 hosts the rendezvous store: had it exited on its result, ranks still making process groups of their own
    # (which rank 0 is not in) would lose the store ("Connection was likely closed"). Every rank waits for the others.
    released.wait(timeout=60)


class RanksKilledBySignal(AssertionError):
    """Ranks died of a signal (a crash in native code: SIGSEGV, SIGABRT) without reporting a result."""


# When pytest-timeout stops the running test (set by tests/conftest.py): the harness stops its ranks before, so that a
# hang fails with every rank's stack instead of pytest's bare timeout.
TEST_LIMIT: float | None = None
TEST_DEADLINE: float | None = None
_STACKS_MARGIN = 30.0  # seconds kept before pytest's deadline to dump the ranks' stacks and stop them


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return results by rank.

    ``timeout`` must lie below the test's own pytest timeout (``ValueError`` otherwise); a launch also stops short of
    the test's deadline, whatever time earlier launches of the test took.

    A launch whose ranks die of a signal runs once more. Such deaths come from native code (torch 2.13's gloo and
    DTensor on 2 loaded cores: a SIGSEGV or SIGABRT in about one full suite run in three, at a different case each
    time, never twice in a row); the code under test raises Python errors, which fail at once. A second death fails
    the test with both reports."""
    if TEST_LIMIT is not None and timeout >= TEST_LIMIT:
        raise ValueError(f"the ranks' timeout of {timeout:.0f} s is not below this test's pytest timeout of "
                         f"{TEST_LIMIT:.0f} s: lower it, or raise the test's with @pytest.mark.timeout")
    try:
        return _launch(fn, world_size, args, kwargs, timeout)
    except RanksKilledBySignal as first:
        print(f"harness: ranks of {getattr(fn, '__name__', fn)} died of a signal; launching once more:{first}",
              file=sys.stderr)
        try:
            return _launch(fn, world_size, args, kwargs, timeout)
        except RanksKilledBySignal as second:
            raise AssertionError(f"{second}\n(the launch before died too:{first})") from None


def _launch(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    released = ctx.Event()  # set once every rank has reported: then they may exit
    port = free_port()
    stacks = tempfile.mkdtemp(prefix="lightning_par-ranks-")
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, results, released, f"{stacks}/{rank}",
                                                  dict(os.environ), args, kwargs), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    if TEST_DEADLINE is not None and TEST_DEADLINE - _STACKS_MARGIN < deadline:
        deadline = TEST_DEADLINE - _STACKS_MARGIN
        timeout = max(deadline - time.monotonic(), 0.0)
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                errors = _format_errors(outcomes)
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s{errors}"
                                   f"{_stacks_of(procs, missing, stacks)}")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
                outcomes[rank] = (status, payload)
                if status == "error":
                    # Give the other ranks a moment to report their own failure, then stop.
                    _drain(results, outcomes, world_size, seconds=3.0)
                    raise AssertionError(_format_errors(outcomes))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    _drain(results, outcomes, world_size, seconds=2.0)
                    codes = {r: procs[r].exitcode for r in dead}
                    signalled = all(code < 0 for code in codes.values()) and not _format_errors(outcomes)
                    raise (RanksKilledBySignal if signalled else AssertionError)(
                        f"ranks died without a result (exit codes {codes}){_format_errors(outcomes)}"
                        f"{_stacks_of(procs, dead, stacks)}")
    finally:
        released.set()
        for rank, proc in enumerate(procs):
            if rank not in outcomes and proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for path in Path(stacks).iterdir():
            path.unlink()
        Path(stacks).rmdir()
    return [torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False) for rank in range(world_size)]


def _drain(results: Any, outcomes: dict, world_size: int, *, seconds: float) -> None:
    end = time.monotonic() + seconds
    while len(outcomes) < world_size and time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=0.2)
            outcomes[rank] = (status, payload)
        except queue.Empty:
            pass


def _format_errors(outcomes: dict[int, tuple[str, Any]]) -> str:
    failed = {rank: payload for rank, (status, payload) in sorted(outcomes.items()) if status == "error"}
    return "".join(f"\n--- rank {rank} ---\n{tb}" for rank, tb in failed.items())


def _stacks_of(procs: list[Any], ranks: list[int], folder: str) -> str:
    """Where each of ``ranks`` is or died: every thread's stack, which each rank writes on SIGUSR2 or a fatal signal."""
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR2)
    time.sleep(1.0)
    state = {rank: "still running" if procs[rank].is_alive() else f"exit code {procs[rank].exitcode}" for rank in ranks}
    return "".join(f"\n--- rank {rank}, {state[rank]} ---\n{Path(folder, str(rank)).read_text()}" for rank in ranks
                   if Path(folder, str(rank)).exists())
