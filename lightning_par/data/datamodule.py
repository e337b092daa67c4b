"""``TokenDataModule``: next-token batches from the stdlib corpus or synthetic sequences, on ``WindowDataModule``,
which ``TextDataModule`` (local text files) shares.

Batches are plain ``LongTensor`` of shape ``(B, seq_len + 1)``; the model takes ``[:, :-1]`` as
inputs and ``[:, 1:]`` as targets.

Each loader carries its own ``DistributedSampler`` over the data-parallel world that
``trainer.strategy.distributed_sampler_kwargs`` names (Lightning keeps a loader's own
``DistributedSampler``). lightning-par's strategies set ``num_replicas`` to the *data-parallel* size (ranks in
one tensor/context/pipeline group must read the same samples), so this module never looks at the global rank.
The sampler drops the epoch's last ``len % num_replicas`` samples of its order (``drop_last=True``) instead of
repeating samples to even out the replicas, which would double-count them in training and skew validation
metrics. Its order is a permutation of the whole split seeded by the run's seed and the epoch, the same at every
data-parallel size: the replicas of a run together read the first samples of the order one process reads
(``lightning-par verify`` draws its reference so).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightning_par.data.corpus import SyntheticTokenDataset, TokenWindowDataset, load_stdlib_tokens
from lightning_par.data.resumable import ResumableDataLoader

__all__ = ["ShardedDataModule", "TokenDataModule", "WindowDataModule", "check_window_arguments",
           "data_parallel_world"]

_SOURCES = ("stdlib", "synthetic")
# Byte tokens take every value in [0, 256).
_BYTE_VOCAB = 256
# The synthetic validation split uses seed + 2**31: train seeds are < 2**31, so no configuration's
# validation stream is any configuration's training stream.
_VAL_SEED_OFFSET = 2**31


def data_parallel_world(trainer: Any) -> Tuple[int, int]:
    """``(num_replicas, rank)`` of this process's data-parallel replica: ``trainer``'s strategy's sampler arguments
    (the data-parallel mesh under lightning_par's strategies, a replica group's share under fault tolerance);
    ``(1, 0)`` without a trainer or a distributed strategy."""
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None)
    if not kwargs:
        return 1, 0
    return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))


class ShardedDataModule(pl.LightningDataModule):
    """A training and a validation split, trimmed for the data-parallel size and served by the resumable loader.
    Subclasses build each split's dataset in ``_build(split)``, ``split`` being ``"train"`` or ``"val"``."""

    def __init__(self, batch_size: int, num_workers: int, shuffle: bool) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        # Full datasets, built once and reused across setup() calls (fit, then validate/test).
        self._full: Dict[str, Dataset] = {}
        # The splits handed to the loaders, set by setup().
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None
        # Samples each epoch of a split leaves out at the last setup()'s data-parallel size, for logs and tests.
        self.dropped_samples: Dict[str, int] = {}
        self._reported: set = set()

    def _build(self, split: str) -> Dataset:
        """The whole dataset of ``split`` (``"train"`` or ``"val"``), built once: each subclass's own."""
        raise NotImplementedError(f"{type(self).__name__} must define _build(split)")

    # ------------------------------------------------------------------ sharding
    def data_parallel_world(self) -> Tuple[int, int]:
        """``(num_replicas, rank)`` the loaders' DistributedSampler uses; ``(1, 0)`` alone."""
        return data_parallel_world(self.trainer)

    @override
    def setup(self, stage: Optional[str] = None) -> None:
        """Build the split(s) that ``stage`` needs (once), and report the samples each epoch leaves out at the
        current data-parallel size."""
        num_replicas, _ = self.data_parallel_world()
        if stage in (None, "fit"):
            self.train_dataset = self._build("train")
        if stage in (None, "fit", "validate", "test"):
            self.val_dataset = self._build("val")
        for split, dataset in (("train", self.train_dataset), ("val", self.val_dataset)):
            if dataset is not None:
                self._report_left_out(split, len(dataset), num_replicas)

    def _report_left_out(self, split: str, samples: int, num_replicas: int) -> None:
        self.dropped_samples[split] = samples % num_replicas
        key = (split, samples, num_replicas)
        if self.dropped_samples[split] and key not in self._reported:
            self._reported.add(key)
            rank_zero_info(
                f"{type(self).__name__}: each epoch leaves out {samples % num_replicas} of {samples} {split} samples "
                f"so that {num_replicas} data-parallel ranks get {samples // num_replicas} each "
                "(DistributedSampler would otherwise repeat samples to even them out)."
            )

    # ------------------------------------------------------------------ loaders
    def _loader(self, dataset: Dataset, shuffle: bool, resumable: bool = False) -> DataLoader:
        num_replicas, rank = self.data_parallel_world()
        # Lightning's seed for the samplers it makes (seed_everything sets it; 0 without).
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=True)
        # The training loader resumes mid-epoch where its checkpoint was taken (see data/resumable.py).
        return (ResumableDataLoader if resumable else DataLoader)(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=False,
            num_workers=self.num_workers,
            pin_memory=False,
            # Re-forking workers every epoch costs seconds; keep them only when there are any.
            persistent_workers=self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        return self._loader(self.train_dataset, shuffle=self.shuffle, resumable=True)

    @override
    def val_dataloader(self) -> DataLoader:
        if self.val_dataset is None:
            self.setup("validate")
        return self._loader(self.val_dataset, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        # No separate test split: the held-out validation documents serve for both.
        if self.val_dataset is None:
            self.setup("test")
        return self._loader(self.val_dataset, shuffle=False)


class WindowDataModule(ShardedDataModule):
    """Next-token windows ``(B, seq_len + 1)`` of a token stream per split (see :class:`ShardedDataModule`)."""

    def __init__(self, seq_len: int, batch_size: int, num_workers: int, shuffle: bool) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, shuffle=shuffle)
        self.seq_len = seq_len


class TokenDataModule(WindowDataModule):
    """Token batches for language-model training, with no download.

    Args:
        source: ``"stdlib"`` (the Python standard library sources as bytes, vocab 256) or
            ``"synthetic"`` (arithmetic progressions, see ``SyntheticTokenDataset``).
        seq_len: tokens per sample fed to the model; each sample holds ``seq_len + 1`` tokens.
        batch_size: samples per batch on each data-parallel rank.
        max_bytes: stdlib only: bytes of corpus to load, both splits together.
        val_fraction: stdlib only: share of documents (and bytes) held out for validation.
        vocab_size: token range; must be 256 for ``"stdlib"`` (byte tokens).
        num_samples: synthetic only: training samples.
        num_val_samples: synthetic only: validation samples.
        seed: synthetic only: seed of the sample generator.
        num_workers: DataLoader worker processes (0 loads in the main process).
        shuffle: shuffle the training set (Lightning's DistributedSampler shuffles when sharding).
    """

    def __init__(
        self,
        source: str = "stdlib",
        seq_len: int = 128,
        batch_size: int = 8,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.05,
        vocab_size: int = 256,
        num_samples: int = 4096,
        num_val_samples: int = 256,
        seed: int = 0,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        _validate_args(
            source=source,
            seq_len=seq_len,
            batch_size=batch_size,
            max_bytes=max_bytes,
            val_fraction=val_fraction,
            vocab_size=vocab_size,
            num_samples=num_samples,
            num_val_samples=num_val_samples,
            seed=seed,
            num_workers=num_workers,
        )
        super().__init__(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers, shuffle=shuffle)
        self.save_hyperparameters()
        self.source = source
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.vocab_size = vocab_size
        self.num_samples = num_samples
        self.num_val_samples = num_val_samples
        self.seed = seed

    def _build(self, split: str) -> Dataset:
        if split not in self._full:
            if self.source == "stdlib":
                tokens = load_stdlib_tokens(split, max_bytes=self.max_bytes, val_fraction=self.val_fraction)
                self._full[split] = TokenWindowDataset(tokens, self.seq_len)
            else:
                train = split == "train"
                self._full[split] = SyntheticTokenDataset(
                    num_samples=self.num_samples if train else self.num_val_samples,
                    seq_len=self.seq_len,
                    vocab_size=self.vocab_size,
                    seed=self.seed if train else self.seed + _VAL_SEED_OFFSET,
                )
        return self._full[split]


def _validate_args(
    *,
    source: str,
    seq_len: int,
    batch_size: int,
    max_bytes: int,
    val_fraction: float,
    vocab_size: int,
    num_samples: int,
    num_val_samples: int,
    seed: int,
    num_workers: int,
) -> None:
    """Raise ``ValueError`` naming the bad value, before any rank builds a loader."""
    if source not in _SOURCES:
        raise ValueError(f"source={source!r} is not one of {list(_SOURCES)}")
    check_window_arguments(seq_len=seq_len, batch_size=batch_size, val_fraction=val_fraction, num_workers=num_workers)
    for name, value in (("max_bytes", max_bytes), ("num_samples", num_samples), ("num_val_samples", num_val_samples)):
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be positive")
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size!r} must be at least 2")
    # Bytes span [0, 256): a larger vocabulary would promise tokens the corpus never has, a smaller
    # one would index past the model's embedding table.
    if source == "stdlib" and vocab_size != _BYTE_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size!r} does not fit source='stdlib', whose byte tokens need "
            f"vocab_size={_BYTE_VOCAB}"
        )
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed={seed!r} must be in [0, 2**31)")


def check_window_arguments(*, seq_len: int, batch_size: int, val_fraction: float, num_workers: int) -> None:
    """Raise ``ValueError`` naming the bad value among the arguments every ``WindowDataModule`` takes."""
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be a positive integer")
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be positive")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1)")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r} must be >= 0")
