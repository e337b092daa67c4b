"""The fast tier is chosen from a measured run (tests/tiers.py)."""

from __future__ import annotations

from tiers import durations, slow_tests

REPORT = """============================= slowest durations =============================
40.00s setup    tests/test_cli.py::test_shipped[zero1]
3.00s call     tests/test_cli.py::test_shipped[zero1]
0.50s call     tests/test_cli.py::test_help
9.00s call     tests/test_harness.py::test_launch
1.00s call     tests/test_harness.py::test_two
0.20s setup    tests/test_harness.py::test_two
2.00s call     tests/test_bad_inputs.py::test_named_value[a shard file cut short]
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_phases_are_read_per_test_with_spaces_in_their_ids() -> None:
    times = durations(REPORT)
    assert times["tests/test_cli.py::test_shipped[zero1]"] == {"setup": 40.0, "call": 3.0}
    assert times["tests/test_bad_inputs.py::test_named_value[a shard file cut short]"] == {"call": 2.0}


def test_the_quickest_tests_fill_the_budget_and_a_slow_fixtures_module_is_slow() -> None:
    slow = slow_tests(durations(REPORT), budget=3.5)
    # test_cli's module fixture took 40 s: every test of the module would pay it alone
    assert slow == ["tests/test_cli.py", "tests/test_harness.py::test_launch"]
