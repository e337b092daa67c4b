"""Runs of ``resilience_run.py``: one process per rank started here (as srun or a node's launcher would start
them), or one command that starts the ranks itself (Lightning's subprocess launcher, torchrun)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch
from harness import free_port
from installed import PYTHON

SCRIPT = Path(__file__).with_name("resilience_run.py")
WORLD_SIZE = 2


def launch(directory: Path, out: Path, *args: str, slurm: bool = False, wait: float = 150.0,
           extra_env: dict[str, str] | None = None) -> list[dict]:
    """Start one process per rank; return each rank's exit code, stderr and seconds to exit."""
    port = str(free_port())
    procs = []
    start = time.monotonic()
    for rank in range(WORLD_SIZE):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        if slurm:  # what srun sets for task `rank` of a one-node, two-task job
            env.update(SLURM_NTASKS=str(WORLD_SIZE), SLURM_NTASKS_PER_NODE=str(WORLD_SIZE), SLURM_PROCID=str(rank),
                       SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="train",
                       SLURM_NODELIST="localhost")
        else:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), NODE_RANK="0")
        env.update(extra_env or {})
        command = [PYTHON, str(SCRIPT), "--dir", str(directory), "--out", str(out), *args]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, proc in enumerate(procs):
        try:
            _, stderr = proc.communicate(timeout=max(1.0, wait - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(f"rank {rank} did not exit within {wait:.0f} s") from None
        results.append({"code": proc.returncode, "stderr": stderr, "seconds": time.monotonic() - start,
                        "after_fault": after_fault(out)})
    return results


def outcome(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def launch_command(out: Path, command: list[str], wait: float = 150.0) -> dict:
    """Run one command that starts every rank; return its exit code, output and seconds to return, and the
    process ids of the ranks (``pid<N>`` files) still running when it returned."""
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=wait)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{command} did not return within {wait:.0f} s") from None
    seconds = time.monotonic() - start
    pids = [int(f.read_text()) for f in sorted(out.glob("pid*"))]
    return {"code": result.returncode, "output": result.stdout + result.stderr, "seconds": seconds, "pids": pids,
            "running": [pid for pid in pids if _running(pid)], "after_fault": after_fault(out)}


def after_fault(out: Path) -> float | None:
    """Seconds from the fault the run injected (``fault`` in ``out``) to now; None without one."""
    fault = out / "fault"
    return time.time() - float(fault.read_text()) if fault.is_file() else None


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
