"""ParallelConfig: every impossible layout is a clear ValueError; the mesh has the documented order."""

from __future__ import annotations

import pytest
from harness import run_distributed

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.mesh import build_mesh, MESH_DIM_NAMES


@pytest.mark.parametrize(
    ("config", "world_size", "message"),
    [
        (ParallelConfig(tp=3, pp=2), 8, r"pp=2 x tp=3 = 6 does not divide the world size 8; try tp=2 or tp=4"),
        (ParallelConfig(dp_shard=2, tp=2), 8, r"dp_shard=2 x tp=2 = 4 does not equal the world size 8"),
        # dp2 fixed: a hint must make the product the world size (6: tp=3), and on 3 processes nothing with dp2 does
        (ParallelConfig(dp_shard=2, tp=2), 6, r"= 4 does not equal the world size 6: .*; try tp=3$"),
        (ParallelConfig(dp_shard=2, tp=2), 3, r"= 4 does not equal the world size 3: .*no tp fits with the other sizes"),
        (ParallelConfig(dp_shard=1, dp_replicate=3), 2, r"dp_replicate=3 = 3 does not equal the world size 2"),
        (ParallelConfig(tp=0), 2, r"tp must be a positive integer, got 0"),
        (ParallelConfig(pp=-2), 2, r"pp must be a positive integer, got -2"),
        (ParallelConfig(cp=1.5), 2, r"cp must be a positive integer, got 1.5"),
        (ParallelConfig(tp=True), 2, r"tp must be a positive integer, got True"),
        (ParallelConfig(tp="two"), 2, r"tp must be a positive integer, got 'two'"),
        (ParallelConfig(tp="auto"), 2, r"tp='auto' is not supported: only the data-parallel sizes can be 'auto'"),
        (ParallelConfig(dp_shard="many"), 2, r"dp_shard must be a positive integer or 'auto', got 'many'"),
        (ParallelConfig(ep=3), 4, r"ep=3 does not divide dp_shard x cp = 4 x 1 = 4.*Try ep in \[1, 2, 4\]"),
        (ParallelConfig(dp_shard=1, dp_replicate=4, ep=2), 4, r"ep=2 does not divide dp_shard x cp = 1 x 1 = 1"),
        (ParallelConfig(ep=0), 2, r"ep must be a positive integer, got 0"),
        (ParallelConfig(gradient_compression="int8"), 2, r"gradient_compression='int8' is not one of"),
        (ParallelConfig(ddp_bucket_cap_mb=0), 2, r"ddp_bucket_cap_mb must be a positive number of MiB, got 0"),
        (ParallelConfig(ddp_static_graph="yes"), 2, r"ddp_static_graph must be true or false, got 'yes'"),
        (ParallelConfig(ddp_static_graph=True, ddp_find_unused_parameters=True), 2, r"exclude each other"),
        (ParallelConfig(), 0, r"world_size must be a positive integer, got 0"),
    ],
)
def test_invalid_layouts_raise_value_error(config: ParallelConfig, world_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config.validate(world_size)


@pytest.mark.parametrize(
    ("config", "world_size", "expected"),
    [
        (ParallelConfig(), 8, (1, 1, 8, 1, 1)),
        (ParallelConfig(tp=2, pp=2), 8, (2, 1, 2, 1, 2)),
        (ParallelConfig(dp_replicate="auto", dp_shard=2), 8, (1, 4, 2, 1, 1)),
        (ParallelConfig(dp_replicate="auto", dp_shard="auto", cp=2), 4, (1, 1, 2, 2, 1)),
        (ParallelConfig(dp_replicate=2, dp_shard=2, tp=2), 8, (1, 2, 2, 1, 2)),
        (ParallelConfig(ep=4, cp=2, dp_shard=2), 4, (1, 1, 2, 2, 1)),
    ],
)
def test_auto_sizes_resolve(config: ParallelConfig, world_size: int, expected: tuple[int, ...]) -> None:
    resolved = config.validate(world_size)
    assert resolved.mesh_shape() == expected
    assert resolved.validate(world_size) == resolved  # idempotent


# Strategy arguments refused at construction, in the strategies' own names: tests/bad_inputs.py.


def test_unresolved_config_refuses_mesh_shape() -> None:
    with pytest.raises(ValueError, match="still has 'auto' sizes"):
        ParallelConfig().mesh_shape()


def _mesh_coordinates(rank: int, world_size: int, sizes: dict) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        mesh = build_mesh(ParallelConfig(**sizes), "cpu")
        return {
            "dims": mesh.root.mesh_dim_names,
            "coords": mesh.coordinates(),
            "dp": (mesh.size("dp"), mesh.local_rank("dp")),
            "dp_cp": mesh.size("dp_cp"),
            "dp_shard_cp": mesh.size("dp_shard_cp"),
            "tp_ranks": sorted(dist.get_process_group_ranks(mesh.group("tp"))),
            "pp_ranks": sorted(dist.get_process_group_ranks(mesh.group("pp"))),
        }
    finally:
        dist.destroy_process_group()


def _groups_made(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from lightning_par.layout.dimensions import Spelling

    def groups() -> int:
        return len(dist.distributed_c10d._world.pg_map)

    dist.init_process_group("gloo")
    try:
        before = groups()
        first = build_mesh(ParallelConfig(dp_shard=2, tp=2), "cpu")
        made = groups() - before
        again = build_mesh(ParallelConfig(dp_shard=2, tp=2, spelling=Spelling({"tp": "tensor_parallel_size"})), "cpu")
        made_again = groups() - before - made
        other = build_mesh(ParallelConfig(dp_shard=4), "cpu")
        return {"first": made, "again": made_again, "shared": again is first, "other": other.root is not first.root}
    finally:
        dist.destroy_process_group()


def test_a_layout_built_again_makes_no_new_process_group() -> None:
    """A process that fits several models, or fits then tests, builds the mesh of a layout once: each process group
    keeps a gloo thread per rank that wakes 100 times a second for the rest of the process. Another spelling shares
    the groups; another shape gets its own."""
    for result in run_distributed(_groups_made, 4):
        assert result["first"] > 0 and result["again"] == 0 and result["shared"] and result["other"], result


def test_mesh_order_and_flattened_dims() -> None:
    """pp outermost, tp innermost: tensor-parallel peers are neighbouring ranks (same node)."""
    results = run_distributed(_mesh_coordinates, 8, dict(pp=2, dp_shard=2, tp=2))
    assert results[0]["dims"] == MESH_DIM_NAMES
    assert [r["tp_ranks"] for r in results[:2]] == [[0, 1], [0, 1]]
    assert results[0]["pp_ranks"] == [0, 4]
    for rank, result in enumerate(results):
        assert result["coords"] == {"pp": rank // 4, "dp_replicate": 0, "dp_shard": (rank // 2) % 2, "cp": 0,
                                    "tp": rank % 2}
        # The data loader shards by this: ranks of one tensor-parallel pair read the same samples.
        assert result["dp"] == (2, (rank // 2) % 2)
        assert result["dp_cp"] == 2 and result["dp_shard_cp"] == 2


def _bad_layout_in_trainer(rank: int, world_size: int) -> str:
    import lightning
    import torch.distributed as dist

    from lightning_par import DataParallelStrategy

    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=DataParallelStrategy(3),
                                logger=False, enable_progress_bar=False)
    from lightning_par.models import LlamaLM

    try:
        trainer.fit(LlamaLM(dim=16, n_layers=1, n_heads=2))
    except ValueError as error:
        assert not dist.is_initialized(), "the error must come before the process group exists"
        return str(error)
    raise AssertionError("no ValueError")


def test_bad_layout_fails_on_every_rank_before_any_collective() -> None:
    messages = run_distributed(_bad_layout_in_trainer, 2, timeout=60)
    assert messages[0] == messages[1]
    assert "data_parallel_size=3 = 3 does not equal the world size 2" in messages[0]


def _rank_1_waits_for_a_barrier_rank_0_never_enters(rank: int, world_size: int) -> None:
    import threading

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        dist.barrier()  # rank 0 never comes
    else:
        threading.Event().wait()  # rank 0 waits elsewhere, as a rank stuck in a step of its own would


def test_a_hang_fails_one_test_with_the_stack_of_every_rank() -> None:
    """The harness's own protection: a case that hangs fails within its timeout, saying where each rank was."""
    with pytest.raises(TimeoutError) as raised:
        run_distributed(_rank_1_waits_for_a_barrier_rank_0_never_enters, 2, timeout=10)
    message = str(raised.value)
    assert "ranks [0, 1] did not finish within 10 s" in message
    for rank in (0, 1):
        assert f"--- rank {rank}, still running ---" in message
    assert "_rank_1_waits_for_a_barrier_rank_0_never_enters" in message and "barrier" in message
