"""Fault-tolerant HSDP across replica groups with torchft (plain PyTorch + torchft; no Lightning).

Each replica group is its own job (its own ``torchrun``, its own default process group): FSDP2 shards the model over
the group's ranks, and the groups replicate it. Across groups the gradients are averaged by torchft's ``Manager``
(``torchft/manager.py``): every step starts a quorum through the lighthouse (``Manager.start_quorum``), each FSDP2
unit's reduce-scatter output is all-reduced over ``ManagedProcessGroup(manager)`` (``torchft/process_group.py``) by
``FSDPModule.set_all_reduce_hook`` (torchtitan's ``maybe_set_all_reduce_hook``), and the optimizer steps only when
``Manager.should_commit()`` says every rank of the group got through (``torchft.Optimizer``, ``torchft/optim.py``).
A group that restarts (or falls behind) is healed by torchft: in its quorum the lighthouse names a group at the
highest step, which sends its state dict (``Manager._async_quorum`` -> ``checkpoint_transport.send_checkpoint``);
the healing group contributes zeros to that step's all-reduce, loads the state in ``should_commit`` and applies the
averaged gradient, so it leaves the step equal to the others.

What this module offers the Lightning strategy (``lightning_par/strategies/fault_tolerant.py``):
:class:`FaultTolerance` (the settings, checked), :func:`group_store`, :func:`make_manager`,
:func:`average_across_replicas` (the FSDP2 hooks), :class:`ReplicaState` (what a healthy group sends),
:func:`first_quorum`, :class:`StepThroughManager` (the optimizer step) and :func:`data_parallel_split`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # an older torch without custom reduce-scatters: nothing to undo
    DefaultReduceScatter = None  # type: ignore[assignment,misc]

__all__ = ["FaultTolerance", "ReplicaState", "StepThroughManager", "average_across_replicas", "data_parallel_split",
           "first_quorum", "group_store", "make_manager", "torchft_available"]

LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"  # torchft's own (torchft/manager.py reads it too)
GROUP_VARIABLE = "REPLICA_GROUP_ID"  # torchtitan's name for it
_KEYS = ("replica_groups", "min_replicas", "spares", "lighthouse", "replica_group_id", "timeout", "quorum_timeout")
_registered = itertools.count()  # c10d backend names must be unique in a process


def torchft_available() -> bool:
    """Whether ``import torchft`` works (it needs the opentelemetry packages too)."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class FaultTolerance:
    """The ``fault_tolerance`` option, resolved and checked (every ``ValueError`` before any process group).

    Args:
        replica_groups: R, the number of replica groups (each its own launch of ``WORLD_SIZE`` ranks).
        min_replicas: the fewest groups a step commits with (torchft's ``min_replica_size``).
        spares: keep the global batch fixed: ``min_replicas`` groups take part in every step and the others stand by
            as spares (they train along, contributing nothing, and take the place of a group that fails: torchft's
            ``WorldSizeMode.FIXED_WITH_SPARES``). False (the default): every group that is up takes part, and the
            global batch shrinks while a group is away (``DYNAMIC``).
        lighthouse: the torchft lighthouse, ``http://host:port``; by default ``$TORCHFT_LIGHTHOUSE``.
        replica_group_id: this group's index in ``[0, R)``; by default ``$REPLICA_GROUP_ID``.
        timeout: torchft's timeout for collectives, commits and checkpoint transfers, in seconds.
        quorum_timeout: how long a quorum may take, in seconds (it must cover a group's start-up).
    """

    replica_groups: int
    min_replicas: int
    lighthouse: str
    replica_group_id: int
    spares: bool = False
    timeout: float = 60.0
    quorum_timeout: float = 120.0

    @classmethod
    def from_option(cls, option: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> FaultTolerance:
        """Read the strategy's ``fault_tolerance`` dict, filling ``lighthouse`` and ``replica_group_id`` from the
        environment; raise a ValueError naming the value and what fits."""
        if not isinstance(option, Mapping):
            raise ValueError(f"fault_tolerance={option!r}: expected a dict with keys {', '.join(_KEYS)}")
        unknown = sorted(set(option) - set(_KEYS))
        if unknown:
            raise ValueError(f"fault_tolerance has unknown keys {unknown}; the keys are {', '.join(_KEYS)}")
        groups = option.get("replica_groups")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"fault_tolerance.replica_groups={groups!r}: give the number of replica groups, an "
                             "integer >= 1")
        least = option.get("min_replicas", 1)
        if isinstance(least, bool) or not isinstance(least, int) or not 1 <= least <= groups:
            raise ValueError(f"fault_tolerance.min_replicas={least!r}: must be an integer in [1, {groups}] "
                             f"(replica_groups={groups})")
        lighthouse = option.get("lighthouse") or environ.get(LIGHTHOUSE_VARIABLE)
        if not lighthouse:
            raise ValueError(f"fault_tolerance.lighthouse is not set and ${LIGHTHOUSE_VARIABLE} is empty: give the "
                             "torchft lighthouse's address, e.g. http://host:29510 (start it with "
                             "`torchft_lighthouse --min_replicas K --bind [::]:29510`)")
        group = option.get("replica_group_id")
        if group is None:
            group = environ.get(GROUP_VARIABLE)
            if group is None:
                raise ValueError(f"fault_tolerance.replica_group_id is not set and ${GROUP_VARIABLE} is empty: give "
                                 f"each replica group its index in [0, {groups})")
            try:
                group = int(group)
            except ValueError:
                raise ValueError(f"${GROUP_VARIABLE}={group!r}: expected an integer in [0, {groups})") from None
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < groups:
            raise ValueError(f"fault_tolerance.replica_group_id={group!r}: must be in [0, {groups}) "
                             f"(replica_groups={groups})")
        spares = option.get("spares", False)
        if not isinstance(spares, bool) or (spares and least >= groups):
            raise ValueError(f"fault_tolerance.spares={spares!r} with min_replicas={least} and replica_groups={groups}: "
                             "spares are the groups beyond min_replicas, so give min_replicas < replica_groups (or "
                             "spares: false)")
        timeouts = {k: float(option[k]) for k in ("timeout", "quorum_timeout") if option.get(k) is not None}
        return cls(groups, least, str(lighthouse), group, spares, **timeouts)


def data_parallel_split(config: FaultTolerance, group_size: int, group_rank: int) -> tuple[int, int]:
    """``(num_replicas, rank)`` for the sampler: every rank of every group reads its own samples, as the ranks of
    one HSDP job would (torchtitan's ``get_dp_info``: ``R * S`` readers, rank ``G * S + s``)."""
    return config.replica_groups * group_size, config.replica_group_id * group_size + group_rank


def group_store(broadcast: Callable[[Any], Any], rank: int) -> tuple[tuple[str, int], Any]:
    """A TCPStore of this launch attempt for the Manager, hosted by group rank 0 on a free port: returns its
    ``(host, port)`` on every rank, and the server (rank 0; None elsewhere), which the caller keeps alive.

    torchft's Manager writes its server's address unprefixed into the store it is given (manager.py, ``manager_addr``);
    torchrun's agent store outlives a restart, so a restarted rank would read the dead attempt's address. A fresh
    store per attempt avoids that (torchft's ``manager_integ_test.py`` does the same). ``broadcast`` is over the group.
    """
    server = dist.TCPStore(_host(), 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    address = broadcast((_host(), server.port) if server is not None else None)
    return address, server


def _host() -> str:
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def make_manager(config: FaultTolerance, *, rank: int, world_size: int, store: tuple[str, int],
                 load_state_dict: Callable[[Any], None] | None = None,
                 state_dict: Callable[[], Any] | None = None) -> Any:
    """torchft's ``Manager`` for this rank of the group, over a gloo ``ProcessGroupGloo`` that torchft rebuilds for
    every quorum (``torchft/process_group.py``). Asynchronous quorum: it runs behind the forward pass, and a healing
    group contributes zeros to its first step. State fns are registered afterwards (:class:`ReplicaState`)."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.manager import WorldSizeMode

    timeout = timedelta(seconds=config.timeout)
    mode = WorldSizeMode.FIXED_WITH_SPARES if config.spares else WorldSizeMode.DYNAMIC
    return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                   min_replica_size=config.min_replicas, world_size_mode=mode, use_async_quorum=True, timeout=timeout,
                   quorum_timeout=timedelta(seconds=config.quorum_timeout), connect_timeout=timeout,
                   rank=rank, world_size=world_size, store_addr=store[0], store_port=store[1],
                   lighthouse_addr=config.lighthouse, replica_id=f"replica_group_{config.replica_group_id}")


def average_across_replicas(module: nn.Module, manager: Any) -> list[nn.Module]:
    """Average each FSDP2 unit's reduced gradient shard across the replica groups: after the unit's reduce-scatter
    (AVG inside the group), an all-reduce over ``ManagedProcessGroup(manager)``, which sums over the groups of the
    quorum and divides by ``num_participants()`` (``Manager.allreduce``); HSDP's arithmetic. Returns the units.

    lightning_par's ``BackgroundReduceScatter`` (``parallel/background_reduce.py``), which a 1-D FSDP2 mesh on a CPU
    gets, finishes the reduce-scatter later; the hook reads its output at once, so the units get FSDP2's own back.
    """
    from torchft.process_group import ManagedProcessGroup

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("fault_tolerance needs the model sharded with FSDP2 (zero_stage=3): no FSDP2 unit found")
    group = ManagedProcessGroup(manager).register(f"lightning_par_replicas_{next(_registered)}")

    def hook(reduced: Tensor) -> None:
        dist.all_reduce(reduced, op=dist.ReduceOp.AVG, group=group)

    for unit in units:
        if DefaultReduceScatter is not None and hasattr(unit, "set_custom_reduce_scatter"):
            unit.set_custom_reduce_scatter(DefaultReduceScatter())
        unit.set_all_reduce_hook(hook)
    return units


def local_tensors(module: nn.Module) -> dict[str, Tensor]:
    """This rank's pieces of ``module``'s state (the DTensor shards' local tensors), sharing storage with the
    parameters. Taken once, on the main thread: FSDP2's ``state_dict()`` re-registers parameters and must not run on
    torchft's quorum thread while a step runs (it broke a backward: "setStorage ... of size 0")."""
    return {name: value.to_local() if isinstance(value, DTensor) else value
            for name, value in module.state_dict().items()}


class ReplicaState:
    """What a healthy group sends to a healing one, registered with the Manager (``register_state_dict_fn``):

    - ``model``: this rank's shards (:func:`local_tensors`, taken at set-up), loaded by copying in place: group rank
      ``r`` heals from rank ``r`` of the sender (``Manager._async_quorum``), whose shards have the same shapes;
    - ``optimizer``: the optimizer's live ``state_dict()`` (read-only on the quorum thread);
    - ``extra``: whatever ``extra()`` returns (the trainer's counters, taken on the main thread between steps), handed
      to ``load_extra`` when the healed state is applied.

    The send happens on the quorum thread while the sender's forward runs: its parameters and optimizer states do not
    change until its ``should_commit``, which blocks until the transfer is done (``HTTPTransport.disallow_checkpoint``).
    """

    def __init__(self, manager: Any, module: nn.Module, optimizer: Optimizer, *, extra: Callable[[], Any],
                 load_extra: Callable[[Any], None]) -> None:
        self.shards = local_tensors(module)
        self.optimizer = optimizer
        manager.register_state_dict_fn("model", self.load_model, lambda: self.shards)
        manager.register_state_dict_fn("optimizer", optimizer.load_state_dict, optimizer.state_dict)
        manager.register_state_dict_fn("extra", load_extra, extra)

    def load_model(self, shards: Mapping[str, Tensor]) -> None:
        missing = sorted(set(self.shards) - set(shards))
        if missing:
            raise RuntimeError(f"the healing state lacks {missing[:5]}: the replica groups run different models")
        with torch.no_grad():
            for name, mine in self.shards.items():
                theirs = shards[name]
                if theirs.shape != mine.shape:
                    raise RuntimeError(f"{name}: the sender's shard is {tuple(theirs.shape)}, this rank's "
                                       f"{tuple(mine.shape)}; every replica group must have the same size")
                mine.copy_(theirs)


def first_quorum(manager: Any, device: torch.device) -> tuple[bool, Any | None]:
    """Run this group's first quorum to the end. Returns whether the first step may use it (else it starts its own)
    and, when this group heals in it, the ``extra`` part of the state it received.

    - A restarted group (the quorum's highest step is ahead of it) heals: it gets the state of a group at that step.
      Model and optimizer are applied by ``should_commit`` in the first step, which uses this quorum and contributes
      zeros to its all-reduces; the ``extra`` part (the trainer's counters) is returned now, as the trainer needs it
      before its loop starts.
    - When every group of the quorum is at step 0 (a fresh start), torchft's ``init_sync`` heals all groups but one
      from that one, and a healing group's gradient would count as zeros in the first step. So that quorum is settled
      here, as a step without a gradient: one all-reduce (the sender serves its state until its ``should_commit``;
      the all-reduce waits until every healing group has received it) and ``should_commit`` (applies it). The first
      training step then starts a quorum of its own in which every group takes part.
    """
    manager.start_quorum()
    manager.wait_quorum()
    if manager.errored() is not None:
        raise RuntimeError(f"the first torchft quorum failed: {manager.errored().original_exception!r}")
    if manager.current_step() == 0:
        manager.allreduce(torch.zeros(1, device=device)).wait()
        if not manager.should_commit():
            raise RuntimeError(f"the first torchft quorum did not commit: {manager.errored()!r}")
        return False, None
    # The received state waits in the Manager until should_commit applies it; read (not applied) here. torchft has no
    # public accessor for it (torchft-nightly 2026.10.26, manager.py `_pending_state_dict`).
    pending = getattr(manager, "_pending_state_dict", None)
    if manager.is_participating() or pending is None:
        return True, None
    if not isinstance(pending, Mapping) or "extra" not in pending.get("user", {}):
        raise RuntimeError("torchft healed this replica group but its received state is not where this torchft "
                           "version was seen to keep it (Manager._pending_state_dict['user']['extra'])")
    return True, pending["user"]["extra"]


class StepThroughManager:
    """The optimizer a Lightning precision plugin steps under fault tolerance: ``step(closure)`` runs the closure
    (forward, backward with the cross-group all-reduces, clipping), then ``torchft.Optimizer.step()``, which applies a
    pending heal and steps the wrapped optimizer only if ``Manager.should_commit()``; ``not_committed()`` is called
    when it did not (a group failed inside the step: torchft's step count stays). Everything else is the wrapped
    optimizer's (``param_groups`` for clipping and monitors)."""

    def __init__(self, optimizer: Optimizer, managed: Any, not_committed: Callable[[], None]) -> None:
        self._optimizer = optimizer
        self._managed = managed
        self._not_committed = not_committed

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        before = self._managed.manager.current_step()
        self._managed.step()
        if self._managed.manager.current_step() == before:
            self._not_committed()
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
