"""Tests for lightning_par.data: the stdlib corpus, the datasets and TokenDataModule sharding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from installed import require
import torch
from torch.utils.data import DistributedSampler

from lightning_par.data import (
    ResumableDataLoader,
    SyntheticTokenDataset,
    TokenDataModule,
    TokenWindowDataset,
    load_stdlib_tokens,
)
from lightning_par.data.corpus import DOCUMENT_SEPARATOR, is_validation_document, list_stdlib_documents


def _fake_trainer(num_replicas: int, rank: int) -> SimpleNamespace:
    """The only part of a Trainer the datamodule reads: the strategy's sampler kwargs."""
    kwargs = {"num_replicas": num_replicas, "rank": rank}
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs))


# ---------------------------------------------------------------------------- corpus
def test_corpus_is_deterministic():
    # How long loading takes is not asserted (no test may hinge on the clock): about 0.02 s on a laptop.
    first = load_stdlib_tokens("train")
    second = load_stdlib_tokens("train")
    assert first.dtype == torch.uint8 and first.dim() == 1
    assert torch.equal(first, second)
    assert torch.equal(load_stdlib_tokens("val"), load_stdlib_tokens("validation"))


def test_corpus_matches_its_documents_and_splits_are_disjoint():
    max_bytes, val_fraction = 300_000, 0.2
    docs = list_stdlib_documents()
    paths = [rel for rel, _ in docs]
    assert paths == sorted(paths) and len(set(paths)) == len(paths)
    excluded = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    assert not any(part in excluded for p in paths for part in p.split("/"))

    val_docs = [(rel, p) for rel, p in docs if is_validation_document(rel, val_fraction)]
    train_docs = [(rel, p) for rel, p in docs if not is_validation_document(rel, val_fraction)]
    assert val_docs and train_docs
    assert not {rel for rel, _ in val_docs} & {rel for rel, _ in train_docs}

    # Each split is exactly its own documents, in path order, cut at its share of max_bytes.
    val_budget = int(max_bytes * val_fraction)
    for split, split_docs, budget in (("val", val_docs, val_budget), ("train", train_docs, max_bytes - val_budget)):
        expected = DOCUMENT_SEPARATOR.join(p.read_bytes() for _, p in split_docs)[:budget]
        got = load_stdlib_tokens(split, max_bytes=max_bytes, val_fraction=val_fraction)
        assert got.numel() == budget
        assert bytes(got.tolist()) == expected


def test_corpus_respects_max_bytes_and_byte_range():
    for max_bytes in (1, 1000, 123_457):
        train = load_stdlib_tokens("train", max_bytes=max_bytes)
        val = load_stdlib_tokens("val", max_bytes=max_bytes)
        assert train.numel() + val.numel() == max_bytes
    tokens = load_stdlib_tokens("train", max_bytes=500_000)
    assert tokens.dtype == torch.uint8
    assert int(tokens.max()) < 256 and int(tokens.min()) >= 0
    assert load_stdlib_tokens("val", val_fraction=0.0).numel() == 0


@pytest.mark.parametrize(
    "kwargs, bad",
    [({"split": "dev"}, "'dev'"), ({"max_bytes": 0}, "max_bytes=0"), ({"val_fraction": 1.0}, "val_fraction=1.0")],
)
def test_corpus_bad_arguments(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        load_stdlib_tokens(**kwargs)


def test_corpus_without_sources_raises(monkeypatch, tmp_path):
    monkeypatch.setattr("lightning_par.data.corpus.stdlib_dir", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match="no Python sources"):
        load_stdlib_tokens("train")


# ---------------------------------------------------------------------------- datasets
def test_window_dataset_predicts_every_token_once():
    tokens = torch.arange(1005) % 256
    ds = TokenWindowDataset(tokens.to(torch.uint8), seq_len=10)
    assert len(ds) == (1005 - 1) // 10 == 100
    samples = [ds[i] for i in range(len(ds))]
    assert all(s.dtype == torch.int64 and s.shape == (11,) for s in samples)
    # Targets (sample[1:]) tile tokens[1 : 1 + 100*10] with no gap and no overlap.
    assert torch.equal(torch.cat([s[1:] for s in samples]), tokens[1:1001])
    assert torch.equal(torch.cat([s[:-1] for s in samples]), tokens[:1000])
    assert torch.equal(ds[-1], ds[99])
    with pytest.raises(IndexError):
        ds[100]
    assert len(TokenWindowDataset(torch.zeros(0, dtype=torch.uint8), seq_len=4)) == 0


def test_synthetic_dataset_is_deterministic_and_random_access():
    a = SyntheticTokenDataset(num_samples=50, seq_len=16, vocab_size=97, seed=3)
    b = SyntheticTokenDataset(num_samples=50, seq_len=16, vocab_size=97, seed=3)
    forward = [a[i] for i in range(50)]
    backward = [b[i] for i in reversed(range(50))][::-1]
    assert all(torch.equal(x, y) for x, y in zip(forward, backward))
    for s in forward:
        assert s.dtype == torch.int64 and s.shape == (17,)
        assert int(s.min()) >= 0 and int(s.max()) < 97
        steps = (s[1:] - s[:-1]) % 97
        assert (steps == steps[0]).all()  # an arithmetic progression mod vocab: learnable
    other = SyntheticTokenDataset(num_samples=50, seq_len=16, vocab_size=97, seed=4)
    assert not all(torch.equal(x, other[i]) for i, x in enumerate(forward))
    assert len({tuple(s.tolist()) for s in forward}) > 25  # samples actually vary


# ---------------------------------------------------------------------------- datamodule
@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"source": "wikipedia"}, "'wikipedia'"),
        ({"seq_len": 0}, "seq_len=0"),
        ({"batch_size": -1}, "batch_size=-1"),
        ({"max_bytes": 0}, "max_bytes=0"),
        ({"val_fraction": 1.0}, "val_fraction=1.0"),
        ({"val_fraction": -0.1}, "val_fraction=-0.1"),
        ({"vocab_size": 128}, "vocab_size=128"),
        ({"vocab_size": 1000}, "vocab_size=1000"),
        ({"source": "synthetic", "vocab_size": 1}, "vocab_size=1"),
        ({"num_samples": 0}, "num_samples=0"),
        ({"num_val_samples": 0}, "num_val_samples=0"),
        ({"num_workers": -2}, "num_workers=-2"),
        ({"seed": -1}, "seed=-1"),
    ],
)
def test_datamodule_bad_arguments(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        TokenDataModule(**kwargs)


def test_datamodule_choices_named_in_error():
    with pytest.raises(ValueError, match="stdlib.*synthetic"):
        TokenDataModule(source="nope")


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_datamodule_batches_without_trainer(source):
    dm = TokenDataModule(source=source, seq_len=32, batch_size=4, max_bytes=100_000, num_samples=64, num_val_samples=16)
    assert dm.data_parallel_world() == (1, 0)
    dm.setup("fit")
    assert dm.dropped_samples == {"train": 0, "val": 0}
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()):
        assert not loader.persistent_workers and not loader.pin_memory and not loader.drop_last
        batch = next(iter(loader))
        assert batch.dtype == torch.int64 and batch.shape == (4, 33)
    if source == "synthetic":
        assert len(dm.train_dataset) == 64 and len(dm.val_dataset) == 16
        # Validation is drawn from another stream than training.
        assert not torch.equal(dm.train_dataset[0], dm.val_dataset[0])


def test_datamodule_not_distributed_strategy():
    dm = TokenDataModule(source="synthetic", num_samples=10)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=None))
    assert dm.data_parallel_world() == (1, 0)


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
def test_datamodule_shards_exactly(source, num_replicas):
    # Sizes chosen so that most num_replicas leave a remainder: 103 train, 37 val synthetic samples;
    # stdlib windows depend on the corpus but the asserts hold for any length.
    kwargs = dict(source=source, seq_len=64, max_bytes=60_000, val_fraction=0.1, num_samples=103, num_val_samples=37)
    full = {}
    seen = {"train": [], "val": []}
    for rank in range(num_replicas):
        dm = TokenDataModule(**kwargs)
        dm.trainer = _fake_trainer(num_replicas, rank)
        dm.setup("fit")
        # The loaders' own samplers: shuffled for training, in order for evaluation.
        for split, loader in (("train", dm.train_dataloader()), ("val", dm.val_dataloader())):
            seen[split].extend(loader.sampler)
            full[split] = len(loader.dataset)
            assert dm.dropped_samples[split] == full[split] % num_replicas
    for split, indices in seen.items():
        kept = full[split] - full[split] % num_replicas
        assert kept > 0 and len(indices) == kept
        assert len(indices) == len(set(indices)), f"{split}: a sample is read twice per epoch"
    assert sorted(seen["val"]) == list(range(len(seen["val"]))), "val: samples skipped beyond the remainder"
    # The replicas together read the first samples of the order one process reads, whatever their number.
    alone = TokenDataModule(**kwargs)
    alone.setup("fit")
    order = list(alone.train_dataloader().sampler)
    assert sorted(seen["train"]) == sorted(order[:len(seen["train"])])
    if source == "synthetic":
        assert full == {"train": 103, "val": 37}


def test_datamodule_trains_under_lightning(tmp_path):
    import lightning.pytorch as pl

    seq_len, batch_size = 16, 4

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(256, 16)
            self.head = torch.nn.Linear(16, 256)

        def _loss(self, batch: torch.Tensor) -> torch.Tensor:
            assert batch.dtype == torch.int64 and batch.shape[1] == seq_len + 1
            logits = self.head(self.embed(batch[:, :-1]))  # (B, T, V)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = TokenDataModule(source="stdlib", seq_len=seq_len, batch_size=batch_size, max_bytes=50_000)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyLM(), datamodule=dm)
    assert trainer.global_step == 3
    assert dm.data_parallel_world() == (1, 0)


def test_datamodule_from_jsonargparse():
    jsonargparse = require("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(TokenDataModule, "data")
    cfg = parser.parse_string("data:\n  source: synthetic\n  seq_len: 8\n  num_samples: 12\n")
    dm = parser.instantiate_classes(cfg).data
    assert isinstance(dm, TokenDataModule) and dm.source == "synthetic" and dm.seq_len == 8


# ---------------------------------------------------------------------------- resumable loader
def _indices_loader(replicas: int, rank: int, batch_size: int, **kwargs) -> ResumableDataLoader:


    sampler = DistributedSampler(range(24), num_replicas=replicas, rank=rank, shuffle=True, seed=3)
    return ResumableDataLoader(list(range(24)), batch_size=batch_size, sampler=sampler, **kwargs)


@pytest.mark.parametrize("num_workers", [0, 2], ids=["in-process", "persistent-workers"])
def test_resumable_loader_continues_mid_epoch(num_workers: int) -> None:
    workers = {"num_workers": num_workers, "persistent_workers": num_workers > 0}
    uninterrupted = _indices_loader(2, 1, 2, **workers)
    epoch = [batch.tolist() for batch in uninterrupted]
    interrupted = _indices_loader(2, 1, 2, **workers)
    iterator = iter(interrupted)
    seen = [next(iterator).tolist() for _ in range(4)]
    state = interrupted.state_dict()
    assert state["batches_in_epoch"] == 4 and state["global_batch"] == 4

    resumed = _indices_loader(2, 1, 2, **workers)
    resumed.load_state_dict(state)
    rest = [batch.tolist() for batch in resumed]
    assert seen + rest == epoch  # nothing read twice, nothing left out
    assert len([batch for batch in resumed]) == len(epoch)  # the next epoch is whole again


def test_a_loader_left_mid_epoch_is_freed_at_once_and_its_workers_stop() -> None:
    """No reference cycle keeps a loader with worker processes alive after its last use: in one, the garbage collector
    closes the pool's queues before the workers are told to stop, and each is then waited for 5 s."""
    import gc
    import weakref

    loader = _indices_loader(2, 1, 2, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    workers, freed = list(loader._iterator._workers), weakref.ref(loader)
    gc.disable()
    try:
        del iterator, loader
        assert freed() is None
    finally:
        gc.enable()
    assert not any(worker.is_alive() for worker in workers)


def test_resumable_loader_after_an_ended_epoch_and_under_another_data_parallel_size() -> None:
    loader = _indices_loader(2, 0, 2)
    list(loader)
    ended = _indices_loader(2, 0, 2)
    ended.load_state_dict(loader.state_dict())
    assert len(list(ended)) == len(loader)  # an ended epoch is not skipped into

    # 3 batches x 2 samples x 2 replicas = 12 samples seen; one replica with batch 4 resumes after 3 batches.
    partial = _indices_loader(2, 0, 2)
    iterator = iter(partial)
    for _ in range(3):
        next(iterator)
    one_replica = _indices_loader(1, 0, 4)
    one_replica.load_state_dict(partial.state_dict())
    assert len(list(one_replica)) == len(one_replica) - 3
    # 12 samples is not a whole number of batches of 8: it resumes after 8 and says so.
    wide = _indices_loader(1, 0, 8)
    with pytest.warns(UserWarning, match="not a whole number of this run's global batch"):
        wide.load_state_dict(partial.state_dict())
    assert len(list(wide)) == len(wide) - 1
