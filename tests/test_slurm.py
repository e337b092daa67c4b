"""A two-node hybrid job on a real SLURM cluster (this machine, two slurmd daemons), preempted and requeued.

The job is ``examples/slurm/train.sbatch`` as a user would submit it, running ``configs/hybrid3d.yaml`` with
tensor parallel inside each node and pipeline parallel across the two. Mid-training the test sends the job
SLURM's warning signal (``scancel --signal=USR1``, what ``--signal=SIGUSR1@90`` sends before the time limit):
every rank saves ``hpc_ckpt_1.ckpt`` at the end of a batch, rank 0 runs ``scontrol requeue``, SLURM starts
the job again, and the new run resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import ClusterUnavailable, cluster, job_state

REPO = Path(__file__).resolve().parents[1]
STEPS = 12


@pytest.fixture(scope="module")
def slurm():
    try:
        with cluster() as env:
            yield env
    except ClusterUnavailable as reason:
        pytest.skip(str(reason))


def _wait(predicate, seconds: float, what: str, report) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {seconds:.0f} s\n{report()}")


def test_two_node_hybrid_job_is_requeued_and_resumes(slurm: dict[str, str], tmp_path: Path) -> None:
    env = {**slurm, "MASTER_ADDR": "127.0.0.1", "PYTHONWARNINGS": "ignore", "RECORD_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    command = [
        "sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", f"--chdir={tmp_path}",
        str(REPO / "examples" / "slurm" / "train.sbatch"), str(REPO / "configs" / "hybrid3d.yaml"),
        "--trainer.strategy.init_args.data_parallel_size=1", f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--data.init_args.max_bytes=100000",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.callbacks+=cli_callbacks.RecordEnvironment",
        "--trainer.callbacks+=cli_callbacks.MarkSteps",
    ]
    submitted = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    output = tmp_path / f"lightning-par-{job}.out"

    def report() -> str:
        return f"{job_state(job, slurm)}\n{output.read_text()[-5000:] if output.exists() else '(no output)'}"

    step = tmp_path / "step"
    _wait(lambda: step.exists() and int(step.read_text() or 0) >= 3, 120, "training did not reach step 3", report)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)
    _wait(lambda: job_state(job, slurm).get("Restarts") == "1", 60, "the job was not requeued", report)
    _wait(lambda: f"job {job} restart 1" in output.read_text(), 120, "the requeued job did not start", report)
    # COMPLETING: the batch script has ended and SLURM is cleaning up its nodes; the exit code is final.
    finished = ("COMPLETING", "COMPLETED", "FAILED", "CANCELLED")
    _wait(lambda: job_state(job, slurm).get("JobState") in finished, 180, "the requeued job did not finish", report)

    state, log = job_state(job, slurm), output.read_text()
    assert state["JobState"] in ("COMPLETING", "COMPLETED") and state["ExitCode"] == "0:0", report()
    assert (tmp_path / "hpc_ckpt_1.ckpt" / "meta.pt").is_file()
    assert f"job {job} restart 1: 2 nodes x 2 tasks" in log
    assert f"Restored all states from the checkpoint at {tmp_path / 'hpc_ckpt_1.ckpt'}" in log, report()
    assert int(step.read_text()) == STEPS
    environment = (tmp_path / "rank3.json").read_text()
    assert '"environment": "SLURMEnvironment"' in environment and '"world_size": 4' in environment
    assert '"tp": 2' in environment and '"pp": 2' in environment
    _assert_monitoring(sorted((tmp_path / "lightning_logs" / "hybrid3d").iterdir())[-1])


def _assert_monitoring(run: Path) -> None:
    """The requeued run's TensorBoard scalars: what a tp x pp layout across two nodes moves and idles."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()

    def values(tag: str) -> list[float]:
        return [event.value for event in events.Scalars(tag)]

    assert all(value > 0 for value in values("comm/tp_bytes"))  # sequence-parallel gathers and scatters
    # Stage 0 sends 4 micro-batches x (2, 64, 128) fp32 sequence slices per step (rank 0's slice of 128 tokens).
    assert all(4 * 2 * 64 * 128 * 4 <= sent <= 4 * 2 * 64 * 128 * 4 + 64 for sent in values("comm/pp_bytes"))
    assert all(0.0 < fraction < 1.0 for fraction in values("pipeline/bubble_fraction_max"))
    assert all(0.0 < mfu < 1.0 for mfu in values("perf/mfu"))
    assert "layout/text_summary" in events.Tags()["tensors"]
