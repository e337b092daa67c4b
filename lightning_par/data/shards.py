"""Streaming prepared token shards (``lightning_par.data.prepare``) on one data-parallel replica, with litdata's
``StreamingDataset``, ``CombinedStreamingDataset`` and ``StreamingDataLoader``.

litdata shares a dataset's chunks out by *process*: it reads the world from ``torch.distributed``. In a layout the
ranks of one replica (its tensor, context and pipeline ranks) must read the same samples, so here every dataset is
told the data-parallel world instead (``num_replicas``, ``rank``: the strategy's ``distributed_sampler_kwargs``),
and every rank of a replica computes the same chunk plan: the same samples in the same order, with nothing sent
between them. One node is assumed in that world, so the plan never depends on where ranks run.

The loader is litdata's, with what exact resume needs under a layout (docs/data.md, "Resume"):

- its ``load_state_dict`` reads the data-parallel world too (litdata's reads the process world, and would take a
  same-size resume for a resize and replay data);
- the dataset's epoch is set from the loaded state (litdata leaves the main process's stale, and the next checkpoint
  would record the wrong epoch);
- a state saved before any batch was drawn since a load is the loaded one (litdata's moves its worker cursor on);
- only the first iteration after a load continues the loaded state (litdata forgets it only when its iterator runs
  out, which Lightning, stopping at ``len(loader)``, never lets happen: the next epoch would replay the resumed one);
- a weighted mixture has a length (the batches before its first source is expected to run out), so that Lightning
  fetches no batch ahead of the one it trains, which the saved state would count as trained.

Pure PyTorch plus litdata: no lightning import.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset, TokensLoader
from litdata.utilities.env import _DistributedEnv

__all__ = ["ReplicaLoader", "collate_tokens", "token_dataset", "token_mixture"]


def token_dataset(url: str, *, seq_len: int, num_replicas: int, rank: int, shuffle: bool, seed: int,
                  cache_dir: str | None = None) -> StreamingDataset:
    """Windows of ``seq_len + 1`` tokens of the shards at ``url``, this replica's share (non-overlapping windows cut
    inside each shard file: a file's last ``< seq_len + 1`` tokens are not read)."""
    dataset = StreamingDataset(url, item_loader=TokensLoader(block_size=seq_len + 1), shuffle=shuffle, seed=seed,
                               drop_last=True, cache_dir=cache_dir)
    dataset.distributed_env = _replica_world(num_replicas, rank)
    return dataset


def token_mixture(datasets: list[StreamingDataset], weights: Sequence[float] | None, *,
                  seed: int) -> CombinedStreamingDataset:
    """Samples drawn from ``datasets`` with probabilities ``weights`` (normalised), one draw sequence on every rank;
    the mixture's epoch ends when a source has given all its samples (the next epoch starts every source afresh).
    Without weights: every sample of every source once (drawn in proportion to the sources' sizes)."""
    if weights is None:
        return CombinedStreamingDataset(datasets, seed=seed, iterate_over_all=True)
    return CombinedStreamingDataset(datasets, seed=seed, weights=list(weights), iterate_over_all=False)


def collate_tokens(samples: list[torch.Tensor]) -> torch.Tensor:
    """A batch ``(B, seq_len + 1)`` of int64 token ids (the shards keep them as uint16 or int32)."""
    return torch.stack(samples).to(torch.int64)


def _replica_world(num_replicas: int, rank: int) -> _DistributedEnv:
    return _DistributedEnv(world_size=num_replicas, global_rank=rank, num_nodes=1)


class ReplicaLoader(StreamingDataLoader):
    """litdata's ``StreamingDataLoader`` for one data-parallel replica, resumed exactly (module docstring).

    ``sources`` describes what each dataset reads, one dict per dataset (``directory``, ``identity``: a hash of the
    prepared data, ``tokenizer``, ``fingerprint``: the tokenizer's): it is saved with the position, so that a resume
    on other data is refused and one on the same data moved elsewhere is taken."""

    SOURCES = "lightning_par_sources"  # the key of ``sources`` in the state

    def __init__(self, dataset: StreamingDataset | CombinedStreamingDataset, *, batch_size: int, num_workers: int,
                 num_replicas: int, rank: int, sources: list[dict[str, str]] | None = None) -> None:
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_tokens,
                         persistent_workers=False)
        self.replica_world = _replica_world(num_replicas, rank)
        self.sources = sources
        self._loaded_state: dict[str, Any] | None = None  # until a batch is drawn after load_state_dict
        self._resume_pending = False  # the next iteration continues the loaded state

    @property
    def is_mixture(self) -> bool:
        return isinstance(self.dataset, CombinedStreamingDataset)

    def __len__(self) -> int:
        if not self.is_mixture or self.dataset._iterate_over_all:
            return super().__len__()
        # Draws are random: the first source runs out near min over sources of (its samples / its weight).
        sources = self.dataset._datasets
        weights = self.dataset._weights
        samples = min(source.get_len(self.num_workers, self.batch_size) / weight
                      for source, weight in zip(sources, weights))
        return int(samples) // self.batch_size

    def __iter__(self) -> Iterator[Any]:
        if not self._resume_pending:
            self.restore = False  # the resumed epoch ended at Lightning's len(loader), not at the iterator's end
        self._resume_pending = False
        for batch in super().__iter__():
            self._loaded_state = None
            yield batch

    def state_dict(self) -> dict[str, Any]:
        if self._loaded_state is not None:
            return copy.deepcopy(self._loaded_state)
        state = copy.deepcopy(super().state_dict())  # litdata goes on changing the dict it returns
        if self.sources is not None:
            state[self.SOURCES] = copy.deepcopy(self.sources)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # litdata keeps the dict it is given, and changes it
        self._take_the_same_data(state)
        self._refuse_another_seq_len(state)
        self._refuse_a_mixture_resized(state)
        self._warn_of_a_rounded_resume(state)
        with _litdata_sees(self.replica_world):
            super().load_state_dict({key: copy.deepcopy(value) for key, value in state.items() if key != self.SOURCES})
        if isinstance(self.dataset, StreamingDataset):
            self.dataset.current_epoch = state["dataset"]["current_epoch"]
        self._loaded_state = state
        self._resume_pending = True

    def _datasets(self) -> list[StreamingDataset]:
        return list(self.dataset._datasets) if self.is_mixture else [self.dataset]

    def _saved_datasets(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        saved = state.get("dataset") or {}
        if not self.is_mixture:
            return [saved] if saved else []
        return [saved[key] for key in sorted(saved, key=int) if isinstance(saved[key], dict)]

    def _take_the_same_data(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose data was other than this run's (prepared again from other text, or with
        another tokenizer: the saved position would be read in other tokens), naming both; where it is the same data
        in another directory (moved, copied), read it there: litdata's state names the directory it was read from
        and refuses any other. A checkpoint saved without ``sources`` is taken as litdata takes it."""
        saved = state.get(self.SOURCES)
        if saved is None or self.sources is None:
            return
        if len(saved) != len(self.sources):
            raise ValueError(f"this checkpoint's data was read from {[s['directory'] for s in saved]} and this run's "
                             f"is {[s['directory'] for s in self.sources]}: resume on the same sources, or start the "
                             "data afresh (docs/data.md, 'Resume')")
        for was, now in zip(saved, self.sources):
            if was["fingerprint"] != now["fingerprint"]:
                raise ValueError(f"this checkpoint's data {was['directory']!r} was tokenized with {was['tokenizer']!r} "
                                 f"and this run's {now['directory']!r} with {now['tokenizer']!r}, which gives other "
                                 "ids: the saved position would be read in other tokens. Resume with the data of the "
                                 "checkpoint, or start the data afresh (docs/data.md, 'Resume')")
            if was["identity"] != now["identity"]:
                raise ValueError(f"this checkpoint's data {was['directory']!r} ({was['identity']}) is not this run's "
                                 f"{now['directory']!r} ({now['identity']}): it was prepared again from other text or "
                                 "in other shards, and the saved position would be read in other samples. Resume with "
                                 "the data of the checkpoint, or start the data afresh (docs/data.md, 'Resume')")
        for dataset, dataset_state in zip(self._datasets(), self._saved_datasets(state)):
            dataset_state["input_dir_path"] = dataset.input_dir.path
            dataset_state["input_dir_url"] = dataset.input_dir.url
        state[self.SOURCES] = copy.deepcopy(self.sources)

    def _refuse_another_seq_len(self, state: dict[str, Any]) -> None:
        """Samples of another length would be read from the saved position in other windows (litdata says so only at
        the first batch, in its own words)."""
        now = self._datasets()[0].item_loader._block_size
        saved = {source.get("item_loader", {}).get("block_size") for source in self._saved_datasets(state)}
        for was in saved - {None, now}:
            raise ValueError(f"this checkpoint's data was read in samples of seq_len + 1 = {was} tokens, and this "
                             f"run's are {now} (seq_len={now - 1}): resume with seq_len={was - 1}, or start the data "
                             "afresh (docs/data.md, 'Resume')")

    def _refuse_a_mixture_resized(self, state: dict[str, Any]) -> None:
        if not self.is_mixture:
            return
        saved = next(iter(self._saved_datasets(state)), {})
        was = (saved.get("world_size"), saved.get("num_workers"), saved.get("batch_size"))
        now = (self.replica_world.world_size, self.num_workers or 1, self.batch_size)
        if saved and was != now:
            raise ValueError(f"this checkpoint's data mixture was read by {was[0]} data-parallel replicas with "
                             f"num_workers={was[1]} and batch_size={was[2]}; litdata resumes a weighted mixture only "
                             f"on the same (this run: {now[0]} replicas, num_workers={now[1]}, batch_size={now[2]}). "
                             "Resume with those, or start the data afresh (docs/data.md, 'Resume')")

    def _warn_of_a_rounded_resume(self, state: dict[str, Any]) -> None:
        """litdata resumes on another data-parallel size or batch size at the last whole global batch of the new
        size: say how many samples are read again."""
        dataset_state = state.get("dataset", {})
        was = (dataset_state.get("world_size"), dataset_state.get("batch_size"))
        if self.is_mixture or None in was or was == (self.replica_world.world_size, self.batch_size):
            return
        from litdata.streaming.elastic import sample_in_epoch_from_state

        consumed = sample_in_epoch_from_state(dataset_state)
        global_batch = self.replica_world.world_size * self.batch_size
        if consumed % global_batch:
            warnings.warn(f"the checkpoint stopped {consumed} samples into its epoch on {was[0]} data-parallel "
                          f"replicas of batch_size {was[1]}, which is not a whole number of this run's global batch "
                          f"({self.replica_world.world_size} x {self.batch_size}); resuming after "
                          f"{consumed - consumed % global_batch}: {consumed % global_batch} samples are read again",
                          stacklevel=3)


@contextmanager
def _litdata_sees(world: _DistributedEnv) -> Iterator[None]:
    """litdata's loader detects the world itself while it loads a state: let it see the data-parallel one."""
    import litdata.streaming.dataloader as loader_module

    detect = loader_module._DistributedEnv.detect
    loader_module._DistributedEnv.detect = classmethod(lambda cls: world)  # type: ignore[method-assign]
    try:
        yield
    finally:
        loader_module._DistributedEnv.detect = detect  # type: ignore[method-assign]
