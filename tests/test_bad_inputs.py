"""Every bad input of tests/bad_inputs.py gets a message that names the value and what would fit; docs/errors.md
lists them all; the set-up checks also hold in real processes, before the first step."""

from __future__ import annotations

from pathlib import Path

import pytest
from bad_inputs import BAD_INPUTS, good_checkpoints, markdown_table
from harness import run_distributed

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("good")
    good_checkpoints(directory)
    return directory


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[bad.given.strip("`") for bad in BAD_INPUTS])
def test_the_message_names_the_value(bad, checkpoints: Path, tmp_path: Path, monkeypatch) -> None:
    for good in checkpoints.iterdir():
        (tmp_path / good.name).symlink_to(good)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as raised:
        bad.make()
    assert bad.says in str(raised.value)
    assert not Path("payload-ran").exists()


def test_there_are_at_least_40_and_the_docs_list_them() -> None:
    assert len(BAD_INPUTS) >= 40
    assert markdown_table() in (REPO / "docs" / "errors.md").read_text(), (
        "docs/errors.md is out of date: paste in the output of `python tests/bad_inputs.py`")


def _set_up_checks(rank: int, world_size: int) -> list[str]:
    """Fits whose set-up must refuse the input before the first step (no training step may run)."""
    import lightning
    import torch

    from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM

    class NoStep(lightning.Callback):
        def on_train_batch_start(self, *args) -> None:
            raise AssertionError("a training step started")

    def frozen() -> LlamaLM:
        module = LlamaLM(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
        module.requires_grad_(False)
        return module

    cases = [
        (DataParallelStrategy(), frozen, 16),
        (PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=3, pipeline_schedule="gpipe"), None, 16),
        (TensorParallelStrategy(tensor_parallel_size=2, sequence_parallel=True), None, 15),
    ]
    messages = []
    for strategy, make_module, seq_len in cases:
        module = (make_module or (lambda: LlamaLM(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)))()
        trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1,
                                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, callbacks=[NoStep()], num_sanity_val_steps=0)
        data = TokenDataModule(source="synthetic", vocab_size=64, seq_len=seq_len, batch_size=8, num_samples=32)
        try:
            trainer.fit(module, datamodule=data)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
        torch.manual_seed(0)
    return messages


def test_set_up_refuses_what_the_first_step_would(tmp_path: Path) -> None:
    """A model without trainable parameters, micro-batches that do not divide the loader's batch size and a sequence
    length sequence parallel cannot split: refused at set-up on every rank, before any training step."""
    ranks = run_distributed(_set_up_checks, 2)
    assert ranks[0] == ranks[1]
    frozen, microbatches, sequence = ranks[0]
    assert "LlamaLM has no trainable parameters" in frozen, frozen
    assert "a batch of 8 samples does not split into microbatches=3" in microbatches, microbatches
    assert ("sequence_parallel=True splits the sequence over tensor_parallel_size=2 ranks, but a sequence of 15 tokens"
            in sequence), sequence
