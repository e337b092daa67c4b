"""Checkpoints, runs and prepared data on an object store (``s3://``), against a real S3 server on loopback
(tests/s3_server.py): the same guarantees as local disk (lightning_par/checkpoint/object_store.py)."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from harness import run_distributed
from installed import PYTHON, require
from s3_server import create_bucket, objects
from test_checkpoint import Payload, _fit, _resumes_bitwise

from lightning_par.checkpoint import format as ckpt
from lightning_par.checkpoint.atomic import STAGING_DIR, clear_staging, interrupted_replacements, staging_path
from lightning_par.checkpoint.object_store import DCP_INDEX, location

require("s3fs")  # the test extra's: missing, the module fails
require("upath")

RESHARD_RTOL = 1e-5
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_sharded_checkpoints_on_s3_resume_exactly_and_reshard(bucket: str) -> None:
    """dp2 x tp2 x pp2 with sequence parallel (dense Llama, 8 ranks) saves to and resumes from s3:// bit for bit, and
    the same checkpoint continues under ZeRO-3 on 2 ranks (resharded: tensor-parallel shards and pipeline stages
    become ZeRO-3 shards) within 1e-5. Nothing staged is left behind."""
    uninterrupted, epoch0 = _resumes_bitwise(bucket, 8, ("hybrid3d", True))
    assert objects(f"{bucket}/a") == sorted(
        f"{name}/{file}" for name in ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt")
        for file in (DCP_INDEX, *(f"__{rank}_0.distcp" for rank in range(8)), "meta.pt"))
    elsewhere = run_distributed(_fit, 2, f"{bucket}/c", ("zero3", True), 1, epoch0)[0]
    assert elsewhere["losses"] == pytest.approx(uninterrupted["losses"][4:], rel=RESHARD_RTOL)
    for name, tensor in uninterrupted["state"].items():
        torch.testing.assert_close(elsewhere["state"][name], tensor, rtol=RESHARD_RTOL, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "world_size", "epoch_steps", "async_save"),
                         [("ep2-zero3", 4, 2, True), ("zero1", 2, 4, False)], ids=["zero3-moe-async", "zero1-full"])
def test_checkpoints_on_s3_resume_exactly(bucket: str, layout: str, world_size: int, epoch_steps: int,
                                          async_save: bool) -> None:
    """ZeRO-3 over experts split ep=2 (mixture of experts), saving in the background; and the full format (one file
    from rank 0) under ZeRO-1: both resume from s3:// bit for bit."""
    _resumes_bitwise(bucket, world_size, (layout, layout != "zero1"), epoch_steps=epoch_steps, async_save=async_save)
    if layout == "zero1":
        assert objects(f"{bucket}/a") == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]


def _save(url: str, step: int) -> None:
    """A sharded checkpoint of ``step`` at ``url``, written by this one process."""
    weights = {"weight": torch.full((4, 4), float(step))}
    ckpt.save_checkpoint({"state_dict": weights, "global_step": step}, url, sharded=True)


def test_a_commit_cut_short_on_s3_leaves_the_whole_staged_copy_which_auto_takes(
        bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An object store has no rename: a checkpoint replacing another is copied in, its index last, after the old
    copy's index is gone. Killed between the two, the name holds no whole checkpoint and the staged copy is whole:
    ``ckpt_path="auto"`` finds it (interrupted_replacements), the next save of the name finishes the commit first, and
    a copy staged without its index (a save cut off while writing) is never taken."""
    folder = location(f"{bucket}/checkpoints")
    last = folder / "last.ckpt"
    _save(str(last), 3)
    assert ckpt.checkpoint_problem(last) is None and interrupted_replacements(folder) == []

    store, real_copy = last.fs, last.fs.copy  # fsspec keeps one filesystem object per store and options

    def killed_before_the_index(source, destination, *args, **kwargs):
        if destination.endswith(DCP_INDEX):
            raise KeyboardInterrupt("killed")  # as a kill would: nothing after it runs
        return real_copy(source, destination, *args, **kwargs)

    monkeypatch.setattr(store, "copy", killed_before_the_index)
    with pytest.raises(KeyboardInterrupt):
        _save(str(last), 6)
    monkeypatch.setattr(store, "copy", real_copy)
    assert "it has no .metadata" in ckpt.checkpoint_problem(last)  # never loaded
    staged = staging_path(last)
    assert [str(path) for path in interrupted_replacements(folder)] == [str(staged)]
    assert ckpt.read_metadata(staged / ckpt.META_FILE)["global_step"] == 6

    clear_staging(last)  # what the next save of last.ckpt does first
    assert ckpt.read_metadata(last / ckpt.META_FILE)["global_step"] == 6
    exported = ckpt.export_consolidated(str(last), tmp_path / "model.pt")  # lightning-par-export's work
    assert torch.equal(exported["weight"], torch.full((4, 4), 6.0))
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["weight"], exported["weight"])
    assert not any(name.startswith(STAGING_DIR) for name in objects(str(folder)))

    # A save cut off while it wrote: staged without its index, passed over and removed by the next save.
    half = folder / STAGING_DIR / "epoch=2-step=9.ckpt"
    (half / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert interrupted_replacements(folder) == []
    clear_staging(folder / "epoch=2-step=9.ckpt")
    assert objects(str(folder)) == sorted(f"last.ckpt/{name}" for name in (DCP_INDEX, "__0_0.distcp", "meta.pt"))


def _saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_checkpoints_on_s3_carrying_pickled_code_are_refused(bucket: str, tmp_path: Path) -> None:
    """A full checkpoint, and a sharded checkpoint's meta.pt, holding an object whose unpickling writes a file: both
    refused as on disk, the file never written; ``weights_only=False`` is the only way to load such a file."""
    marker = tmp_path / "payload-ran"
    full = location(f"{bucket}/full.ckpt")
    full.write_bytes(_saved({"state_dict": {}, "payload": Payload(str(marker))}))
    sharded = location(f"{bucket}/sharded.ckpt")
    _save(str(sharded), 1)
    (sharded / ckpt.META_FILE).write_bytes(_saved({"global_step": 1, "payload": Payload(str(marker))}))
    for path in (full, sharded):
        problem = ckpt.checkpoint_problem(path)
        assert problem is not None and "which can run code: it was not loaded" in problem, problem
    assert not marker.exists()
    ckpt.read_metadata(full, weights_only=False)  # trusted: it runs
    assert marker.read_text() == "the payload ran"


@pytest.mark.slow
def test_the_s3_config_logs_saves_and_resumes_on_the_store(s3: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """``lightning-par fit --config configs/zero3_async_s3.yaml --ckpt_path auto`` against the S3 server, shortened:
    the event file, hyper-parameters and checkpoints (written in the background) land in its bucket; the same
    command again resumes from the newest checkpoint of the first start, in another version's directory."""
    for name, value in s3.items():  # here and in the command
        monkeypatch.setenv(name, value)
    config = yaml.safe_load((REPO / "configs" / "zero3_async_s3.yaml").read_text())
    root = config["trainer"]["default_root_dir"]
    create_bucket(root.removeprefix("s3://").partition("/")[0])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [PYTHON, "-m", "lightning_par.cli", "fit", "--config", str(REPO / "configs" / "zero3_async_s3.yaml"),
               "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
               "--data.init_args.max_bytes=100000", "--ckpt_path", "auto"]
    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run = f"{config['trainer']['logger']['init_args']['name']}"
    saved = objects(root)
    assert any(name.startswith(f"{run}/version_0/events.out.tfevents.") for name in saved), saved
    assert f"{run}/version_0/hparams.yaml" in saved
    assert f"{run}/version_0/checkpoints/epoch=0-step=4.ckpt/.metadata" in saved
    assert f"{run}/version_0/checkpoints/last.ckpt/.metadata" in saved
    assert not any(STAGING_DIR in name for name in saved), saved
    command[command.index("--trainer.max_steps=4")] = "--trainer.max_steps=6"
    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f'ckpt_path="auto": resuming from {root}/{run}/version_0/checkpoints/' in second.stdout + second.stderr
    assert f"{run}/version_1/checkpoints/epoch=0-step=6.ckpt/.metadata" in objects(root)


def test_prepare_writes_shards_to_s3_that_stream_as_local_ones_do(bucket: str, tmp_path: Path) -> None:
    """``prepare(output="s3://...")`` (``lightning-par prepare --output``) writes its shards to the store, the same
    shards it writes to local disk; ``StreamingTokenDataModule(data_dir="s3://...")`` streams them, batch for batch
    what it streams from the local copy."""
    from lightning_par.data import StreamingTokenDataModule
    from lightning_par.data.prepare import prepare

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 7 + 1) + "\n\n"
                              for i in range(120)))
    options = {"val_fraction": 0.1, "num_workers": 1, "chunk_bytes": "2KB", "verbose": False}
    local = prepare(str(corpus), str(tmp_path / "prepared"), "bytes", **options)
    remote = prepare(str(corpus), f"{bucket}/prepared", "bytes", **options)
    assert remote.tokens == local.tokens
    shards = objects(f"{bucket}/prepared")
    assert "prepared.json" in shards and "train/index.json" in shards and "val/index.json" in shards
    assert sorted(name for name in shards if name.endswith(".bin")) == sorted(
        str(path.relative_to(tmp_path / "prepared")) for path in (tmp_path / "prepared").rglob("*.bin"))

    def batches(data_dir: str, cache: str) -> list[torch.Tensor]:
        data = StreamingTokenDataModule(data_dir, seq_len=32, batch_size=4, cache_dir=str(tmp_path / cache))
        data.setup("fit")
        return list(data.train_dataloader())

    streamed, read = batches(f"{bucket}/prepared", "cache"), batches(str(tmp_path / "prepared"), "unused")
    assert len(streamed) == len(read) > 0
    for remote_batch, local_batch in zip(streamed, read):
        assert torch.equal(remote_batch, local_batch)
