"""One named device mesh for every parallel dimension, and the sub-meshes techniques ask for.

The root mesh has the dimensions ``pp, dp_replicate, dp_shard, cp, tp``, outermost first: tensor
parallel is innermost so its heavy all-reduces stay on the fastest links (inside a node), pipeline
parallel is outermost because its point-to-point traffic tolerates slow links. Dimensions of size 1
are kept so that every technique can look its dimension up by name whatever the layout.

Flattened views (kept here, as PyTorch asks callers to keep them rather than re-slice the root):
- ``dp``          = dp_replicate x dp_shard: ranks that read different samples (data loader, DDP);
- ``dp_cp``       = dp_replicate x dp_shard x cp: ranks over which the loss is averaged;
- ``dp_shard_cp`` = dp_shard x cp: ranks that shard parameters under ZeRO-3 and host experts;
- ``cp_tp``       = cp x tp: ranks that hold parts of the same sequences under sequence parallel;
- ``data_parallel`` and ``tensor_parallel``: ``dp`` and ``tp`` under the names Lightning's
  ``ModelParallelStrategy`` gives its 2-D mesh, so that a LightningModule written for it
  (``self.device_mesh["tensor_parallel"]`` in ``configure_model``) runs unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_par.layout.config import ParallelConfig
from lightning_par.layout.dimensions import FLATTENED_DIMS, MESH_DIM_NAMES


class ExpertMeshes(NamedTuple):
    """The meshes of expert parallel (:meth:`ParallelMesh.experts`)."""

    ep: DeviceMesh  # 1-D: the ranks that split the experts between them (tokens go round it by all-to-all)
    shard: DeviceMesh  # what ZeRO-3 shards the experts over: 1-D, or 2-D (replicate, shard) under HSDP
    partition: DeviceMesh  # 1-D: the ranks of one replica holding the same experts (ZeRO-1/2 partition over it)
    replicas: DeviceMesh  # 1-D: every rank holding the same experts (their gradients are summed over it)


class ParallelMesh:
    """Owns the root :class:`DeviceMesh` and its named flattened sub-meshes (torchtitan's ParallelDims)."""

    def __init__(self, root: DeviceMesh) -> None:
        if root.mesh_dim_names != MESH_DIM_NAMES:
            raise ValueError(f"mesh dimensions must be {MESH_DIM_NAMES}, got {root.mesh_dim_names}")
        self.root = root
        self._flat = {name: root[dims]._flatten(name) for name, dims in FLATTENED_DIMS.items()}
        # One object per root dimension: slicing the root makes a new DeviceMesh each time, and a compiled block
        # whose DTensors meet two equal tp meshes (the parameters' and the pipeline's received activations')
        # traces one and rebuilds the other from the root with an op inductor cannot lower (torch 2.13).
        self._dims = {name: root[name] for name in MESH_DIM_NAMES}
        self._experts: dict[int, ExpertMeshes] = {}

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D mesh of a root dimension (``"tp"``) or of a flattened one (``"dp"``)."""
        if name in self._flat:
            return self._flat[name]
        if name in MESH_DIM_NAMES:
            return self._dims[name]
        raise KeyError(f"unknown mesh dimension {name!r}; known: {MESH_DIM_NAMES + tuple(FLATTENED_DIMS)}")

    def experts(self, ep: int) -> ExpertMeshes:
        """The ranks of ``dp_cp`` as seen by experts split over ``ep`` of them.

        Expert parallel borrows its ranks from ``dp_shard x cp``: consecutive groups of ``ep`` ranks there hold
        one copy of all experts between them; the ``dp_shard x cp / ep`` such groups of a replica, and the
        ``dp_replicate`` replicas, hold the same experts. ZeRO-3 shards them over the groups of a replica
        (torchtitan's "dp_shard_mod_ep") and replicates them over the replicas (HSDP). Made once per ``ep``:
        making a mesh creates process groups, a collective on every rank.
        """
        if ep not in self._experts:
            replicate, shard_cp = self.size("dp_replicate"), self.size("dp_shard_cp")
            names = ("ep_dp_replicate", "ep_dp_shard", "ep")
            experts = self["dp_cp"]._unflatten(0, (replicate, shard_cp // ep, ep), names)
            shard = experts[names[:2]] if replicate > 1 else experts["ep_dp_shard"]
            self._experts[ep] = ExpertMeshes(ep=experts["ep"], shard=shard, partition=experts["ep_dp_shard"],
                                             replicas=experts[names[:2]]._flatten("ep_replicas"))
        return self._experts[ep]

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        """This process's coordinate along ``name``."""
        return self[name].get_local_rank()

    def group(self, name: str) -> ProcessGroup:
        return self[name].get_group()

    @property
    def device_type(self) -> str:
        return self.root.device_type

    def sizes(self) -> dict[str, int]:
        return {name: self.size(name) for name in MESH_DIM_NAMES}

    def coordinates(self) -> dict[str, int]:
        """This rank's position on every root dimension, e.g. ``{"pp": 0, "dp_replicate": 1, ...}``."""
        return {name: self.local_rank(name) for name in MESH_DIM_NAMES}

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes().items())
        return f"ParallelMesh({sizes}, device_type={self.device_type!r})"


def build_mesh(config: ParallelConfig, device_type: str = "cpu") -> ParallelMesh:
    """The one named device mesh of ``config``'s layout over the initialized default process group.

    Validates against the process group's world size first (every rank computes the same answer, so a bad layout
    raises everywhere before any collective is issued).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_mesh() needs an initialized torch.distributed process group")
    config = config.validate(dist.get_world_size())
    return build_device_mesh(device_type, dict(zip(MESH_DIM_NAMES, config.mesh_shape())))


# The meshes built over the current default process group, by device type and shape (see build_device_mesh).
_BUILT: dict[tuple[str, tuple[int, ...]], ParallelMesh] = {}
_BUILT_IN: object = None  # the default group _BUILT's meshes belong to


def build_device_mesh(device_type: str, sizes: dict[str, int]) -> ParallelMesh:
    """The root mesh with ``sizes`` given for every name of :data:`MESH_DIM_NAMES`.

    Built once per shape and default process group, then shared: a mesh holds nothing of a run but its process
    groups, and every new group keeps a gloo transport thread per rank that wakes 100 times a second until the
    process ends (torch has no way to retire a mesh). A process that fits, validates and tests, or fits several
    models in turn, would otherwise pay for every earlier mesh's threads in each later step."""
    import torch.distributed as dist

    global _BUILT_IN
    if _BUILT_IN is not dist.group.WORLD:  # a new default group (a restart in place, a fake world): new groups
        _BUILT.clear()
        _BUILT_IN = dist.group.WORLD
    shape = tuple(sizes[name] for name in MESH_DIM_NAMES)
    key = (device_type, shape)
    if key not in _BUILT:
        _BUILT[key] = ParallelMesh(init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES))
    return _BUILT[key]
