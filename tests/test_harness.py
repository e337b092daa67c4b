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


def _group_without_rank_zero(rank: int, world_size: int) -> list[int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 0:
        return []  # done at once; its process hosts the rendezvous store the others still need
    time.sleep(2.0)  # the others make their group after rank 0 has reported
    group = dist.new_group([1, 2], use_local_synchronization=True) if rank in (1, 2) else None
    return dist.get_process_group_ranks(group) if group is not None else []


def test_a_rank_that_reports_first_keeps_the_store_up_for_the_others() -> None:
    """Rank 0's result does not end its process, and so the store, while other ranks still make process groups."""
    assert run_distributed(_group_without_rank_zero, 3) == [[], [1, 2], [1, 2]]
