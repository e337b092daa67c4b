"""Every test runs in a directory of its own, so that what a run writes where it stands (Lightning's
``checkpoints/`` and ``lightning_logs/`` when a test gives no ``default_root_dir``) never lands in the repository.
Ranks a test starts inherit it. Every test also leaves the thread settings as it found them, and the ranks it starts
stop before its pytest timeout."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _in_a_directory_of_its_own(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _threads_as_they_were() -> Iterator[None]:
    """Lightning's launcher sets ``OMP_NUM_THREADS`` (and torch's thread count) in the process that starts the ranks.
    A test running a command in this process would leave it to every later test, whose rank processes inherit it: with
    ``OMP_NUM_THREADS=2`` left by a one-process run, test_verify's 8 ranks on 2 cores took 125 s instead of 47."""
    variable, threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    yield
    if variable is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = variable
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` the tests and modules tests/slow_tests.txt lists (made by tests/tiers.py from a measured run): the
    fast tier for day-to-day work is ``pytest -m "not slow"``."""
    listed = Path(__file__).with_name("slow_tests.txt")
    slow = set(listed.read_text().splitlines()) if listed.is_file() else set()
    for item in items:
        if item.nodeid in slow or item.nodeid.split("::")[0] in slow:
            item.add_marker(pytest.mark.slow)
