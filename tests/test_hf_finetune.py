"""Fine-tuning a local pretrained Hugging Face model on local text: the same training as one process under hybrid
layouts, an exact resume, the trained model written back for from_pretrained, and the shipped config."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from installed import require
import torch
from harness import run_distributed
from hf_directories import make_model_directory, write_corpus
from parity import assert_layout_matches

transformers = require("transformers")
require("datasets")

PARITY_RTOL = 1e-5
STEPS = 20
LEARNING_RATE = 1e-3


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune")
    return {"llama-tied": make_model_directory(root / "llama-tied", "llama-tied"),
            "qwen2": make_model_directory(root / "qwen2", "qwen2"),
            "corpus": write_corpus(root / "corpus", repeats=12)["jsonl"]}


def _module(directory: str, max_steps: int = STEPS):
    from lightning_par.models import HFCausalLM

    return HFCausalLM(pretrained=directory, learning_rate=LEARNING_RATE, warmup_steps=2, max_steps=max_steps)


def _data(directory: str, corpus: str, batch_size: int, val_fraction: float = 0.0):
    from lightning_par.data import TextDataModule

    return TextDataModule(train_files=corpus, tokenizer=directory, seq_len=16, batch_size=batch_size,
                          val_fraction=val_fraction)


def _hybrid(**sizes):
    from lightning_par import Hybrid3DStrategy

    return Hybrid3DStrategy(**sizes)


LAYOUTS = {
    # family, world size, data-parallel size, per-rank batch, strategy
    "dp2xtp2": ("qwen2", 4, 2, 2, dict(data_parallel_size=2, tensor_parallel_size=2)),
    # The tied head on the last stage, the embedding on the first, both split over tp: gradients summed per shard.
    "pp2xtp2": ("llama-tied", 4, 1, 4, dict(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2,
                                       sequence_parallel=True)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fine_tune_matches_one_process(workspace: dict[str, Path], layout: str) -> None:
    """20 AdamW steps from the pretrained weights on the packed JSONL text: losses and weights as one process."""
    family, world_size, dp, batch_size, sizes = LAYOUTS[layout]
    directory = str(workspace[family])
    assert_layout_matches(functools.partial(_module, directory),
                          functools.partial(_data, directory, str(workspace["corpus"]), batch_size),
                          functools.partial(_hybrid, **sizes), world_size=world_size, dp=dp, steps=STEPS,
                          rtol=PARITY_RTOL, label=f"fine-tune {family} {layout}",
                          # AdamW: weights within 1e-3 of the farthest it can move them (see assert_parity).
                          weight_atol=1e-3 * LEARNING_RATE * STEPS)


def _fine_tune(rank: int, world_size: int, directory: str, corpus: str, root: str, max_steps: int,
               resume: str | None, export: bool) -> dict:
    """tp2 fine-tune to ``max_steps`` (from ``resume`` if given), a checkpoint every 3 steps; return the losses of
    every step, the trained weights (rank 0) and whether the pretrained weights were read."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_par import TensorParallelStrategy
    from lightning_par.callbacks import HuggingFaceExport
    from parity import RecordLoss

    recorder = RecordLoss()
    callbacks = [recorder, ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=3, save_top_k=-1)]
    if export:
        callbacks.append(HuggingFaceExport(f"{root}/exported"))
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size,
                                strategy=TensorParallelStrategy(tensor_parallel_size=2), max_steps=max_steps,
                                limit_val_batches=0, logger=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    module = _module(directory, max_steps=6)
    trainer.fit(module, datamodule=_data(directory, corpus, batch_size=4), ckpt_path=resume)
    weights = trainer.strategy.consolidated_state_dict()
    return {"losses": recorder.losses, "weights": weights if rank == 0 else None}


def test_fine_tune_resumes_exactly_and_exports_at_the_end(workspace: dict[str, Path], tmp_path: Path) -> None:
    """Six steps at once, and three + a resume from the step-3 checkpoint for three more, give the same losses and
    weights bit for bit (the loader resumes mid-epoch; the resumed run does not read the pretrained weights again).
    HuggingFaceExport then leaves a directory from_pretrained loads, with the trained weights and the tokenizer."""
    directory, corpus = str(workspace["llama-tied"]), str(workspace["corpus"])
    whole = run_distributed(_fine_tune, 2, directory, corpus, str(tmp_path / "whole"), 6, None, False)[0]
    run_distributed(_fine_tune, 2, directory, corpus, str(tmp_path / "first"), 3, None, False)
    checkpoint = str(tmp_path / "first" / "ckpt" / "epoch=0-step=3.ckpt")
    resumed = run_distributed(_fine_tune, 2, directory, corpus, str(tmp_path / "second"), 6, checkpoint, True)[0]
    assert resumed["losses"] == whole["losses"][3:]
    for name, tensor in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name
    exported = tmp_path / "second" / "exported"
    assert (exported / "tokenizer.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, whole["weights"]["model." + name]), name


def _auto_parallel(rank: int, world_size: int, directory: str, corpus: str) -> dict:
    import lightning

    from lightning_par import AutoParallelStrategy

    strategy = AutoParallelStrategy()
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2,
                                limit_val_batches=0, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_module(directory, max_steps=2), datamodule=_data(directory, corpus, batch_size=4))
    return {"chosen": strategy.parallel_config, "loss": float(trainer.callback_metrics["train_loss"])}


def test_auto_parallel_plans_a_pretrained_model_from_its_config(workspace: dict[str, Path]) -> None:
    """The planner reads the ModelSpec from the model directory's config.json before the model is built, and the
    layout it ranks first is the one that trains."""
    from lightning_par.models import HFCausalLM
    from lightning_par.planner import ClusterSpec, ModelSpec
    from lightning_par.planner.runtime import plan_for_run

    directory = str(workspace["qwen2"])
    results = run_distributed(_auto_parallel, 2, directory, str(workspace["corpus"]))
    spec = ModelSpec.from_module(HFCausalLM(pretrained=directory))
    whole = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert spec.total_params == pytest.approx(sum(p.numel() for p in whole.parameters()), rel=0.01)  # q/k/v biases
    expected = plan_for_run(spec, ClusterSpec.from_preset("cpu", devices_per_node=2), batch_size_per_rank=4,
                            seq_len=16)[0].config
    chosen = results[0]["chosen"]
    assert (chosen.dp, chosen.tp, chosen.pp, chosen.zero_stage) == (expected.dp, expected.tp, expected.pp,
                                                                     expected.zero_stage)
    assert results[0]["loss"] == results[1]["loss"] and 0 < results[0]["loss"] < 10
