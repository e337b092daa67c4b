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
                            ZeRO stages 1-2 shard the optimizer afterwards (parallelize_optimizer).

A combination this version does not compose yet is refused before any collective runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_par.config import DTYPES, ParallelConfig
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel import data, zero
from lightning_par.parallel.data import apply_data_parallel, broadcast_replicas, unwrap
from lightning_par.parallel.experts import apply_expert_parallel
from lightning_par.parallel.pipeline import build_stages, split_pipeline
from lightning_par.parallel.plan import ModelPlan
from lightning_par.parallel.recompute import apply_activation_checkpointing
from lightning_par.parallel.sequence import apply_context_parallel
from lightning_par.parallel.tensor import apply_tensor_parallel
from lightning_par.parallel.zero import fully_shard_model, is_zero_module, materialize_meta_parameters, shard_optimizer


def check_available(config: ParallelConfig) -> None:
    """Raise ``ValueError`` when ``config`` asks for something this version cannot apply."""
    dp = config.dp if isinstance(config.dp_replicate, int) and isinstance(config.dp_shard, int) else None
    if config.tp > 1 and config.zero_stage != 3 and dp not in (None, 1):  # None: not resolved yet
        # DDP and ZeroRedundancyOptimizer work on plain tensors; FSDP2 is what composes with DTensor.
        raise ValueError(
            f"tp={config.tp} with data parallelism needs zero_stage=3 (FSDP2 shards the tensor-parallel "
            f"DTensors over the data-parallel ranks), got zero_stage={config.zero_stage}"
        )
    others = {name: getattr(config, name) for name in ("tp", "cp") if getattr(config, name) > 1}
    if dp not in (None, 1):
        others["dp"] = dp
    if config.pp > 1 and others:
        asked = ", ".join(f"{k}={v}" for k, v in others.items())
        raise ValueError(f"pp={config.pp} with {asked}: pipeline parallel does not compose with other dimensions in "
                         "this version yet; use pp alone (data_parallel_size=1)")
    if config.ep > 1 and (config.tp > 1 or config.pp > 1 or config.zero_stage != 0):
        raise ValueError(f"ep={config.ep} composes with data parallelism (zero_stage=0) only in this version; got "
                         f"tp={config.tp}, pp={config.pp}, zero_stage={config.zero_stage}")
    if config.pp > 1 and config.zero_stage != 0:
        raise ValueError(f"pp={config.pp} with zero_stage={config.zero_stage}: use zero_stage=0 (each rank already "
                         "holds only its stages' parameters)")
    if config.cp > 1 and config.tp > 1:
        raise ValueError(f"cp={config.cp} with tp={config.tp}: context and tensor parallel do not compose in this "
                         "version yet; use one of them")
    if config.cp > 1 and config.zero_stage in (1, 2):
        raise ValueError(f"cp={config.cp} with zero_stage={config.zero_stage}: context parallel averages gradients "
                         "over dp x cp, which DDP (zero_stage=0) and FSDP2 (zero_stage=3) do; use one of those")


_LAYOUT_ATTRIBUTE = "_lightning_par_layout"
_STAGES_ATTRIBUTE = "_lightning_par_pipeline_stages"


def pipeline_stages(model: nn.Module) -> list:
    """This rank's pipeline stages of a module :func:`parallelize` split (empty without pipeline parallel)."""
    return getattr(model, _STAGES_ATTRIBUTE, [])


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    plan: ModelPlan | None = None,
    *,
    training: bool = True,
    device: torch.device | None = None,
    device_ids: list[int] | None = None,
    profile_batch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> nn.Module:
    """Apply every technique ``config`` asks for to ``model`` over ``mesh``; return the module to run.

    ``plan`` locates blocks, attention and MLP for the model-parallel techniques and the ZeRO-3 units.
    With ``training=False`` (validate/test/predict) no gradient machinery is installed; replicas are made
    equal by a broadcast instead (ZeRO-3 still shards: that is what lets the model fit). Parameters
    created on the meta device are allocated on ``device`` (after sharding, under ZeRO-3).
    ``profile_batch`` (inputs, targets) is what pipeline balancing by profile times the blocks on.
    """
    device = device if device is not None else torch.device(mesh.device_type)
    check_available(config)
    # Steps 1-6 change the module in place, once: fit and then validate/test/predict on the same module
    # (the usual Lightning sequence) reuses them and only re-wraps for data parallelism.
    layout = (mesh.sizes(), config)
    applied = getattr(model, _LAYOUT_ATTRIBUTE, None)
    if applied is not None and applied != layout:
        raise ValueError(f"this module was parallelized for {applied[1].describe()} already and cannot be "
                         f"re-laid out as {config.describe()}; build a new module (or load a checkpoint into one)")
    if applied is None:
        stages = None
        if config.pp > 1:  # 1
            stages = split_pipeline(model, mesh, plan, schedule=config.pp_schedule,
                                    virtual_stages=config.pp_virtual_stages, balance_by=config.pp_balance,
                                    device=device, profile_batch=profile_batch)
        apply_tensor_parallel(model, mesh, plan, sequence_parallel=config.sequence_parallel,  # 2
                              loss_parallel=config.loss_parallel)
        apply_context_parallel(model, mesh, plan, method=config.cp_method)  # 3
        apply_expert_parallel(model, mesh, config.ep, plan)  # 4
        apply_activation_checkpointing(model, plan, mode=config.activation_checkpointing,  # 5
                                       every=config.activation_checkpointing_every)
        if config.zero_stage == 3:  # 7: shard, then allocate only the shards of a meta-device model
            fully_shard_model(model, mesh, plan, reshard_after_forward=config.reshard_after_forward,
                              param_dtype=_dtype(config.param_dtype), reduce_dtype=_dtype(config.reduce_dtype),
                              cpu_offload=config.cpu_offload)
        if stages is not None:  # 1, completed: each stage's view of the blocks as they now are
            setattr(model, _STAGES_ATTRIBUTE, build_stages(model, stages, mesh, device))
        setattr(model, _LAYOUT_ATTRIBUTE, layout)
    if config.zero_stage == 3:
        materialize_meta_parameters(model, device)
        return model
    materialize_meta_parameters(model, device)
    if not training or config.zero_stage == 2:
        # Stage 2 reduces gradients with hooks installed by parallelize_optimizer(), not with DDP.
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


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, DTYPES[name])


def parallelize_optimizer(optimizer: Optimizer, model: nn.Module, mesh: ParallelMesh,
                          config: ParallelConfig) -> Optimizer:
    """The optimizer to step: sharded over the data-parallel ranks under ZeRO stages 1 and 2.

    (Under stage 3 the optimizer is already sharded: it was built on FSDP2's sharded parameters.)
    """
    return shard_optimizer(optimizer, unwrap(model), mesh, stage=config.zero_stage)


def no_gradient_sync(model: nn.Module) -> AbstractContextManager:
    """Skip gradient communication in backward passes inside the context (gradient accumulation)."""
    if is_zero_module(unwrap(model)):
        return zero.no_gradient_sync(unwrap(model))
    return data.no_gradient_sync(model)


def gradient_norm_group(mesh: ParallelMesh, config: ParallelConfig) -> ProcessGroup | None:
    """Under ZeRO-2 the ranks whose gradient pieces make up one whole gradient; else None (whole plain
    tensors, or DTensors, which know their own placements)."""
    if config.zero_stage == 2 and mesh.size("dp_shard") > 1:
        return mesh.group("dp_shard")
    if mesh.size("pp") > 1:  # each rank holds the whole gradients of its own stages
        return mesh.group("pp")
    return None


__all__ = ["parallelize", "pipeline_stages", "parallelize_optimizer", "no_gradient_sync", "gradient_norm_group",
           "check_available"]
