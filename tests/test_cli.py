"""The lightning-par command trains the shipped config and writes TensorBoard scalars."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]


CONFIGS = sorted(path.stem for path in (REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_trains_and_logs_to_tensorboard(tmp_path: Path, name: str) -> None:
    # The shipped config as it is, shortened: few steps, a small slice of the corpus.
    command = [
        sys.executable, "-m", "lightning_par.cli", "fit", "--config", str(REPO / "configs" / f"{name}.yaml"),
        "--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--data.init_args.max_bytes=300000",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    (run_dir,) = (tmp_path / "lightning_logs" / name).iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train_loss", "val_loss"} <= set(scalars), scalars
    train_loss = [event.value for event in events.Scalars("train_loss")]
    assert len(train_loss) == 6
    assert all(0.0 < value < 10.0 for value in train_loss)  # byte vocabulary: ln(256) = 5.5 at the start
    assert (run_dir / "checkpoints" / "epoch=0-step=6.ckpt" / "meta.pt").is_file()


def test_console_script_is_installed() -> None:
    result = subprocess.run(["lightning-par", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fit" in result.stdout and "validate" in result.stdout


def test_torchrun_launch_uses_the_torchelastic_environment(tmp_path: Path) -> None:
    """Lightning's cluster environments are used as they are: under torchrun, TorchElasticEnvironment."""
    torchrun = shutil.which("torchrun")
    assert torchrun is not None, "torchrun comes with torch"
    command = [
        torchrun, "--standalone", "--nproc_per_node=2", "-m", "lightning_par.cli", "fit",
        "--config", str(REPO / "configs" / "data_parallel.yaml"), "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--data.init_args.max_bytes=100000",
        "--trainer.callbacks+=cli_callbacks.RecordEnvironment",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RECORD_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, record in enumerate(records):
        assert record == {"environment": "TorchElasticEnvironment", "world_size": 2, "global_rank": rank,
                          "mesh": {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}}
