"""Packed documents do not attend to each other: a window of several documents has the loss of its documents run
one by one (positions restarting, attention inside each document, no loss on a separator's target), in one process
and under tp2, pp2 and cp2 (ring and Ulysses); and training on packed text matches one process in each layout, with
each rank's and micro-batch's loss weighed by its share of the batch's tokens."""

from __future__ import annotations

import functools

import lightning
import pytest
from installed import require
import torch
from harness import run_distributed
from hf_directories import VOCAB, make_model_directory, write_corpus
from parity import assert_parity, layout_runs, reference_run

transformers = require("transformers")

SEQ_LEN = 32  # a multiple of 4: ring attention over cp=2 cuts it into 4 chunks
# Document lengths of the windows (separator included), each window seq_len + 1 tokens: inputs and targets.
DOCUMENTS = [(9, 11, 13), (7, 12, 14), (33,), (5, 5, 5, 18)]
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2-sp-lp": dict(tensor_parallel_size=2, sequence_parallel=True, loss_parallel=True),
    "pp2": dict(pipeline_parallel_size=2, microbatches=2),
    "cp2-ring": dict(context_parallel_size=2, context_parallel_method="ring"),
    "cp2-ulysses": dict(context_parallel_size=2, context_parallel_method="ulysses"),
}
LOSS_RTOL = 1e-6
STEPS = 20


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("packed")
    return {"model": str(make_model_directory(root / "model", "llama-tied")),
            "corpus": str(write_corpus(root / "corpus", repeats=12)["jsonl"])}


def _windows(separator: int, bos: int) -> list[list[list[int]]]:
    """Per window, its documents: a beginning token, random tokens, the separator."""
    generator = torch.Generator().manual_seed(0)
    return [[[bos, *torch.randint(4, VOCAB, (length - 2,), generator=generator).tolist(), separator]
             for length in lengths] for lengths in DOCUMENTS]


class PackedWindows(lightning.LightningDataModule):
    """The windows of :data:`DOCUMENTS`, each its documents concatenated, as one validation batch."""

    def __init__(self, separator: int, bos: int) -> None:
        super().__init__()
        self.batch = torch.tensor([sum(documents, []) for documents in _windows(separator, bos)])

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(list(self.batch), batch_size=len(self.batch))


def _module(directory: str, packed: bool = True):
    from lightning_par.models import HFCausalLM

    return HFCausalLM(pretrained=directory, packed_documents=packed, learning_rate=1e-3, warmup_steps=2,
                      max_steps=STEPS)


def test_positions_restart_after_each_separator() -> None:
    from lightning_par.models.packing import cross_document_targets, document_positions

    tokens = torch.tensor([[5, 6, 2, 7, 2, 2, 8, 9]])
    assert document_positions(tokens, 2).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    targets = torch.arange(8).unsqueeze(0)
    assert cross_document_targets(tokens, targets, 2).tolist() == [[0, 1, -100, 3, -100, -100, 6, 7]]


def _separate_loss(directory: str) -> tuple[float, int]:
    """The documents' mean loss, each run through the plain Hugging Face model alone."""
    from lightning_par.data.text import load_tokenizer

    tokenizer = load_tokenizer(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for documents in _windows(tokenizer.eos_token_id, tokenizer.bos_token_id):
            for document in documents:
                ids = torch.tensor([document])
                logits = model(input_ids=ids[:, :-1]).logits
                total += float(torch.nn.functional.cross_entropy(logits[0].double(), ids[0, 1:], reduction="sum"))
                count += ids.shape[1] - 1
    return total / count, count


def _validate(rank: int, world_size: int, directory: str, layouts: dict[str, dict], separator: int,
              bos: int) -> dict[str, float]:
    from lightning_par import Hybrid3DStrategy

    losses = {}
    for name, sizes in layouts.items():
        trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=Hybrid3DStrategy(**sizes),
                                    logger=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.validate(_module(directory), datamodule=PackedWindows(separator, bos))
        losses[name] = float(trainer.callback_metrics["val_loss"])
    return losses


def test_a_packed_window_has_the_loss_of_its_documents_apart(workspace: dict[str, str]) -> None:
    from lightning_par.data.text import load_tokenizer

    directory = workspace["model"]
    tokenizer = load_tokenizer(directory)
    separator, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    expected, count = _separate_loss(directory)
    batch = PackedWindows(separator, bos).batch

    def one_process(packed: bool) -> float:
        module = _module(directory, packed)
        module.configure_model()
        module.load_pretrained()
        inputs, targets = module.split_batch(batch)
        assert int(module.loss_tokens(targets)) == (count if packed else batch.numel() - batch.shape[0])
        with torch.no_grad():
            return float(module.loss_fn(module(inputs), targets))

    assert abs(one_process(True) - expected) <= LOSS_RTOL * expected
    assert abs(one_process(False) - expected) > 100 * LOSS_RTOL * expected  # unmasked packing differs: the check can tell
    losses = run_distributed(_validate, 2, directory, LAYOUTS, separator, bos)[0]
    for name, loss in losses.items():
        print(f"{name}: packed {loss:.7f}, documents apart {expected:.7f}")
        assert abs(loss - expected) <= LOSS_RTOL * expected, (name, loss, expected)


def _data(workspace: dict[str, str], batch_size: int = 4):
    from lightning_par.data import TextDataModule

    return TextDataModule(train_files=workspace["corpus"], tokenizer=workspace["model"], seq_len=16,
                          batch_size=batch_size, val_fraction=0.0)


def _strategy(sizes: dict):
    from lightning_par import Hybrid3DStrategy

    return Hybrid3DStrategy(**sizes)


def test_training_on_packed_documents_matches_one_process(workspace: dict[str, str]) -> None:
    """20 AdamW steps on packed text, documents masked, against one process: the layouts of the test above and data
    parallel, whose ranks' batches take their loss on different numbers of tokens."""
    runs = {name: (functools.partial(_module, workspace["model"]), functools.partial(_data, workspace),
                   functools.partial(_strategy, sizes)) for name, sizes in LAYOUTS.items()}
    runs["dp2"] = (functools.partial(_module, workspace["model"]), functools.partial(_data, workspace, 2),
                   functools.partial(_strategy, dict(data_parallel_size=2)))
    results = layout_runs(runs, world_size=2, steps=STEPS, timeout=540)
    for name, result in results.items():
        dp = 2 if name == "dp2" else 1
        expected = reference_run(functools.partial(_module, workspace["model"]),
                                 functools.partial(_data, workspace, 4 // dp), dp=dp, steps=STEPS)
        loss_error, weight_error = assert_parity(result, expected, rtol=1e-5, weight_atol=1e-3 * 1e-3 * STEPS)
        print(f"{name}: loss {loss_error:.1e}, weights {weight_error:.1e} absolute")
