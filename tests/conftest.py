"""Every test runs in a directory of its own, so that what a run writes where it stands (Lightning's
``checkpoints/`` and ``lightning_logs/`` when a test gives no ``default_root_dir``) never lands in the repository.
Ranks a test starts inherit it. Every test also leaves the environment and the thread settings as it found them, and
the ranks it starts stop before its pytest timeout.

The suite can run on two pytest-xdist workers (``-n 2``), which overlap one test's waiting (a process starting, a
timeout running out, a single-threaded reference) with another's computing. The tests of the modules of SERIAL, and
those marked ``alone``, bound how long a healthy rank may take (a collective's or a heartbeat's timeout of a few
seconds): each runs alone, with the other worker waiting (``_alone_if_timed``)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from s3_server import bucket, s3  # noqa: F401 - fixtures of the object-store tests


@pytest.fixture(autouse=True)
def _in_a_directory_of_its_own(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """Restore the environment and torch's thread count after each test. Code a test runs in this process leaves
    variables that change what later tests' ranks do: Lightning's ``seed_everything`` leaves ``PL_GLOBAL_SEED``, which
    Lightning's strategies reseed from when the processes start (a meta-device model then draws other weights than
    its one-process reference); its launcher leaves ``OMP_NUM_THREADS`` (with ``OMP_NUM_THREADS=2`` left by a
    one-process run, test_verify's 8 ranks on 2 cores took 125 s instead of 47)."""
    environment, threads = dict(os.environ), torch.get_num_threads()
    yield
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _ranks_stop_before_pytest_does(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tell the harness this test's pytest timeout (tests/harness.py stops its ranks before it, with their stacks)."""
    import harness

    try:
        from pytest_timeout import _get_item_settings
        limit = _get_item_settings(request.node).timeout
    except (ImportError, AttributeError):  # pytest-timeout absent or changed: no deadline to keep
        limit = None
    harness.TEST_LIMIT = limit or None
    harness.TEST_DEADLINE = time.monotonic() + limit if limit else None
    yield
    harness.TEST_LIMIT = harness.TEST_DEADLINE = None


# Modules whose tests assert that something happens within a timeout tuned for an otherwise idle machine (a test
# elsewhere says so with @pytest.mark.alone).
SERIAL = ("tests/test_faults.py", "tests/test_fault_tolerance.py", "tests/test_slurm.py")


@pytest.fixture(autouse=True)
def _alone_if_timed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, a test of SERIAL or marked ``alone`` holds a lock the other tests share: it waits for the
    running test of the other worker to end, and the other worker waits for it. A turnstile taken first keeps the
    shared holders from starving it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the run's directory, common to its workers
    alone = request.node.nodeid.split("::")[0] in SERIAL or request.node.get_closest_marker("alone") is not None
    with open(shared / "serial.turnstile", "a") as turnstile, open(shared / "serial.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


_WARM_SERVER = pytest.StashKey[subprocess.Popen]()


def pytest_configure(config: pytest.Config) -> None:
    """Start the warm server (tests/warm_server.py) for the commands the tests start through ``installed.PYTHON``; the
    controller of a pytest-xdist run starts none (its workers do)."""
    os.environ["LIGHTNING_PAR_TEST_PYTHON"] = sys.executable  # the cold interpreter, for tests/warm/python
    if getattr(config, "workerinput", None) is None and getattr(config.option, "numprocesses", None):
        return
    directory = Path(tempfile.mkdtemp(prefix="lightning-par-warm-"))
    os.environ["LIGHTNING_PAR_WARM_SOCKET"] = str(directory / "socket")
    with open(directory / "server.log", "w") as log:
        config.stash[_WARM_SERVER] = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("warm_server.py")), str(directory / "socket")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    server = config.stash.get(_WARM_SERVER, None)
    if server is not None:
        server.kill()
        server.wait()
        shutil.rmtree(Path(server.args[-1]).parent, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` the tests and modules tests/slow_tests.txt lists (made by tests/tiers.py from a measured run): the
    fast tier for day-to-day work is ``pytest -m "not slow"``."""
    listed = Path(__file__).with_name("slow_tests.txt")
    slow = set(listed.read_text().splitlines()) if listed.is_file() else set()
    for item in items:
        if item.nodeid in slow or item.nodeid.split("::")[0] in slow:
            item.add_marker(pytest.mark.slow)
