"""Crash-consistent checkpoints under chaos: torchrun restarts the ranks after each SIGKILL, at every point of a step
where a cluster delivers one (tests/chaos_run.py; docs/checkpoints.md, "Exact resume"), and the run ends as an
uninterrupted one. torchrun's agent ends the other ranks of a failed attempt itself, so nothing here waits for a
timeout: the module runs beside others under pytest-xdist."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import chaos_run
import pytest
import torch
from installed import TORCHRUN

CHAOS_SCRIPT = Path(chaos_run.__file__)


# The chaos runs: per world size, the layouts trained in turn and the faults, one per attempt, in their order
# (layout:point:step, tests/chaos_run.py). Every point is hit, each layout twice, by a rank drawn with the
# world size as seed, except the replacement of last.ckpt, which rank 0 does. zero3 and dp2xtp2 keep only last.ckpt
# (save_top_k=0).
CHAOS = {
    2: ("data_parallel,zero3", [("data_parallel", "batch", 3), ("data_parallel", "on_save", 6),
                                ("zero3", "write", 4), ("zero3", "replace", 8)]),
    4: ("dp2xtp2", [("dp2xtp2", "replace", 4), ("dp2xtp2", "backward", 7)]),
}


def _torchrun(tmp_path: Path, world_size: int, layouts: str, plan: list[tuple[str, str, int]], out: str) -> None:
    ranks = random.Random(world_size)
    faults = ",".join(f"{layout}:{point}:{step}:{0 if point == 'replace' else ranks.randrange(world_size)}"
                      for layout, point, step in plan)
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", str(world_size),
               "--max-restarts", str(len(plan)), str(CHAOS_SCRIPT), "--dir", str(tmp_path / f"ckpt-{out}"),
               "--out", str(tmp_path / out), "--layouts", layouts, "--plan", faults]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, (faults, result.stderr[-3000:])


def _newest_save_at(point: str, step: int) -> int:
    """The step of the newest checkpoint complete when a rank is killed at ``point`` of ``step``: the step's own
    only once it has been written whole (the kill during its replacement of last.ckpt)."""
    return step if point == "replace" else (step - 1) // chaos_run.SAVE_EVERY * chaos_run.SAVE_EVERY


@pytest.mark.parametrize("world_size", sorted(CHAOS))
def test_chaos_kills_at_every_point_of_a_step_lose_nothing_and_resume_bitwise(tmp_path: Path, world_size: int) -> None:
    """torchrun restarts the ranks after each kill, with ``ckpt_path="auto"``; against an uninterrupted run of the same
    layouts: every attempt resumes at the newest checkpoint complete when the rank died, every step is trained, each
    time with the uninterrupted run's loss on every rank, bit for bit, and the final weights are its weights."""
    layouts, plan = CHAOS[world_size]
    _torchrun(tmp_path, world_size, layouts, [], "uninterrupted")
    _torchrun(tmp_path, world_size, layouts, plan, "chaos")
    for layout in layouts.split(","):
        resumes = {attempt + 1: _newest_save_at(point, step)
                   for attempt, (name, point, step) in enumerate(plan) if name == layout}
        for rank in range(world_size):
            reference = _records(tmp_path / "uninterrupted" / layout / f"rank{rank}.jsonl")
            expected = {record["step"]: record["loss"] for record in reference if "step" in record}
            records = _records(tmp_path / "chaos" / layout / f"rank{rank}.jsonl")
            starts = {record["attempt"]: record["start"] for record in records if "start" in record}
            first = min(starts)
            assert starts == {first: 0, **resumes}, (layout, rank, starts)
            trained = [(record["step"], record["loss"]) for record in records if "step" in record]
            assert {step for step, _ in trained} == set(expected) == set(range(1, chaos_run.STEPS + 1)), layout
            assert all(loss == expected[step] for step, loss in trained), (layout, rank, trained, expected)
            final = torch.load(tmp_path / "chaos" / layout / f"rank{rank}.pt")
            for name, tensor in torch.load(tmp_path / "uninterrupted" / layout / f"rank{rank}.pt").items():
                assert torch.equal(final[name], tensor), (layout, rank, name)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
