"""The multi-process harness (tests/harness.py) stops its ranks before pytest stops the test, so that a hang fails
with every rank's stack (pytest-timeout's own stop shows the test process only)."""

from __future__ import annotations

import re
import time

import pytest
from harness import run_distributed


def _sleep(rank: int, world_size: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


@pytest.mark.timeout(40)
def test_a_launch_stops_before_the_tests_deadline_with_the_ranks_stacks() -> None:
    with pytest.raises(TimeoutError, match="did not finish") as error:
        run_distributed(_sleep, 2, 300, timeout=35)  # below the test's timeout, but the deadline comes first
    # The launch was given what was left before the deadline less the margin for the stacks (40 - 30 s), not its 35 s:
    # read from the message, not the clock. (Without the stop, pytest itself ends the test at 40 s: it fails.)
    assert int(re.search(r"within (\d+) s", str(error.value)).group(1)) <= 10
    assert "_sleep" in str(error.value)  # the ranks' stacks, where each was


@pytest.mark.timeout(50)
def test_a_ranks_timeout_not_below_pytests_is_refused() -> None:
    with pytest.raises(ValueError, match="not below this test's pytest timeout of 50 s"):
        run_distributed(_sleep, 2, 0, timeout=50)
