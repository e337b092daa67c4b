"""Checkpoints of the base strategy: sharded (DCP directory) and full (one file), atomic, exact resume."""

from __future__ import annotations

import functools
import os
import re
import shutil
from pathlib import Path

import lightning
import pytest
import torch
from harness import run_distributed
from parity import RecordLoss
from installed import PYTHON

from lightning_par.checkpoint.format import STAGING_DIR, export_consolidated, is_sharded_checkpoint
from lightning_par.data import TokenDataModule
from lightning_par.models import LlamaLM

# AdamW on purpose: its moments must come back for the resumed run to match.
make_module = functools.partial(LlamaLM, vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                learning_rate=1e-2, warmup_steps=2, max_steps=8)
make_moe_module = functools.partial(make_module, moe_experts=4, moe_top_k=2)
# 16 samples / (batch 2 x 2 ranks) = 4 optimizer steps per epoch.
make_datamodule = functools.partial(TokenDataModule, source="synthetic", vocab_size=64, seq_len=16, batch_size=2,
                                    num_samples=16, num_val_samples=8)


def make_strategy(name: str = "data_parallel", sharded: bool = True, **checkpointing):
    """The layout ``name``; ``checkpointing``: more of the base strategy's checkpoint arguments (``async_save``)."""
    from lightning_par import (
        DataParallelStrategy,
        Hybrid3DStrategy,
        PipelineParallelStrategy,
        ContextParallelStrategy,
        TensorParallelStrategy,
        ZeroStrategy,
    )

    if name == "data_parallel":
        return DataParallelStrategy(save_distributed_checkpoint=sharded, **checkpointing)
    if name == "tensor_parallel":
        return TensorParallelStrategy(tensor_parallel_size=2, save_distributed_checkpoint=sharded, **checkpointing)
    if name == "pipeline_parallel":
        return PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, **checkpointing)
    if name == "hybrid3d":  # dp2 x tp2 x pp2 on 8 ranks
        return Hybrid3DStrategy(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2,
                                sequence_parallel=True, microbatches=2, **checkpointing)
    if name.startswith("pp2xdp2-zero"):  # 4 ranks: ZeRO over the data-parallel ranks of each pipeline stage
        return Hybrid3DStrategy(data_parallel_size=2, pipeline_parallel_size=2, zero_stage=int(name[-1]),
                                microbatches=2, **checkpointing)
    if name.startswith("dp2xtp2-zero"):  # 4 ranks: ZeRO-1 over tensor-parallel shards, or FSDP2 over them
        return Hybrid3DStrategy(data_parallel_size=2, tensor_parallel_size=2, zero_stage=int(name[-1]),
                                save_distributed_checkpoint=sharded, **checkpointing)
    if name.startswith("ep2-zero"):  # experts split over 2 ranks, sharded or partitioned over those holding them
        return Hybrid3DStrategy(expert_parallel_size=2, zero_stage=int(name[-1]), save_distributed_checkpoint=sharded, **checkpointing)
    if name == "ep4":
        return Hybrid3DStrategy(expert_parallel_size=4, save_distributed_checkpoint=sharded, **checkpointing)
    if name == "context_parallel":
        return ContextParallelStrategy(context_parallel_size=2, context_parallel_method="ring",
                                       save_distributed_checkpoint=sharded, **checkpointing)
    return ZeroStrategy(zero_stage=int(name[-1]), save_distributed_checkpoint=sharded, **checkpointing)


def _fit(rank: int, world_size: int, directory: str, strategy: str | tuple, seed: int, ckpt_path: str | None,
         max_epochs: int = 2, asynchronous: bool = False, optimizer: str = "adamw", async_save: bool = False,
         save_last: bool = True) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    name, sharded = strategy if isinstance(strategy, tuple) else ("data_parallel", strategy)
    torch.manual_seed(seed)
    recorder = RecordLoss()
    checkpoints = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1, save_last=save_last)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=world_size, strategy=make_strategy(name, sharded, async_save=async_save),
        max_epochs=max_epochs, callbacks=[recorder, checkpoints], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        plugins=[AsyncCheckpointIO()] if asynchronous else None,
    )
    module = (make_moe_module if name.startswith("ep") else make_module)(optimizer=optimizer)
    trainer.fit(module, datamodule=make_datamodule(), ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "state": trainer.strategy.consolidated_state_dict(),
            "step": trainer.global_step}


@pytest.mark.parametrize(("sharded", "asynchronous"), [(False, False), (True, False), (True, True)],
                         ids=["full", "sharded", "sharded-async"])
def test_resume_continues_exactly(tmp_path: Path, sharded: bool, asynchronous: bool) -> None:
    """The full format, the sharded one, and the sharded one written in the background (AsyncCheckpointIO) while
    training goes on: the checkpoint holds the state of its step, not of later ones."""
    first = tmp_path / "first"
    (first / STAGING_DIR).mkdir(parents=True)
    # Debris of a save that crashed half-way: never loaded, cleaned up by the next save of that name.
    (first / STAGING_DIR / "last.ckpt").write_bytes(b"truncated")

    uninterrupted = run_distributed(_fit, 2, str(first), sharded, 0, None, asynchronous=asynchronous)[0]
    epoch0 = first / "epoch=0-step=4.ckpt"
    assert is_sharded_checkpoint(epoch0) if sharded else epoch0.is_file()
    assert sorted(p.name for p in first.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    last = first / "last.ckpt" / "meta.pt" if sharded else first / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 8

    # A different seed: everything the second half depends on must come from the checkpoint.
    second = tmp_path / "second"
    resumed = run_distributed(_fit, 2, str(second), sharded, 1, str(epoch0))[0]
    assert resumed["step"] == uninterrupted["step"] == 8
    assert resumed["losses"] == uninterrupted["losses"][4:]  # bitwise: same ops, same order, same data
    for name, tensor in uninterrupted["state"].items():
        assert torch.equal(resumed["state"][name], tensor), name


def _resumes_bitwise(root: Path | str, world_size: int, layout: tuple[str, bool], epoch_steps: int = 4,
                     optimizer: str = "adamw", async_save: bool = False) -> tuple:
    """Train two epochs under ``layout`` in ``root`` (a directory, or an object store's URL), resume a second run
    (another seed) from the first epoch's checkpoint, and assert it repeats the first run bitwise; returns the first
    run and that checkpoint."""
    # No last.ckpt beside the asynchronous saves: its save would wait for the epoch's to be written before training
    # goes on, and the epoch's checkpoint must be written while the next steps change the weights.
    fit = functools.partial(_fit, optimizer=optimizer, async_save=async_save, save_last=not async_save)
    uninterrupted = run_distributed(fit, world_size, f"{root}/a", layout, 0, None)[0]
    epoch0 = f"{root}/a/epoch=0-step={epoch_steps}.ckpt"
    resumed = run_distributed(fit, world_size, f"{root}/b", layout, 1, epoch0)[0]
    assert resumed["losses"] == uninterrupted["losses"][epoch_steps:]
    for name, tensor in uninterrupted["state"].items():
        assert torch.equal(resumed["state"][name], tensor), name
    return uninterrupted, epoch0


def test_pipeline_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    """Each rank saves and restores its own stage (weights and AdamW moments) in one DCP directory."""
    # One data-parallel rank: 8 batches per epoch.
    uninterrupted, _ = _resumes_bitwise(tmp_path, 2, ("pipeline_parallel", True), epoch_steps=8)
    # And the stages come together in one plain file, or in another layout.
    weights = export_consolidated(tmp_path / "a" / "last.ckpt", tmp_path / "model.pt")
    assert weights.keys() == uninterrupted["state"].keys()


@pytest.mark.parametrize("stage", [1, 3])
def test_pipeline_with_zero_resumes_exactly_and_reshards(tmp_path: Path, stage: int) -> None:
    """Each pipeline rank saves the parameter and optimizer-state shards its ZeRO partition owns; the run resumes
    bitwise, and the same checkpoint continues under ZeRO-1 without a pipeline on half the ranks."""
    uninterrupted, epoch0 = _resumes_bitwise(tmp_path, 4, (f"pp2xdp2-zero{stage}", True))
    elsewhere = run_distributed(_fit, 2, str(tmp_path / "c"), ("zero1", True), 1, str(epoch0))[0]
    assert elsewhere["losses"] == pytest.approx(uninterrupted["losses"][4:], rel=1e-5)
    for name, tensor in uninterrupted["state"].items():
        torch.testing.assert_close(elsewhere["state"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_zero1_over_tensor_parallel_shards_resumes_exactly_and_reshards(tmp_path: Path, sharded: bool) -> None:
    """Each data-parallel rank saves the AdamW states of the tensor-parallel shards it owns (made whole in the full
    format); the run resumes bitwise, and continues from the sharded checkpoint with FSDP2 over the same shards."""
    uninterrupted, epoch0 = _resumes_bitwise(tmp_path, 4, ("dp2xtp2-zero1", sharded))
    if not sharded:
        return
    elsewhere = run_distributed(_fit, 4, str(tmp_path / "c"), ("dp2xtp2-zero3", True), 1, str(epoch0))[0]
    assert elsewhere["losses"] == pytest.approx(uninterrupted["losses"][4:], rel=1e-5)
    for name, tensor in uninterrupted["state"].items():
        torch.testing.assert_close(elsewhere["state"][name], tensor, rtol=1e-5, atol=1e-6)


def test_experts_with_zero3_resume_exactly_and_reshard(tmp_path: Path) -> None:
    """Experts split over ep=2 and FSDP-sharded over the 2 ranks holding each: the run resumes bitwise (4 ranks,
    2 steps per epoch), and continues from the same checkpoint with one expert per rank and replicated dense
    weights."""
    uninterrupted, epoch0 = _resumes_bitwise(tmp_path, 4, ("ep2-zero3", True), epoch_steps=2)
    elsewhere = run_distributed(_fit, 4, str(tmp_path / "c"), ("ep4", True), 1, str(epoch0))[0]
    assert elsewhere["losses"] == pytest.approx(uninterrupted["losses"][2:], rel=1e-5)
    for name, tensor in uninterrupted["state"].items():
        torch.testing.assert_close(elsewhere["state"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("strategy", "sharded"), [("ep2-zero1", False), ("ep2-zero2", True)])
def test_experts_with_zero1_and_zero2_resume_exactly(tmp_path: Path, strategy: str, sharded: bool) -> None:
    """The experts' AdamW states partitioned over the 2 ranks holding each expert, the rest over all 4: the run
    resumes from the full format (the partitions gathered) and from the sharded one, which also continues with
    FSDP2 sharding the same experts. Not bitwise: a 4-rank all-reduce adds in an order that follows DDP's buckets,
    which DDP rebuilds after the first step of each run (2-rank sums do not depend on it)."""
    uninterrupted = run_distributed(_fit, 4, str(tmp_path / "a"), (strategy, sharded), 0, None)[0]
    epoch0 = str(tmp_path / "a" / "epoch=0-step=2.ckpt")
    for name in [strategy, "ep2-zero3"] if sharded else [strategy]:
        resumed = run_distributed(_fit, 4, str(tmp_path / name), (name, sharded), 1, epoch0)[0]
        assert resumed["losses"] == pytest.approx(uninterrupted["losses"][2:], rel=1e-6), name
        for key, tensor in uninterrupted["state"].items():
            torch.testing.assert_close(resumed["state"][key], tensor, rtol=1e-6, atol=1e-7, msg=f"{name}: {key}")


@pytest.mark.parametrize(("layout", "optimizer"), [("zero3", "muon"), ("zero1", "muon"), ("zero3", "adamw_bf16"),
                                                   ("zero3", "adamw_8bit")])
def test_other_optimizers_resume_exactly(tmp_path: Path, layout: str, optimizer: str) -> None:
    """Muon's momentum buffers (a ZeRO-3 shard of each matrix's, or an owner's whole ones), bf16 moments and torchao's
    quantised moments (codes, block scales, code book) come back from a sharded checkpoint: the resumed run repeats
    the uninterrupted one bit for bit."""
    _resumes_bitwise(tmp_path, 2, (layout, True), optimizer=optimizer)


@pytest.mark.parametrize(("layout", "world_size", "epoch_steps"), [("hybrid3d", 8, 4), ("ep2-zero3", 4, 2)])
def test_asynchronous_saves_resume_exactly(tmp_path: Path, layout: str, world_size: int, epoch_steps: int) -> None:
    """``async_save=True``: each checkpoint, written in the background while the next steps train, holds the state of
    its own step. A run resumed from the first epoch's repeats the uninterrupted one bit for bit, under dp2 x tp2 x
    pp2 with sequence parallel (dense Llama, 8 ranks) and ZeRO-3 over experts split ep=2 (mixture of experts)."""
    _resumes_bitwise(tmp_path, world_size, (layout, True), epoch_steps=epoch_steps, async_save=True)


def test_full_checkpoint_holds_whole_tensors_by_name(tmp_path: Path) -> None:
    run_distributed(_fit, 2, str(tmp_path), False, 0, None)
    checkpoint = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    module = make_module()
    assert checkpoint["state_dict"].keys() == module.state_dict().keys()
    module.load_state_dict(checkpoint["state_dict"])  # plain PyTorch, no strategy
    assert checkpoint["global_step"] == 8
    (optimizer_state,) = checkpoint["optimizer_states"]
    assert "model.layers.0.attention.q_proj.weight" in optimizer_state["state"]


# Each ZeRO stage in one of the formats (the others by the cross-layout tests below): ZeroRedundancyOptimizer's
# partitions, stage 2's owned gradients and FSDP2's shards resume bitwise; the full format gathers sharded
# optimizer states into whole ones.
@pytest.mark.parametrize(("strategy", "sharded"), [("zero1", False), ("zero2", True), ("zero3", False)])
def test_zero_resume_continues_exactly(tmp_path: Path, strategy: str, sharded: bool) -> None:
    _resumes_bitwise(tmp_path, 2, (strategy, sharded))


@pytest.mark.parametrize(("saved_under", "resumed_under"),
                         [("data_parallel", "zero3"), ("zero1", "zero2"), ("zero2", "data_parallel"),
                          ("zero3", "zero1")])
def test_sharded_checkpoint_resumes_under_another_layout(tmp_path: Path, saved_under: str, resumed_under: str) -> None:
    """Weights and optimizer states reshard on load: the continued run matches the uninterrupted one."""
    uninterrupted = run_distributed(_fit, 2, str(tmp_path / "a"), (saved_under, True), 0, None)[0]
    epoch0 = tmp_path / "a" / "epoch=0-step=4.ckpt"
    resumed = run_distributed(_fit, 2, str(tmp_path / "b"), (resumed_under, True), 1, str(epoch0))[0]
    # Another layout reduces gradients in another order: equal to rounding, not bitwise.
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][4:], rel=1e-5)
    for name, tensor in uninterrupted["state"].items():
        torch.testing.assert_close(resumed["state"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("strategy", "sharded"), [("zero3", True), ("zero2", False)])
def test_export_consolidated_loads_in_plain_pytorch(tmp_path: Path, strategy: str, sharded: bool) -> None:
    import subprocess

    trained = run_distributed(_fit, 2, str(tmp_path / "run"), (strategy, sharded), 0, None)[0]["state"]
    exported = tmp_path / "model.pt"
    command = [PYTHON, "-m", "lightning_par.cli.export", str(tmp_path / "run" / "last.ckpt"), str(exported)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tensors" in result.stdout
    weights = torch.load(exported, weights_only=True)  # plain tensors only: nothing that can run code
    module = make_module()
    module.load_state_dict(weights)
    for name, tensor in trained.items():
        assert torch.equal(module.state_dict()[name], tensor), name


# zero3 -> tensor_parallel and pp4 -> pp2, with the optimizer state, are in test_checkpoint_reshard.py.
@pytest.mark.parametrize(("saved_under", "loaded_under"), [(("tensor_parallel", True), "data_parallel"),
                                                          (("context_parallel", True), "tensor_parallel"),
                                                          (("data_parallel", False), "pipeline_parallel"),
                                                          (("pipeline_parallel", True), "data_parallel")],
                         ids=["tp-dp", "cp-tp", "full-pp", "pp-dp"])
def test_model_parallel_checkpoints_reshard(tmp_path: Path, saved_under: tuple, loaded_under: str) -> None:
    """DTensor shards of a tensor-parallel run load into whole tensors, and back, a context-parallel run's into
    tensor-parallel shards, a full file into pipeline stages, each rank taking its stages' weights, and pipeline
    stages into one whole model (weights
    compared after consolidation; a different data-parallel size reads other batches, so no loss curve is
    compared)."""
    saved = run_distributed(_fit, 2, str(tmp_path / "a"), saved_under, 0, None, 1)[0]
    loaded = run_distributed(_fit, 2, str(tmp_path / "b"), (loaded_under, True), 1,
                             str(tmp_path / "a" / "last.ckpt"), 1)[0]
    assert loaded["losses"] == []  # restored at the end of epoch 0: nothing left to train
    for name, tensor in saved["state"].items():
        assert torch.equal(loaded["state"][name], tensor), name


def test_hybrid_checkpoint_reshards_into_data_parallel(tmp_path: Path) -> None:
    """dp2 x tp2 x pp2 on 8 ranks (stages, tensor-parallel shards, sequence parallel) -> DDP on 4 ranks."""
    saved = run_distributed(_fit, 8, str(tmp_path / "a"), ("hybrid3d", True), 0, None, 1)[0]
    loaded = run_distributed(_fit, 4, str(tmp_path / "b"), ("data_parallel", True), 1,
                             str(tmp_path / "a" / "last.ckpt"), 1)[0]
    assert loaded["losses"] == []  # restored at the end of epoch 0: nothing left to train
    assert set(saved["state"]) == set(loaded["state"])
    for name, tensor in saved["state"].items():
        assert torch.equal(loaded["state"][name], tensor), name


def test_half_written_checkpoints_are_invisible_to_lightnings_resume(tmp_path: Path) -> None:
    """Debris of interrupted saves sits where neither ``ckpt_path="last"`` nor the SLURM resume looks."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"complete")
    (tmp_path / "last.ckpt").write_bytes(b"complete")
    for name in ("hpc_ckpt_2.ckpt", "last.ckpt", "last-v1.ckpt"):
        (tmp_path / STAGING_DIR / name).mkdir(parents=True)
    newest_hpc = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(tmp_path, "hpc_ckpt_")
    assert newest_hpc == 1
    trainer = lightning.Trainer(default_root_dir=tmp_path, logger=False)
    assert ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(trainer) == {str(tmp_path / "last.ckpt")}


class Payload:
    """Pickled into a checkpoint's metadata: unpickling it writes a file (any code could run instead)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (Path(self.marker), "the payload ran")


def _resume_from(rank: int, world_size: int, paths: list[str], weights_only: bool,
                 models: list[dict] | None = None, layout: str = "data_parallel") -> list[str]:
    """Try ``fit(ckpt_path=path)`` for each path in one set of ranks (a model of ``models[i]`` hyper-parameters
    for path i) under ``layout``; return what each did: "loaded" or the error's message."""
    from lightning_par import DataParallelStrategy

    outcomes = []
    for path, changes in zip(paths, models or [{}] * len(paths)):
        strategy = (DataParallelStrategy(checkpoint_weights_only=weights_only) if layout == "data_parallel"
                    else make_strategy(layout))
        trainer = lightning.Trainer(accelerator="cpu", devices=world_size, max_epochs=3, logger=False,
                                    strategy=strategy,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        try:
            trainer.fit(make_module(**changes), datamodule=make_datamodule(), ckpt_path=path)
            outcomes.append("loaded")
        except ValueError as error:
            outcomes.append(str(error))
    return outcomes


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full (``full/last.ckpt``) and a sharded (``sharded/last.ckpt``) checkpoint of two epochs on 2 ranks."""
    base = tmp_path_factory.mktemp("saved")
    run_distributed(_fit, 2, str(base / "full"), False, 0, None)
    run_distributed(_fit, 2, str(base / "sharded"), True, 0, None)
    return base


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    """This test's own copies of the full and the sharded checkpoint."""
    full, sharded = tmp_path / "full.ckpt", tmp_path / "sharded.ckpt"
    shutil.copy(saved / "full" / "last.ckpt", full)
    shutil.copytree(saved / "sharded" / "last.ckpt", sharded)
    return full, sharded


def test_auto_finds_the_newest_complete_checkpoint(saved: Path, tmp_path: Path) -> None:
    """``ckpt_path="auto"``: the newest checkpoint that loads, of any name the run's ModelCheckpoint writes or an HPC
    one, also under the logger's earlier versions; a truncated newer one is passed over; nothing yet: a fresh start."""
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_par.strategies.auto_resume import newest_checkpoint

    def trainer() -> lightning.Trainer:
        return lightning.Trainer(default_root_dir=tmp_path, logger=TensorBoardLogger(tmp_path, name="run"),
                                 callbacks=[ModelCheckpoint()], enable_progress_bar=False)

    assert newest_checkpoint(trainer()) is None
    earlier = tmp_path / "run" / "version_0" / "checkpoints"
    earlier.mkdir(parents=True)
    full, sharded = _copy(saved, tmp_path)
    shutil.move(full, earlier / "epoch=0-step=3.ckpt")
    shutil.move(sharded, earlier / "epoch=1-step=6.ckpt")
    for second, path in enumerate([earlier / "epoch=0-step=3.ckpt", *(earlier / "epoch=1-step=6.ckpt").iterdir()]):
        os.utime(path, (1e9 + second, 1e9 + second))  # written in the order of their steps
    (earlier / STAGING_DIR / "epoch=1-step=9.ckpt").mkdir(parents=True)  # a save that was cut off
    assert newest_checkpoint(trainer()) == str(earlier / "epoch=1-step=6.ckpt")
    truncated = earlier / "last.ckpt"
    truncated.write_bytes((earlier / "epoch=0-step=3.ckpt").read_bytes()[:1000])
    assert newest_checkpoint(trainer()) == str(earlier / "epoch=1-step=6.ckpt")
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    shutil.copy(earlier / "epoch=0-step=3.ckpt", hpc)
    os.utime(hpc, ns=(0, 1 << 62))
    assert newest_checkpoint(trainer()) == str(hpc)


def test_a_checkpoint_carrying_pickled_code_is_refused(saved: Path, tmp_path: Path) -> None:
    """A full checkpoint and a sharded one's meta.pt carry an object whose unpickling writes a file: loading
    refuses both (weights_only=True, as PyTorch and Lightning do by default), the file is never written, and
    the message says how to trust a file; the strategy's checkpoint_weights_only=False is that explicit opt-in
    (Lightning 2.6 does not forward trainer.fit(weights_only=...) to strategies that restore after set-up)."""
    full, sharded = _copy(saved, tmp_path)
    marker = tmp_path / "payload-ran"
    checkpoint = torch.load(full, weights_only=False)
    checkpoint["hyper_parameters"]["innocent"] = Payload(str(marker))
    torch.save(checkpoint, full)
    meta = sharded / "meta.pt"
    metadata = torch.load(meta, weights_only=False)
    metadata["hyper_parameters"]["innocent"] = Payload(str(marker))
    torch.save(metadata, meta)

    for outcomes in run_distributed(_resume_from, 2, [str(full), str(meta.parent)], True):
        for outcome, path in zip(outcomes, (full, meta)):
            assert outcome.startswith(f"checkpoint {str(path)!r} holds "), outcome
            assert "it was not loaded" in outcome and "weights_only=False" in outcome, outcome
    assert not marker.exists()

    assert run_distributed(_resume_from, 2, [str(full)], False)[0] == ["loaded"]  # trusted: it runs
    assert marker.read_text() == "the payload ran"


def _with_pickled_payloads(sharded: Path, tmp_path: Path, marker: Path) -> tuple[Path, Path]:
    """Two copies of a sharded checkpoint: one whose DCP index (.metadata) is a pickle that writes ``marker`` when
    unpickled, one whose non-tensor entries (an optimizer's learning rate, an extra model entry) are."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    index = shutil.copytree(sharded, tmp_path / "payload-in-index.ckpt")
    (index / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    entries = shutil.copytree(sharded, tmp_path / "payload-in-entries.ckpt")
    dcp_to_torch_save(entries, tmp_path / "whole.pt")  # our own, trusted
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    state["optimizer_0"]["param_groups"][0]["lr"] = Payload(str(marker))
    state["state_dict"]["extra"] = Payload(str(marker))
    for written in entries.glob("*.distcp"):
        written.unlink()
    dcp.save(state, checkpoint_id=entries, no_dist=True)
    return index, entries


def test_a_sharded_checkpoint_carrying_pickled_code_is_refused(saved: Path, tmp_path: Path) -> None:
    """torch.distributed.checkpoint unpickles its .metadata index and every non-tensor entry with plain pickle;
    lightning-par reads both so that only DCP's own classes (and weights_only=True's) are constructed. A payload in
    either is refused by fit under the layout that saved it, by a resharding load (tensor parallel) and by
    lightning-par-export, with the class named, and never runs."""
    from lightning_par.cli.export import main as export

    _, sharded = _copy(saved, tmp_path)
    marker = tmp_path / "payload-ran"
    index, entries = _with_pickled_payloads(sharded, tmp_path, marker)
    # the callable the payload's pickle names: pickle spells it pathlib.Path.write_text, torch.save getattr
    refusal = r"holds (pathlib\.Path\.write_text|getattr), which unpickling would have to construct"
    for layout in ("data_parallel", "tensor_parallel"):
        for outcomes in run_distributed(_resume_from, 2, [str(index), str(entries), str(sharded)], True, None,
                                        layout):
            assert re.search(refusal, outcomes[0]) and repr(str(index / ".metadata")) in outcomes[0], outcomes[0]
            assert re.search(refusal, outcomes[1]) and "weights_only=False" in outcomes[1], outcomes[1]
            assert outcomes[2] == "loaded"
    for path in (index, entries):
        with pytest.raises(ValueError, match=refusal):
            export([str(path), str(tmp_path / "out.pt")])
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    export([str(sharded), str(tmp_path / "out.pt")])  # the untouched directory still exports
    assert (tmp_path / "out.pt").exists()


def bad_checkpoints(full: Path, sharded: Path) -> list[tuple[Path, dict, str]]:
    """(path, model hyper-parameters, what the message must say) for checkpoints that cannot be loaded, made
    from a good full and a good sharded checkpoint."""
    cases = []

    def case(name: str, expected: str, model: dict | None = None, *, from_: Path | None = None) -> Path:
        path = full.parent / name
        if from_ is not None:
            (shutil.copytree if from_.is_dir() else shutil.copy)(from_, path)
        cases.append((path, model or {}, expected.format(path=repr(str(path)))))
        return path

    case("garbage.ckpt", "{path} is not a checkpoint: it is neither a directory written by "
         "torch.distributed.checkpoint nor a file written by torch.save (it starts with b'garbage\\n'").write_bytes(
        b"garbage\n")
    whole = full.read_bytes()
    case("truncated.ckpt", "checkpoint {path} is truncated or corrupt: the archive's index at its end is "
         "missing").write_bytes(whole[: len(whole) // 2])
    os.remove(case("no-meta.ckpt", "sharded checkpoint {path} has no meta.pt", from_=sharded) / "meta.pt")
    shard = max(case("short-shard.ckpt", "sharded checkpoint {path}: the shard '__", from_=sharded).glob("*.distcp"),
                key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    os.remove(next(case("lost-shard.ckpt", "sharded checkpoint {path} is missing the shard '__",
                        from_=sharded).glob("*.distcp")))
    for source in (full, sharded):
        case(f"other-model-{source.stem}.ckpt", "checkpoint {path} was written by another model: model.embed_tokens.weight "
             "is (64, 32) there and (64, 48) here", {"dim": 48}, from_=source)
    newer = torch.load(full, weights_only=False)
    newer["lightning_par_checkpoint_format"] = 99
    torch.save(newer, case("newer.ckpt", "checkpoint {path} was written by a newer lightning-par (checkpoint format "
                           "99; this version reads format 1"))
    del newer["optimizer_states"], newer["lightning_par_checkpoint_format"]
    torch.save(newer, case("weights-only.ckpt", "checkpoint {path} holds the model but no optimizer state"))
    torch.save(newer["state_dict"], case("state-dict.pt", "{path} is not a Lightning checkpoint: it has no "
                                         "'state_dict' entry"))
    case("missing.ckpt", "checkpoint {path} does not exist")
    return cases


def test_checkpoints_that_cannot_load_say_why_on_every_rank(saved: Path, tmp_path: Path) -> None:
    """Each broken checkpoint is refused before any tensor is loaded, with one line naming the path, the cause and
    the fix, the same on both ranks; then the good checkpoints still load in the same processes."""
    full, sharded = _copy(saved, tmp_path)
    cases = bad_checkpoints(full, sharded)
    paths = [str(path) for path, _, _ in cases] + [str(full), str(sharded)]
    models = [model for _, model, _ in cases] + [{}, {}]
    ranks = run_distributed(_resume_from, 2, paths, True, models)
    assert ranks[0] == ranks[1]
    for outcome, (path, _, expected) in zip(ranks[0], cases):
        assert expected in outcome, (path.name, outcome)
    assert ranks[0][-2:] == ["loaded", "loaded"]


def _fit_planned(rank: int, world_size: int, directory: str, accumulate: int, seed: int,
                 ckpt_path: str | None) -> dict:
    """auto_parallel plans the layout for ``world_size`` ranks; a checkpoint every 2 optimizer steps (mid-epoch)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_par import AutoParallelStrategy

    torch.manual_seed(seed)
    strategy = AutoParallelStrategy()
    checkpoints = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=4,
                                accumulate_grad_batches=accumulate, callbacks=[checkpoints], logger=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                limit_val_batches=0)
    # 32 samples / (batch 2 x 4 ranks) = 4 optimizer steps; on 2 ranks, 2 accumulated batches make the same step.
    trainer.fit(make_module(), datamodule=make_datamodule(num_samples=32), ckpt_path=ckpt_path)
    return {"state": trainer.strategy.consolidated_state_dict(), "step": trainer.global_step,
            "layout": strategy.planned_layouts[0].config.describe()}


def test_auto_parallel_replans_on_resume_with_fewer_ranks(tmp_path: Path) -> None:
    """A run planned for 4 ranks is checkpointed mid-epoch and resumed on 2. The planner plans
    again for 2 ranks (the same global batch, by accumulating 2 batches), the sharded checkpoint reshards weights
    and AdamW states into that layout, and the data resumes at the sample where the checkpoint was taken: the
    weights after the last step are those of the uninterrupted 4-rank run."""
    uninterrupted = run_distributed(_fit_planned, 4, str(tmp_path / "a"), 1, 0, None)[0]
    checkpoint = tmp_path / "a" / "epoch=0-step=2.ckpt"
    resumed = run_distributed(_fit_planned, 2, str(tmp_path / "b"), 2, 1, str(checkpoint))[0]
    print(f"planned on 4 ranks: {uninterrupted['layout']}; on 2: {resumed['layout']}")
    assert uninterrupted["layout"] != resumed["layout"]
    assert resumed["step"] == uninterrupted["step"] == 4
    for name, tensor in uninterrupted["state"].items():
        torch.testing.assert_close(resumed["state"][name], tensor, rtol=1e-5, atol=1e-6)


def test_auto_is_lightnings_error_again_once_uninstalled() -> None:
    """``ckpt_path="auto"`` reaches Lightning through a wrapper of its connector's parse; ``uninstall`` restores
    Lightning's own, under which "auto" is a file name like any other value."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_par.strategies import auto_resume

    def parse(trainer: Trainer) -> object:
        connector = trainer._checkpoint_connector
        return connector._parse_ckpt_path(TrainerFn.FITTING, "auto", model_provided=True, model_connected=True)

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert parse(trainer) is None  # no checkpoint of this run: a fresh start
    auto_resume.uninstall()
    try:
        assert parse(trainer) == "auto"
    finally:
        auto_resume.install()
    assert parse(trainer) is None


@pytest.mark.parametrize("staged", [True, False], ids=["staged-copy", "old-copy-only"])
def test_a_replacement_cut_between_its_renames_is_finished_before_the_name_is_written_again(tmp_path: Path,
                                                                                            staged: bool) -> None:
    """On a filesystem that cannot swap, a crash between the two renames leaves ``last.ckpt`` only in the staging
    folder (the new copy, and the old one moved aside). The next save of ``last.ckpt`` puts the newest in place before
    it clears the folder, so a crash while that save is written still leaves a complete ``last.ckpt``."""
    from lightning_par.checkpoint.atomic import RETIRED_SUFFIX, clear_staging, interrupted_replacements, staging_path

    final = tmp_path / "last.ckpt"
    staging = staging_path(final)
    retired = staging.with_name(final.name + RETIRED_SUFFIX)
    retired.mkdir(parents=True)
    (retired / "step").write_text("3")
    if staged:
        staging.mkdir()
        (staging / "step").write_text("6")
    assert interrupted_replacements(tmp_path) == ([staging] if staged else []) + [retired]
    clear_staging(final)
    assert (final / "step").read_text() == ("6" if staged else "3")
    assert not staging.exists() and not retired.exists() and interrupted_replacements(tmp_path) == []

