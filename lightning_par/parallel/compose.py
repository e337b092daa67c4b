"""parallelize(): the one place that fixes the order in which techniques are applied.

The order matters and is the same as torchtitan's, after a check of the plan:

0. the plan, checked     -- a tensor-parallel plan runs on a small replica, whole and split, and what it
                            cannot compute alike is refused or, for a derived plan, gathered (plan_check);
1. pipeline split        -- a stage must exist before its layers are sharded; what runs outside the blocks is
                            placed from a traced forward (pipeline_trace);
2. tensor / sequence parallel -- swaps parameters for DTensors sharded over ``tp``;
3. context parallel      -- wraps attention to exchange sequence chunks over ``cp``;
4. expert parallel       -- places experts over ``dp_shard x cp`` and routes tokens with all-to-all;
5. activation checkpointing -- wraps whole blocks, after their inner modules are final;
6. torch.compile         -- compiles the already-sharded blocks;
7. ZeRO / FSDP or DDP    -- last, because it must see the final parameters (DTensors included) and
                            because DDP wraps the whole module so that its hooks see the whole step.
                            ZeRO stages 1-2 shard the optimizer afterwards (parallelize_optimizer). Where
                            DDP cannot wrap the step (pipeline stages; tensor-parallel DTensors without
                            ZeRO-3) the strategy calls reduce_gradients after the last backward instead.

A combination this version does not compose is refused (``ParallelConfig.check_composable``) before any
collective runs.
"""

from __future__ import annotations

from collections.abc import Callable
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
from lightning_par.parallel.pipeline import build_stages, check_microbatches, split_pipeline
from lightning_par.parallel.plan import ModelPlan
from lightning_par.parallel.plan_check import check_plan
from lightning_par.parallel.recompute import apply_activation_checkpointing
from lightning_par.parallel.sequence import apply_context_parallel, check_sequence_length
from lightning_par.parallel.parallelized import parallelized
from lightning_par.parallel.tensor import apply_tensor_parallel, split_summary
from lightning_par.parallel.ties import StageTies, clean_name
from lightning_par.parallel.zero import fully_shard_model, is_zero_module, materialize_meta_parameters, shard_optimizer


def check_batch_fits(config: ParallelConfig, *, batch_size: int | None, seq_len: int | None) -> None:
    """Raise ``ValueError`` naming the values when batches of ``batch_size`` samples of ``seq_len`` tokens cannot
    be cut as the layout needs: into the pipeline's micro-batches, or along the sequence over the context-parallel
    (and, with sequence parallel, the tensor-parallel) ranks. Checked at set-up on the first batch, so that a
    mismatch fails before the first step; ``None`` skips a check."""
    if config.pp > 1:
        check_microbatches(config.pp_microbatches, config.pp_schedule, config.pp, batch_size)
    if seq_len is None:
        return
    if config.cp > 1:
        check_sequence_length(seq_len, config.cp, config.cp_method)
    local = seq_len // config.cp
    if config.sequence_parallel and config.tp > 1 and local % config.tp:
        held = f"the {local} tokens each cp rank holds" if config.cp > 1 else f"a sequence of {seq_len} tokens"
        raise ValueError(f"sequence_parallel=True splits the sequence over tp={config.tp} ranks, but {held} cannot "
                         f"be split into {config.tp}; use a sequence length divisible by {config.tp * config.cp}")


def pipeline_stages(model: nn.Module) -> list:
    """This rank's pipeline stages of a module :func:`parallelize` split (empty without pipeline parallel)."""
    record = parallelized(model)
    return record.stages if record is not None else []


def applied_layout(model: nn.Module) -> tuple | None:
    """(mesh sizes, config) :func:`parallelize` laid ``model`` out for, or None if it has not."""
    record = parallelized(model)
    return record.layout if record is not None else None


def stage_ties(model: nn.Module) -> StageTies | None:
    """The parameters several pipeline ranks hold (a head tied to the embedding), or None without any."""
    record = parallelized(model)
    return record.ties if record is not None else None


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    plan: ModelPlan | None = None,
    *,
    training: bool = True,
    device: torch.device | None = None,
    device_ids: list[int] | None = None,
    sample_batch: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    log: Callable[[str], None] | None = None,
) -> nn.Module:
    """Apply every technique ``config`` asks for to ``model`` over ``mesh``; return the module to run.

    ``plan`` locates blocks, attention and MLP for the model-parallel techniques and the ZeRO-3 units.
    With ``training=False`` (validate/test/predict) no gradient machinery is installed; replicas are made
    equal by a broadcast instead (ZeRO-3 still shards: that is what lets the model fit). Parameters
    created on the meta device are allocated on ``device`` (after sharding, under ZeRO-3).
    ``sample_batch`` (inputs, targets; one micro-batch of the data) is what the tensor-parallel plan is checked
    on (``plan_check``), what pipeline parallel traces to place the code outside the blocks, and what balancing
    by profile times the blocks on; without it the plan is applied unchecked. ``log`` receives what was split
    and what the check changed.
    """
    device = device if device is not None else torch.device(mesh.device_type)
    config.check_composable()
    # Steps 1-6 change the module in place, once: fit and then validate/test/predict on the same module
    # (the usual Lightning sequence) reuses them and only re-wraps for data parallelism.
    layout = (mesh.sizes(), config)
    applied = applied_layout(model)
    if applied is not None and applied != layout:
        raise ValueError(f"this module was parallelized for {applied[1].describe()} already and cannot be "
                         f"re-laid out as {config.describe()}; build a new module (or load a checkpoint into one)")
    stages = None
    if applied is None:
        if config.tp > 1 and plan is not None and sample_batch is not None:  # 0: the plan, checked
            plan, notes = check_plan(model, mesh, plan, sample_batch[0], sequence_parallel=config.sequence_parallel,
                                     loss_parallel=config.loss_parallel, apply=apply_tensor_parallel)
            if log is not None:
                log(f"tensor-parallel plan ({plan.source}) checked on a sample: " + ("; ".join(notes) or "as planned"))
        if config.pp > 1:  # 1
            stages = split_pipeline(model, mesh, plan, schedule=config.pp_schedule,
                                    virtual_stages=config.pp_virtual_stages, balance_by=config.pp_balance,
                                    device=device, sample_batch=sample_batch)
        apply_tensor_parallel(model, mesh, plan, sequence_parallel=config.sequence_parallel,  # 2
                              loss_parallel=config.loss_parallel)
        if config.tp > 1 and log is not None and plan is not None:
            log(f"tensor parallel (tp={config.tp}) split, on this rank: {split_summary(model, plan)}")
        apply_context_parallel(model, mesh, plan, method=config.cp_method)  # 3
        apply_expert_parallel(model, mesh, config.ep, plan)  # 4
        apply_activation_checkpointing(model, plan, mode=config.activation_checkpointing,  # 5
                                       every=config.activation_checkpointing_every)
        if config.zero_stage == 3:  # 7: shard, then allocate only the shards of a meta-device model
            fully_shard_model(model, mesh, plan, reshard_after_forward=config.reshard_after_forward,
                              param_dtype=_dtype(config.param_dtype), reduce_dtype=_dtype(config.reduce_dtype),
                              cpu_offload=config.cpu_offload)
        record = parallelized(model, create=True)
        if stages is not None:  # 1, completed: each stage's view of the blocks as they now are
            record.stages = build_stages(model, stages, mesh, device, sequence_parallel=config.sequence_parallel)
        record.layout = layout
    materialize_meta_parameters(model, device)
    if stages is not None:
        # After allocation: a model built on the meta device gets new parameter objects there.
        by_name = {clean_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
        ties = StageTies({by_name[n]: ranks for n, ranks in stages.shared.items()
                          if n in by_name and by_name[n].requires_grad}, mesh)
        parallelized(model, create=True).ties = ties
        ties.make_equal()  # copies of one tensor on several stages start equal
    if config.zero_stage == 3:
        return model
    if not training or config.zero_stage == 2 or config.reduces_gradients_after_backward:
        # Stage 2 reduces gradients with hooks installed by parallelize_optimizer(), the others listed in
        # ParallelConfig.reduces_gradients_after_backward with reduce_gradients(), not with DDP.
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


def gradient_norm_groups(mesh: ParallelMesh, config: ParallelConfig) -> dict[str, ProcessGroup | None]:
    """The groups :func:`~lightning_par.parallel.clip.clip_grad_norm_` sums squared norms over.

    ``partition_group``: under ZeRO-2, the ranks whose plain gradients make up one whole gradient.
    ``stage_group``: under pipeline parallel, the ranks holding the other stages (every kind of gradient).
    DTensor gradients (tensor parallel, ZeRO-3, experts) know their own placements.
    """
    zero2 = config.zero_stage == 2 and mesh.size("dp_shard") > 1
    return {"partition_group": mesh.group("dp_shard") if zero2 else None,
            "stage_group": mesh.group("pp") if mesh.size("pp") > 1 else None}


__all__ = ["applied_layout", "parallelize", "pipeline_stages", "stage_ties", "parallelize_optimizer",
           "no_gradient_sync", "gradient_norm_groups", "check_batch_fits"]
