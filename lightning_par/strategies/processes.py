"""MeshProcesses: the processes of a lightning_par run, started, watched and ended (the Lightning side).

The launchers and cluster environments are Lightning's own, unchanged: a plain script (Lightning starts the other
processes), SLURM, torchelastic/torchrun. On top of them this layer of :class:`~lightning_par.strategies.base.
MeshStrategy`:

- gives each process on a CPU machine its share of the cores, and starts the default process group (in a key space
  of its own under torchrun's restarts);
- runs the :class:`~lightning_par.health.fault_monitor.FaultMonitor`, so that when one rank dies or hangs every other names it and
  leaves within the timeout, and the process that launched the others kills what is left once the run failed;
- destroys the process group at exit while the interpreter is whole;
- runs the collectives Lightning asks of a strategy (barrier, broadcast, reduce over the data-parallel ranks).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_par.health.fault_monitor import (FLIGHT_RECORDER_ENTRIES, FaultMonitor, heartbeat_interval,
                                             is_communication_error, stop_processes)
from lightning_par.health.failure_text import ONE_TRACEBACK_VARIABLE, VERBOSE_HINT, VERBOSE_VARIABLE, one_line
from lightning_par.parallel.mesh import ParallelMesh

# Metrics logged with sync_dist are averaged over the ranks that saw different data. Ranks in the same
# tensor/pipeline group hold the same value, so including them would only cost bandwidth.
METRIC_GROUP = "dp_cp"

# Set when a run raised: the exit handlers then leave the process group alone instead of waiting for peers.
_RUN_FAILED = False
_STOPPING_LAUNCHED_RANKS = False  # the exit handler that stops launched ranks is registered


class DevicesOfTheRun:
    """The devices, nodes and sampler of a run, as Lightning's connectors set them: shared by the Trainer's strategies
    (:class:`MeshProcesses`) and Fabric's (``strategies/fabric.py``), which need a ``mesh``."""

    _num_nodes: int = 1
    parallel_devices: list[torch.device] | None
    local_rank: int
    mesh: ParallelMesh

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard by data-parallel rank: ranks of one tensor/context/pipeline group must read the same sample.
        return {"num_replicas": self.mesh.size("dp"), "rank": self.mesh.local_rank("dp")}


class MeshProcesses(DevicesOfTheRun, ParallelStrategy):
    """Process start-up, fault monitoring and collectives; ``timeout`` bounds every collective and every exit."""

    def __init__(self, *, process_group_backend: str | None, timeout: timedelta | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._process_group_backend = process_group_backend
        self._timeout = timeout or default_pg_timeout
        self._num_nodes = 1
        self._mesh: ParallelMesh | None = None  # built when the processes have started
        self._fault_monitor: FaultMonitor | None = None
        self._failed_with: BaseException | None = None  # the exception this run raised, until teardown

    @property
    def mesh(self) -> ParallelMesh:
        """The named device mesh (available from ``setup_environment`` on)."""
        return self._made(self._mesh, "mesh", "when the processes start (setup_environment)")

    def _made(self, value: Any, name: str, when: str) -> Any:
        """``value``, or a RuntimeError saying when the strategy makes it (asked for too early)."""
        if value is None:
            raise RuntimeError(f"{type(self).__name__}.{name} is made {when}")
        return value

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning injects its DistributedSampler only for strategies that say so

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _TrainerSubprocessLauncher(self.cluster_environment, self.num_processes,
                                                        self.num_nodes, grace=launched_ranks_grace(self._timeout))

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _prepare_process(self) -> None:
        """Threads, seed and ranks of this process, before anything is checked or connected."""
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # As torchrun does: processes sharing a machine's cores get a share each. With every process using
            # every core, configs/hybrid3d.yaml (8 ranks on 2 cores) took 79 s for 6 steps instead of 42 s.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if self.root_device.type == "cpu" and self.num_processes > cores:
            rank_zero_info(f"{self.num_processes} processes on a machine with {cores} CPU cores: they take turns on "
                           "the cores, so a step is slower than with fewer processes (right for checking a layout, "
                           "not for speed)")
        reset_seed()
        self.set_world_ranks()

    def _start_process_group(self) -> None:
        """Connect the ranks (the default process group) and start watching them."""
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device)
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        # The flight recorder names the collective that failed (read when the process group starts).
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        if getattr(self._launcher, "procs", None):  # Lightning's subprocess launchers (the Trainer's, Fabric's)
            # Once a failure is reported the others leave within their monitors' grace (3 heartbeats), a heartbeat
            # later at most; what is left then is killed.
            _stop_launched_ranks_at_failed_exit(self._launcher.procs, launched_ranks_grace(self._timeout))
        if not dist.is_initialized():
            if not _init_under_torchelastic(self.cluster_environment, self._process_group_backend, self._timeout,
                                            device_id):
                _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                                      device_id=device_id)
            atexit.register(_destroy_process_group_at_exit)
        if self.world_size > 1 and self._fault_monitor is None:
            store = dist.distributed_c10d._get_default_store()
            self._fault_monitor = FaultMonitor(store, self.global_rank, self.world_size,
                                               timeout=self._timeout.total_seconds())
            self._fault_monitor.start()

    def _enter(self, phase: str) -> None:
        """Publish what this rank is doing, for the report of a rank that fails or hangs."""
        if self._fault_monitor is not None:
            self._fault_monitor.enter(phase)

    @override
    def on_exception(self, exception: BaseException) -> None:
        global _RUN_FAILED
        _RUN_FAILED = True  # peers may be gone or stuck: do not wait for them at exit
        config = getattr(self, "parallel_config", None)
        if config is not None:  # parallel/ refuses with the fields' names: say them as the user wrote them
            config.spelling.spell_error(exception)
        self._failed_with = exception
        if self._fault_monitor is not None:
            # Name the rank and the collective; from here this rank exits within the timeout.
            report = self._fault_monitor.report(exception)
            exception.add_note(report)
            if os.environ.get(ONE_TRACEBACK_VARIABLE) and self._fault_monitor.failed_first:
                # Under the command line the run's first failure is said at once (before tearing down: Lightning
                # ends every rank when one exits), in one line, or whole when asked; the other ranks say theirs
                # only when asked (cli.main).
                _say_first_failure(exception, report, verbose=os.environ.get(VERBOSE_VARIABLE, "") not in ("", "0"))
                exception.lightning_par_reported = True
        super().on_exception(exception)

    def stop_watching(self) -> None:
        """Stop the fault monitor (at the end of a run)."""
        if self._fault_monitor is not None:
            self._fault_monitor.stop()
            self._fault_monitor = None

    @override
    def teardown(self) -> None:
        failed, self._failed_with = self._failed_with, None
        self.stop_watching()
        if failed is None:
            super().teardown()
            return
        try:
            super().teardown()
        except Exception as error:  # noqa: BLE001 - the run's own error is the one to report
            # A step that failed half-way can leave modules Lightning's teardown cannot move (FSDP2 between
            # gathering and resharding): that second error would hide the first, which Lightning re-raises.
            failed.add_note(f"(lightning_par: the teardown after this error also failed and was skipped: "
                            f"{type(error).__name__}: {error})")

    # ------------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over ``group``; by default over the data-parallel (x context-parallel) ranks."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._mesh is not None:
            group = self._mesh.group(METRIC_GROUP)
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def _init_under_torchelastic(environment: Any, backend: str, timeout: Any,
                             device_id: torch.device | None) -> bool:
    """Start the default process group in a key space of this restart attempt, when torchrun's agent hosts the
    store; return False (doing nothing) otherwise.

    torchrun's agent keeps one store across the restarts of ``--max-restarts`` (torch 2.13, its comment says
    otherwise; pytorch/pytorch#167288): the addresses the failed attempt's ranks published are still
    there, and a restarted rank connects to a dead port and fails. A prefix per attempt keeps them apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(environment.main_address, environment.main_port, environment.world_size(),
                           is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"lightning_par/attempt_{attempt}", client),
                            rank=environment.global_rank(), world_size=environment.world_size(), timeout=timeout,
                            device_id=device_id)
    return True


def _destroy_process_group_at_exit() -> None:
    """Destroy the process group while the interpreter is still whole.

    Left to interpreter finalization, gloo's worker threads can still hold work objects whose tensors need
    the GIL, and the process aborts ("terminate called without an active exception") after a run that
    succeeded (seen with torch 2.13 on CPU; pytorch/pytorch#190489). A bounded barrier first, so no rank
    tears down connections a peer is still using.
    """
    if _RUN_FAILED or not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        else:
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; a failed clean-up must not mask the run's result
        pass


def launched_ranks_grace(timeout: timedelta) -> float:
    """Seconds the ranks of a failed run are given to leave by themselves before they are killed: each rank's
    monitor makes it leave within 3 heartbeats of a reported failure (``lightning_par.health.fault_monitor``); 5 leave a margin."""
    return 5 * heartbeat_interval(timeout.total_seconds())


class LaunchedRanksObserver(_ChildProcessObserver):
    """Lightning's watcher of the ranks its subprocess launcher started, which kills them all and the launching
    process (rank 0) the moment one of them has failed, but only after ``grace`` seconds: every rank reports its own
    failure and leaves by itself within that time, so the command ends with its exit code and its report whole, not
    killed while rank 0 is still printing it (which on a loaded machine can take seconds)."""

    def __init__(self, child_processes: list[Any], grace: float) -> None:
        super().__init__(main_pid=os.getpid(), child_processes=child_processes)
        self._grace = grace

    @override
    def _terminate_all(self) -> None:
        time.sleep(self._grace)  # a daemon thread: if this process leaves meanwhile, nothing is killed by it
        super()._terminate_all()


class _TrainerSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher (the command runs again for every other rank of this machine), with the
    :class:`LaunchedRanksObserver`."""

    def __init__(self, *args: Any, grace: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grace = grace

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        start_ranks(self, self._grace)
        return function(*args, **kwargs)


def start_ranks(launcher: Any, grace: float) -> None:
    """What Lightning's subprocess launchers (the Trainer's, Fabric's) do before running the function: start the
    other ranks of this machine, watched by a :class:`LaunchedRanksObserver`."""
    launcher.cluster_environment.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    if not launcher.cluster_environment.creates_processes_externally:
        launcher._call_children_scripts()
        LaunchedRanksObserver(launcher.procs, grace).start()
    _set_num_threads_if_needed(num_processes=launcher.num_processes)


def _stop_launched_ranks_at_failed_exit(processes: list[Any], grace: float) -> None:
    """When this process, which started the other ranks (Lightning's subprocess launcher), exits after a failed run:
    wait up to ``grace`` for them to leave and kill what is left, so that the launching command returns only once
    no rank of the run is running. (Lightning reaps them only when a child fails.) At exit rather than at teardown,
    so that a script that catches the error and goes on keeps its ranks."""
    global _STOPPING_LAUNCHED_RANKS
    if _STOPPING_LAUNCHED_RANKS:
        return
    _STOPPING_LAUNCHED_RANKS = True

    def stop() -> None:
        if _RUN_FAILED:
            stop_processes(processes, grace=grace)

    atexit.register(stop)


def _say_first_failure(exception: BaseException, report: str, *, verbose: bool) -> None:
    """The run's first failure on stderr: its traceback when ``verbose``, else one line: the fault monitor's
    ``report`` for a failed collective (which rank died or hangs, in which collective), else the error's message (a
    refusal's own words; the type's name before any other error's); then how to see the traceback."""
    if verbose:
        traceback.print_exception(exception, file=sys.stderr)
    elif is_communication_error(exception):
        print(report, file=sys.stderr)
    else:
        print(f"lightning-par: error: {one_line(exception, ' '.join(str(exception).split()))}", file=sys.stderr)
    if not verbose:
        print(VERBOSE_HINT, file=sys.stderr)
    sys.stderr.flush()

