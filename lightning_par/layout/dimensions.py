"""The dimensions of a layout and the order of the one device mesh.

The root mesh has the dimensions ``pp, dp_replicate, dp_shard, cp, tp``, outermost first: tensor parallel is innermost
so that its heavy all-reduces stay on the fastest links (inside a node), pipeline parallel outermost because its
point-to-point traffic tolerates slow links (docs/architecture.md, "One mesh, named dimensions").
"""

from __future__ import annotations

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: Flattened views of the root mesh, by the dimensions they join (``lightning_par.parallel.mesh``).
FLATTENED_DIMS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "cp_tp": ("cp", "tp"),
    "data_parallel": ("dp_replicate", "dp_shard"),
    "tensor_parallel": ("tp",),
}

__all__ = ["FLATTENED_DIMS", "MESH_DIM_NAMES"]
