"""The fast tier: the tests that day-to-day work runs (``pytest -m "not slow"``), chosen from a measured run.

    python -m pytest --durations=0 -p no:cacheprovider > full.log   # the whole suite, every test's time
    python tests/tiers.py full.log [later.log ...]                  # rewrites tests/slow_tests.txt

Every test's time (set-up, call and tear-down together) is read from the reports (a later report's time of a test
replaces an earlier one's); the quickest tests make the fast tier until their sum reaches ``--budget`` seconds, and
the others are listed in ``tests/slow_tests.txt``, which ``tests/conftest.py`` marks ``slow``. A module-scoped
fixture's set-up is counted on the first test that uses it: a module whose set-up was slow is listed whole, since
each of its tests run alone would pay it. A test the list does not name (written after the last measure) runs in
the fast tier until the list is made again. ``.ci/run`` runs every test, slow ones included.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
SLOW_LIST = HERE / "slow_tests.txt"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(tests/.+)$")


def durations(report: str) -> dict[str, dict[str, float]]:
    """``{test id: {phase: seconds}}`` from a ``--durations=0`` report (ids as pytest prints them)."""
    times: dict[str, dict[str, float]] = defaultdict(dict)
    for line in report.splitlines():
        if match := _DURATION.match(line.strip()):
            seconds, phase, test = match.groups()
            times[test][phase] = float(seconds)
    return dict(times)


def slow_tests(times: dict[str, dict[str, float]], budget: float, slow_setup: float = 5.0) -> list[str]:
    """The tests, and whole modules, left out of a fast tier of at most ``budget`` seconds (module docstring)."""
    slow = {test.split("::")[0] for test, phases in times.items() if phases.get("setup", 0.0) > slow_setup}
    spent = 0.0
    for test in sorted((test for test in times if test.split("::")[0] not in slow),
                       key=lambda test: sum(times[test].values())):
        spent += sum(times[test].values())
        if spent > budget:
            slow.add(test)
    return sorted(slow)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", type=Path, nargs="+", help="outputs of `python -m pytest --durations=0`")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds of test time in the fast tier (the "
                        "rest of its 300 s goes to collecting and importing)")
    args = parser.parse_args()
    times: dict[str, dict[str, float]] = {}
    for report in args.reports:
        times.update(durations(report.read_text()))
    slow = slow_tests(times, args.budget)
    SLOW_LIST.write_text("".join(f"{test}\n" for test in slow))
    fast = sum(sum(phases.values()) for test, phases in times.items()
               if test not in slow and test.split("::")[0] not in slow)
    print(f"{len(times) - len(slow)} tests in the fast tier ({fast:.0f} s measured), {len(slow)} slow: {SLOW_LIST}")


if __name__ == "__main__":
    main()
