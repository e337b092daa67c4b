"""A dry run's world: one rank of a process group of any size, in which collectives move nothing and tensors hold no
memory, so that the real layout code (mesh, splits, FSDP2 units, stages) runs at the target scale on one machine.

- :func:`fake_world` joins torch's ``fake`` backend as rank ``rank`` of ``world_size``: every collective returns at
  once, leaving its output as it was (torchtitan validates large configurations the same way, with
  ``COMM_MODE=fake_backend``).
- :class:`FakeAllocation` allocates a model built on the meta device as fake tensors (``FakeTensorMode``): shapes,
  dtypes and devices without storage. ``parallelize`` shards on the meta device first (FSDP2 cannot be applied under
  ``FakeTensorMode``) and allocates through it afterwards, as a run allocates real parameters after sharding.
- :func:`pipeline_metadata_through` carries what pipeline stages tell each other at their first step (the shapes of
  the tensors they will exchange) through a real key-value store shared by the dry runs of one pipeline's ranks,
  since the fake backend delivers nothing: a stage after the first learns its input's shape from its predecessor.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import datetime
import functools
import pickle
from collections import Counter
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from lightning_par.parallel.modules import materialize_meta_parameters

__all__ = ["FakeAllocation", "fake_world", "pipeline_metadata_through"]


@contextmanager
def fake_world(rank: int, world_size: int) -> Generator[None, None, None]:
    """Be rank ``rank`` of a default process group of ``world_size`` ranks on torch's fake backend."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of a world of {world_size}; fit: 0 to {world_size - 1}")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class FakeAllocation:
    """``parallelize``'s ``allocate``: parameters and buffers built on the meta device become fake tensors of
    ``mode``, initialised by the model's own ``init_weights``/``reset_parameters`` (which compute nothing there)."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def __call__(self, module: nn.Module, device: torch.device) -> bool:
        with self.mode:
            return materialize_meta_parameters(module, device)


@contextmanager
def pipeline_metadata_through(store: dist.Store, timeout_s: float = 600.0) -> Generator[None, None, None]:
    """Pipeline stages exchange their metadata through ``store`` (keys by sender, receiver and count), and take
    their mode vote on real tensors (``torch.distributed.pipelining`` reads the vote with ``.item()``, which a fake
    tensor cannot answer; on the fake backend nobody votes back, so every stage infers its shapes at run time, as
    stages without given shapes do in a run)."""
    from torch.distributed.pipelining import schedules, stage

    sent: Counter[tuple[int, int]] = Counter()
    received: Counter[tuple[int, int]] = Counter()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        pair = (dist.get_rank(), self._resolve_peer_global_rank(dst_stage))
        store.set(f"meta/{pair[0]}->{pair[1]}/{sent[pair]}", pickle.dumps(meta))
        sent[pair] += 1

    def recv_meta(self: Any, src_stage: int) -> Any:
        pair = (self._resolve_peer_global_rank(src_stage), dist.get_rank())
        key = f"meta/{pair[0]}->{pair[1]}/{received[pair]}"
        received[pair] += 1
        return pickle.loads(store.get(key))  # noqa: S301 - written by this dry run's own processes

    original_warmup = schedules._PipelineSchedule._warmup_p2p

    @functools.wraps(original_warmup)
    def warmup(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original_warmup(self, *args, **kwargs)

    patched = [(stage.PipelineStage, "_send_meta", send_meta), (stage.PipelineStage, "_recv_meta", recv_meta),
               (schedules._PipelineSchedule, "_warmup_p2p", warmup)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patched]
    for owner, name, replacement in patched:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
