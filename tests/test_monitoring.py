"""Monitoring: the collective accounting per mesh dimension counts exactly what moved; layout names."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

from lightning_par.callbacks.layout import layout_table
from lightning_par.callbacks.progress import layout_name


def _count(rank: int, world_size: int) -> dict:
    import os

    import torch.distributed as dist

    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
    dist.init_process_group("gloo")
    from lightning_par.parallel.mesh import build_device_mesh
    from lightning_par.parallel.comm import CommunicationCounter

    mesh = build_device_mesh("cpu", {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2})
    counter = CommunicationCounter(mesh)
    dist.all_reduce(torch.ones(10), group=mesh.group("tp"))  # 40 bytes
    dist.all_reduce(torch.ones(3, dtype=torch.float64), group=mesh.group("tp"))  # 24 bytes
    gathered = torch.empty(14, dtype=torch.bfloat16)
    dist.all_gather_single(gathered, torch.ones(7, dtype=torch.bfloat16), group=mesh.group("dp"))  # 28 bytes out
    reduced = torch.empty(4)
    dist.reduce_scatter_tensor(reduced, torch.ones(8), group=mesh.group("dp_shard"))  # 32 bytes in
    dist.all_reduce(torch.ones(5), group=mesh.group("pp"))  # one rank: moves nothing, not counted
    first = {k: (v.bytes, v.calls) for k, v in counter.read().items()}
    dist.all_reduce(torch.ones(2), group=mesh.group("dp_cp"))
    second = {k: (v.bytes, v.calls) for k, v in counter.read().items()}
    dist.destroy_process_group()
    return {"first": first, "second": second}


def test_collective_accounting_per_dimension() -> None:
    """Message sizes (the larger of input and output) summed per dimension, between two readings."""
    for result in run_distributed(_count, 4):
        assert result["first"] == {"dp": (60, 2), "tp": (64, 2), "pp": (0, 0), "cp": (0, 0), "ep": (0, 0),
                                   "other": (0, 0)}
        assert result["second"]["dp"] == (8, 1) and result["second"]["tp"] == (0, 0)


def test_layout_names_and_table() -> None:
    sizes = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert layout_name(sizes) == "pp2·dp2·tp2"
    assert layout_name({name: 1 for name in sizes}) == "1"
    rows = [{"host": "node1", "pp": r // 4, "dp_replicate": 0, "dp_shard": r // 2 % 2, "cp": 0, "tp": r % 2}
            for r in range(8)]
    table = layout_table(sizes, rows).splitlines()
    assert table[0] == "| rank | host | pp (2) | dp_shard (2) | tp (2) |"
    assert table[2 + 5] == "| 5 | node1 | 1 | 0 | 1 |"


@pytest.mark.parametrize("bad", [{"peak_flops_per_device": 0.0}, {"window": 0}])
def test_throughput_monitor_arguments(bad: dict) -> None:
    from lightning_par.callbacks import ThroughputMonitor

    with pytest.raises(ValueError, match=next(iter(bad))):
        ThroughputMonitor(**bad)
