"""What ``lightning-par verify``'s reference trains on (lightning_par/data/drawn.py): the global batches one process
draws from a data module for a run of several data-parallel replicas are those the replicas of a correct run read,
for the project's map-style and streaming data modules and for a plain loader that Lightning shards."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_par.data import TokenDataModule
from lightning_par.data.drawn import OneProcessData, join_batches, samples_of


def _with_world(module: pl.LightningDataModule, replicas: int, rank: int) -> pl.LightningDataModule:
    """``module`` as a rank of a run reads it: the only part of a Trainer it reads is the strategy's sampler
    arguments."""
    kwargs = {"num_replicas": replicas, "rank": rank} if replicas > 1 else None
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs))
    module.setup("fit")
    return module


def _drawn(module: pl.LightningDataModule, replicas: int, epochs: int, seed: int = 0) -> list:
    data = OneProcessData(_with_world(module, 1, 0), replicas, seed)
    loader = data.train_dataloader()
    return [batch for _ in range(epochs) for batch in loader]


@pytest.mark.parametrize("replicas", [2, 3])
def test_the_global_batches_of_the_token_data_are_the_replicas_batches(replicas: int) -> None:
    """Two epochs of 35 synthetic samples (a remainder at 2 and 3 replicas), shuffled: micro-batch by micro-batch,
    the replicas' batches joined, with the epoch set as Lightning's loop sets it."""
    arguments = dict(source="synthetic", seq_len=8, batch_size=4, num_samples=35, num_val_samples=8)
    loaders = [_with_world(TokenDataModule(**arguments), replicas, rank).train_dataloader() for rank in range(replicas)]
    expected = []
    for epoch in range(2):
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        expected += [join_batches(list(batches)) for batches in zip(*loaders)]
    drawn = _drawn(TokenDataModule(**arguments), replicas, epochs=2)
    assert len(drawn) == len(expected) == 2 * ((35 // replicas + 3) // 4)
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected))
    assert not torch.equal(drawn[0], drawn[len(drawn) // 2])  # the second epoch is shuffled anew


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 11

    def __getitem__(self, index: int) -> dict:
        return {"x": torch.tensor([index, index * index]), "label": index % 2}


class _PlainData(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Squares(), batch_size=2, shuffle=True)


def test_a_plain_shuffled_loader_is_dealt_as_lightnings_sampler_deals_it() -> None:
    """A ``shuffle=True`` loader of 11 samples at 2 replicas: Lightning's DistributedSampler, seeded by the run's
    seed, pads the order with its first sample; the drawn micro-batches are what each replica's sampler gives."""
    seed, replicas = 7, 2
    shares = [DataLoader(_Squares(), batch_size=2, sampler=DistributedSampler(_Squares(), num_replicas=replicas,
                                                                                rank=rank, seed=seed))
              for rank in range(replicas)]
    expected = [join_batches(list(batches)) for batches in zip(*shares)]
    drawn = _drawn(_PlainData(), replicas, epochs=1, seed=seed)
    assert len(drawn) == 3 and [samples_of(batch) for batch in drawn] == [samples_of(batch) for batch in expected]
    assert drawn[0]["label"].tolist() == expected[0]["label"].tolist()


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(12).view(6, 2))


class _StreamData(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(), batch_size=2)


def test_an_iterable_loader_gives_its_batches_in_turn_to_the_replicas() -> None:
    drawn = _drawn(_StreamData(), replicas=2, epochs=1)
    # The third batch has no partner for the second replica: a run's replicas step together.
    assert [batch.tolist() for batch in drawn] == [[[0, 1], [2, 3], [4, 5], [6, 7]]]


def test_samples_compare_as_a_multiset() -> None:
    batch = {"tokens": torch.tensor([[1, 2], [3, 4], [1, 2]]), "weights": torch.tensor([0.5, 1.0, 0.5]).bfloat16()}
    reordered = {"tokens": batch["tokens"][[2, 1, 0]], "weights": batch["weights"][[2, 1, 0]]}
    assert samples_of(batch) == samples_of(reordered)
    assert samples_of(batch) != samples_of({"tokens": batch["tokens"][[0, 1, 1]], "weights": batch["weights"]})
