"""parallelize(): the one place that fixes the order in which techniques are applied.

The order matters and is the same as torchtitan's:

1. pipeline split        -- a stage must exist before its layers are sharded;
2. tensor / sequence parallel -- swaps parameters for DTensors sharded over ``tp``;
3. context parallel      -- wraps attention to exchange sequence chunks over ``cp``;
4. expert parallel       -- places experts over ``dp_shard x cp`` and routes tokens with all-to-all;
5. activation checkpointing -- wraps whole blocks, after their inner modules are final;
6. torch.compile         -- compiles the already-sharded blocks;
7. ZeRO / FSDP or DDP    -- last, because it must see the final parameters (DTensors included) and
                            because DDP wraps the whole module so that its hooks see the whole step.

Techniques that a later release adds slot into their step here; a layout asking for a technique this
version cannot apply is refused before any collective runs.
"""

from __future__ import annotations

from torch import nn

from lightning_par.config import ParallelConfig
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.data import apply_data_parallel, broadcast_replicas
from lightning_par.parallel.plan import ModelPlan

# Mesh dimensions whose technique this version applies. The others are validated by ParallelConfig
# but refused here, with the size the user asked for.
AVAILABLE_DIMENSIONS = {"dp_replicate", "dp_shard"}


def check_available(config: ParallelConfig) -> None:
    """Raise ``ValueError`` when ``config`` asks for a technique this version cannot apply."""
    missing = {
        name: getattr(config, name)
        for name in ("pp", "tp", "cp", "ep")
        if name not in AVAILABLE_DIMENSIONS and getattr(config, name) != 1
    }
    if missing:
        asked = ", ".join(f"{k}={v}" for k, v in missing.items())
        raise ValueError(
            f"{asked}: this version of lightning_par applies data parallelism only; "
            f"set {' and '.join(f'{k}=1' for k in missing)}"
        )


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    plan: ModelPlan | None = None,
    *,
    training: bool = True,
    device_ids: list[int] | None = None,
) -> nn.Module:
    """Apply every technique ``config`` asks for to ``model`` over ``mesh``; return the module to run.

    ``plan`` locates blocks, attention and MLP for the model-parallel techniques. With
    ``training=False`` (validate/test/predict) the gradient-synchronising wrapper is skipped, as there
    is nothing to synchronise; the replicas are made equal by a broadcast instead.
    """
    check_available(config)
    # Steps 1-6 (pipeline, tensor, context, expert parallel, checkpointing, compile) read `plan`;
    # the data-parallel step does not need it.
    if not training:
        broadcast_replicas(model, mesh)
        return model
    return apply_data_parallel(
        model,
        mesh,
        bucket_cap_mb=config.ddp_bucket_cap_mb,
        static_graph=config.ddp_static_graph,
        find_unused_parameters=config.ddp_find_unused_parameters,
        gradient_compression=config.gradient_compression,
        device_ids=device_ids,
    )


__all__ = ["parallelize", "check_available"]
