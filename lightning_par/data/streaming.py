"""``StreamingTokenDataModule``: pretraining batches streamed from token shards prepared once
(``lightning_par.data.prepare``), each data-parallel replica reading its own share, with memory and start-up time
that do not grow with the corpus (docs/data.md).

Every rank checks, in ``setup`` and before any batch: that each source was prepared to the end and that its shard
files are whole; that every source was prepared with one tokenizer, the model's where it is known (``tokenizer=``,
or the tokenizer saved in the model's pretrained directory); that the tokenizer's vocabulary fits the model's
embedding; that a replica gets at least one batch. Every rank reads the same files, so every rank raises the same
error before any collective.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from typing import Any, Dict, List, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_par.data.datamodule import check_window_arguments, data_parallel_world
from lightning_par.data.documents import BYTES, load_document_tokenizer
from lightning_par.data.prepare import PreparedData, decoding_arguments, is_prepared, read_prepared
from lightning_par.data.shard_windows import StreamedTraining
from lightning_par.data.text import model_vocab_size, pretrained_directory

__all__ = ["StreamingTokenDataModule"]

# What litdata reads as the world of the process it runs in: a prepare started from a rank of a run must not see it.
_LITDATA_WORLD_VARIABLES = ("WORLD_SIZE", "GLOBAL_RANK", "NNODES", "RANK", "LOCAL_RANK")


class StreamingTokenDataModule(pl.LightningDataModule):
    """Next-token batches ``(batch_size, seq_len + 1)`` of int64 ids streamed from prepared token shards.

    Args:
        data_dir: a directory (or object-store URL) written by ``lightning-par prepare``, or a weighted mixture of
            several: ``{directory: weight, ...}`` (weights positive, normalised; each batch's samples are drawn
            from the sources with those probabilities).
        seq_len: tokens per sample fed to the model; each sample holds ``seq_len + 1`` tokens.
        batch_size: samples per batch on each data-parallel replica.
        tokenizer: the tokenizer the model uses (a directory saved with ``save_pretrained``, or ``"bytes"``): the
            shards must have been prepared with it. Default: the one saved in the model's pretrained directory,
            else unchecked (the vocabulary still is).
        shuffle: visit shard files and the windows inside them in a seeded random order, new every epoch.
        seed: the seed of that order and of the mixture's draws.
        num_workers: loader worker processes (0 reads in the training process: the shards are memory-mapped).
        prepare_from: inputs to prepare ``data_dir`` from when it holds no prepared data yet (``"stdlib"``, files or
            directories, as ``lightning-par prepare --input``), on global rank 0 while the other ranks wait.
        val_fraction: with ``prepare_from``: the share of documents held out for validation.
        text_field: with ``prepare_from``: the JSON field or column holding the text.
        encoding, decode_errors: with ``prepare_from``: how its text files and JSON lines are decoded (as
            ``lightning-par prepare --encoding/--decode-errors``: UTF-8, a byte that is not refused by default).
        cache_dir: where litdata keeps the shards it downloads from an object store.
    """

    def __init__(
        self,
        data_dir: Union[str, Dict[str, float]],
        seq_len: int = 128,
        batch_size: int = 8,
        tokenizer: Optional[str] = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        prepare_from: Optional[Union[str, List[str]]] = None,
        val_fraction: float = 0.0,
        text_field: str = "text",
        encoding: str = "utf-8",
        decode_errors: str = "strict",
        cache_dir: Optional[str] = None,
    ) -> None:
        check_window_arguments(seq_len=seq_len, batch_size=batch_size, val_fraction=val_fraction,
                               num_workers=num_workers)
        self.sources = _sources(data_dir)
        decoding_arguments(encoding, decode_errors)  # refused here, before a prepare is started
        if prepare_from is not None and len(self.sources) > 1:
            raise ValueError(f"prepare_from prepares one directory, and data_dir is a mixture of {len(self.sources)}: "
                             "prepare each source with `lightning-par prepare` (docs/data.md)")
        if len(self.sources) > 1 and num_workers > 0:
            raise ValueError(f"num_workers={num_workers} with a mixture of {len(self.sources)} sources: litdata's "
                             "mixture resumes exactly only when read in the training process; use num_workers=0 "
                             "(the shards are memory-mapped, docs/data.md 'Loader throughput')")
        super().__init__()
        self.save_hyperparameters()
        # Lightning warns of any IterableDataset with a length read by loader workers, which could each read the
        # whole dataset: litdata gives each worker its own share of the shard files, so the length is right.
        warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined",
                                module=r"lightning\.pytorch\.utilities\.data")
        # Global rank 0 prepares into a directory every node sees (a shared file system or an object store).
        self.prepare_data_per_node = False
        self.seq_len, self.batch_size = seq_len, batch_size
        self.tokenizer, self.shuffle, self.seed, self.num_workers = tokenizer, shuffle, seed, num_workers
        self.prepare_from, self.val_fraction, self.text_field = prepare_from, val_fraction, text_field
        self.encoding, self.decode_errors = encoding, decode_errors
        self.cache_dir = cache_dir
        self.prepared: list[PreparedData] = []

    # ------------------------------------------------------------------ preparing
    @override
    def prepare_data(self) -> None:
        """With ``prepare_from``: prepare ``data_dir`` unless a finished prepare is there. In a process of its own,
        since litdata's writer reads the world of the process it runs in."""
        if self.prepare_from is None:
            return
        directory = next(iter(self.sources))
        if is_prepared(directory):
            return
        inputs = [self.prepare_from] if isinstance(self.prepare_from, str) else list(self.prepare_from)
        command = [sys.executable, "-m", "lightning_par.data.prepare", "--input", *inputs, "--output", directory,
                   "--tokenizer", self._tokenizer_name(), "--val-fraction", str(self.val_fraction),
                   "--text-field", self.text_field, "--encoding", self.encoding, "--decode-errors", self.decode_errors]
        environment = {name: value for name, value in os.environ.items() if name not in _LITDATA_WORLD_VARIABLES}
        rank_zero_info(f"Preparing {directory} from {inputs} once: later runs stream it (docs/data.md)")
        result = subprocess.run(command, env=environment, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise ValueError(f"preparing {directory!r} from {inputs} failed: {last}")

    def _tokenizer_name(self) -> str:
        if self.tokenizer is not None:
            return self.tokenizer
        pretrained = pretrained_directory(self._module())
        if pretrained is None:
            raise ValueError(f"prepare_from needs tokenizer= (a directory with a saved tokenizer, or {BYTES!r}): the "
                             "model has no pretrained directory to take it from")
        return pretrained

    # ------------------------------------------------------------------ checks
    @override
    def setup(self, stage: Optional[str] = None) -> None:
        """Read and check every source (module docstring)."""
        if self.prepared:
            return
        from lightning_par.data.shard_record import check_shard_files

        prepared = [read_prepared(directory) for directory in self.sources]
        for data in prepared:
            for split in data.splits:
                check_shard_files(data.split_url(split), data.shards[split] if data.shards else None)
        self._check_one_tokenizer(prepared)
        self._check_the_models_tokenizer(prepared[0])
        self._check_vocabulary(prepared[0])
        self.prepared = prepared
        if stage in (None, "fit") and len(self.train_dataloader()) == 0:
            tokens = sum(data.tokens["train"] for data in prepared)
            replicas, _ = self.data_parallel_world()
            raise ValueError(f"data_dir {list(self.sources)} holds {tokens} training tokens: fewer than one batch of "
                             f"{self.batch_size} samples of seq_len + 1 = {self.seq_len + 1} tokens for each of "
                             f"{replicas} data-parallel replicas; give more text, or a smaller seq_len or batch_size")

    def _check_one_tokenizer(self, prepared: list[PreparedData]) -> None:
        first = prepared[0]
        for data in prepared[1:]:
            if data.tokenizer["fingerprint"] != first.tokenizer["fingerprint"]:
                raise ValueError(f"the sources of the mixture were prepared with different tokenizers: "
                                 f"{first.directory!r} with {first.tokenizer['name']!r}, {data.directory!r} with "
                                 f"{data.tokenizer['name']!r}; prepare them with the model's")

    def _check_the_models_tokenizer(self, prepared: PreparedData) -> None:
        name = self.tokenizer or pretrained_directory(self._module())
        if name is None:
            return
        fingerprint = load_document_tokenizer(name).fingerprint
        if fingerprint != prepared.tokenizer["fingerprint"]:
            raise ValueError(f"{prepared.directory!r} was prepared with the tokenizer {prepared.tokenizer['name']!r}, "
                             f"which gives other ids than the model's ({name!r}): prepare it again with "
                             f"--tokenizer {name}")

    def _check_vocabulary(self, prepared: PreparedData) -> None:
        model_vocab = model_vocab_size(self._module())
        vocab = prepared.tokenizer["vocab_size"]
        if model_vocab is not None and vocab > model_vocab:
            raise ValueError(f"{prepared.directory!r} was prepared with the tokenizer {prepared.tokenizer['name']!r} of "
                             f"{vocab} tokens, more than the model's vocab_size={model_vocab}: use the model's "
                             "tokenizer, or a model with a vocabulary of at least that size")

    def _module(self) -> Any:
        return getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None

    # ------------------------------------------------------------------ loaders
    def data_parallel_world(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of this process's data-parallel replica: the strategy's sampler arguments (the
        data-parallel mesh under lightning_par's strategies, a replica group's share under fault tolerance)."""
        return data_parallel_world(self.trainer)

    def _loader(self, split: str, *, shuffle: bool, world: Optional[tuple[int, int]] = None) -> Any:
        from lightning_par.data.shards import ReplicaLoader, token_dataset, token_mixture

        if not self.prepared:
            self.setup(None)
        replicas, rank = world or self.data_parallel_world()
        sources = [(data, weight) for data, weight in zip(self.prepared, self.sources.values()) if split in data.splits]
        datasets = [token_dataset(data.split_url(split), seq_len=self.seq_len, num_replicas=replicas, rank=rank,
                                  shuffle=shuffle, seed=self.seed, cache_dir=self.cache_dir) for data, _ in sources]
        weights = [weight for _, weight in sources] if split == "train" else None  # validation: every source whole
        dataset = datasets[0] if len(datasets) == 1 else token_mixture(datasets, weights, seed=self.seed)
        described = [{"directory": data.directory, "identity": data.identity, "tokenizer": data.tokenizer["name"],
                      "fingerprint": data.tokenizer["fingerprint"]} for data, _ in sources]
        return ReplicaLoader(dataset, batch_size=self.batch_size, num_workers=self.num_workers,
                             num_replicas=replicas, rank=rank, sources=described if split == "train" else None)

    @override
    def train_dataloader(self) -> Any:
        return self._loader("train", shuffle=self.shuffle)

    def replica_dataloader(self, replica: int, replicas: int) -> Any:
        """The training loader of data-parallel replica ``replica`` of ``replicas``, in any process: how this module
        deals its shards to the replicas, which ``lightning-par verify``'s one-process reference reads where the
        order is litdata's own (shuffled, loader workers, a mixture; lightning_par/data/drawn.py)."""
        return self._loader("train", shuffle=self.shuffle, world=(replicas, replica))

    def streamed_training(self) -> StreamedTraining:
        """How this module streams its training split, for a reader of the shard files that shares no code with
        its loader (``lightning-par verify``'s reference, lightning_par/data/shard_windows.py)."""
        if not self.prepared:
            self.setup(None)
        sources = {data.directory: weight for data, weight in zip(self.prepared, self.sources.values())
                   if "train" in data.splits}
        return StreamedTraining(sources, self.seq_len, self.batch_size, in_documented_order=(
            not self.shuffle and len(sources) == 1 and self.num_workers == 0))

    @override
    def val_dataloader(self) -> Any:
        if not self.prepared:
            self.setup(None)
        if not any("val" in data.splits for data in self.prepared):
            return []  # prepared without a validation split: no validation
        return self._loader("val", shuffle=False)

    @property
    def document_separator(self) -> Optional[int]:
        """The token that closes each document in the shards (the tokenizer's end-of-sequence token), once set up:
        where ``HFCausalLM(packed_documents=True)`` keeps documents apart."""
        return int(self.prepared[0].tokenizer["eos_token_id"]) if self.prepared else None


def _sources(data_dir: Union[str, Dict[str, float]]) -> dict[str, float]:
    """``{directory: weight}``: one directory weighs 1."""
    if isinstance(data_dir, (str, os.PathLike)):
        return {str(data_dir): 1.0}
    if not isinstance(data_dir, dict) or not data_dir:
        raise ValueError(f"data_dir={data_dir!r} must be a prepared directory or a mixture {{directory: weight, ...}}")
    seen: dict[str, str] = {}
    for directory, weight in data_dir.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ValueError(f"data_dir: the weight of {directory!r} is {weight!r}; weights must be positive finite "
                             "numbers (they are normalised to sum to 1)")
        same = seen.setdefault(_source_identity(str(directory)), str(directory))
        if same != str(directory):
            raise ValueError(f"data_dir names one directory twice, as {same!r} and {str(directory)!r}: the mixture "
                             "would read it twice; name it once, with the sum of the two weights")
    return {str(directory): float(weight) for directory, weight in data_dir.items()}


def _source_identity(directory: str) -> str:
    """What ``directory`` is, whatever its spelling: a local path resolved (``a``, ``./a/`` and a link to it are one),
    a URL without its trailing slashes."""
    if "://" in directory and not directory.startswith("local:"):
        return directory.rstrip("/")
    return os.path.realpath(directory.removeprefix("local:"))
