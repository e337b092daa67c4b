"""parallelize(): the one place that fixes the order in which techniques are applied.

The order matters and is the same as torchtitan's, after a check of the model map:

0. the model map, checked     -- a tensor-parallel split runs on a small copy, whole and split, and what it
                            cannot compute alike is refused or, for a derived map, gathered (model_map_check);
   then float8           -- the blocks' linear layers become torchao's Float8Linear, before anything shards
                            them, so that tensor parallel splits and FSDP2 gathers float8 layers (float8);
1. pipeline split        -- a stage must exist before its layers are sharded; what runs outside the blocks is
                            placed from a traced forward (pipeline/trace.py);
2. tensor / sequence parallel -- swaps parameters for DTensors sharded over ``tp``;
3. context parallel      -- wraps attention to exchange sequence chunks over ``cp``;
4. expert parallel       -- places experts over ``dp_shard x cp`` and routes tokens with all-to-all;
   then dropout streams  -- where the layout gave ranks different activations (a tensor-parallel split region,
                            context parallel's blocks, a pipeline stage, a sequence-split DTensor), random draws
                            come from a stream derived per rank; before recomputation wraps the blocks, so that
                            it replays them (rng); only for a model that draws in training;
5. activation checkpointing -- wraps whole blocks, after their inner modules are final;
6. torch.compile         -- compiles the already-sharded blocks;
7. ZeRO / FSDP or DDP    -- last, because it must see the final parameters (DTensors included) and
                            because DDP wraps the whole module so that its hooks see the whole step.
                            ZeRO stages 1-2 shard the optimizer afterwards (``shard_optimizer`` of the
                            handle). Where DDP cannot wrap the step (pipeline stages; tensor-parallel
                            DTensors without ZeRO-3) the handle's ``after_backward`` averages the gradients.

What was done is returned as a handle (``Parallelized``) that the training loop asks instead of the config.
A combination this version does not compose is refused (``ParallelConfig.check_composable``) before any
collective runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from lightning_par.layout.config import DTYPES, ParallelConfig
from lightning_par.layout.schedules import stages_per_rank
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.async_tp import enable_async_tensor_parallel
from lightning_par.parallel.compile import apply_compile
from lightning_par.parallel.ddp import apply_data_parallel, broadcast_replicas
from lightning_par.parallel.experts import apply_expert_parallel, check_experts_found, moe_layers
from lightning_par.parallel.float8 import apply_float8, check_float8_device, precompute_scales_before_forward
from lightning_par.parallel.pipeline.split import (StageLayout, build_stages, check_microbatches,
                                                  check_weight_pass_with_zero3, split_pipeline)
from lightning_par.parallel.model_map import ModelMap, network_prefix
from lightning_par.parallel.model_map_check import check_model_map
from lightning_par.parallel.layout_check import check_layout_forward, check_routing_draws, draws_in_training
from lightning_par.parallel.outside_calls import blocks_used_outside
from lightning_par.parallel.recompute import apply_activation_checkpointing
from lightning_par.parallel.context import apply_context_parallel, check_sequence_length, head_follows_last_block
from lightning_par.parallel.parallelized import Parallelized
from lightning_par.parallel.pipeline.check import check_pipeline_split
from lightning_par.parallel.pipeline.runner import PipelineRunner
from lightning_par.parallel.record import layout_record
from lightning_par.parallel.rng import (apply_split_streams, apply_stage_streams, apply_token_streams,
                                        install_shard_streams)
from lightning_par.parallel.tensor import apply_tensor_parallel, split_regions, split_summary
from lightning_par.parallel.modules import clean_name, tied_groups
from lightning_par.parallel.pipeline.ties import StageTies
from lightning_par.parallel.initialize import RandomState, has_meta_tensors, initialize_meta_model, meta_skeleton
from lightning_par.parallel.zero import fully_shard_model
from lightning_par.parallel.zero_check import check_sharded_units


def runs_on_a_sample(model: nn.Module, config: ParallelConfig, model_map: ModelMap | None) -> bool:
    """Whether :func:`parallelize` runs ``model`` at set-up, given a ``sample_batch``: to check a tensor-parallel split,
    trace a pipeline's code outside its blocks, cut the sequence for context parallel, check a mixture of experts'
    routing, or find the blocks ZeRO-3 must not gather alone. The Trainer's and Fabric's strategies ask this one
    question, so that both run the same set-up checks."""
    return (config.tp > 1 or config.pp > 1 or config.cp > 1 or config.ep > 1 or config.zero.shards_parameters
            or bool(moe_layers(model, model_map)))


def check_batch_fits(config: ParallelConfig, *, batch_size: int | None, seq_len: int | None) -> None:
    """Raise ``ValueError`` naming the values when batches of ``batch_size`` samples of ``seq_len`` tokens cannot
    be cut as the layout needs: into the pipeline's micro-batches, or along the sequence over the context-parallel
    (and, with sequence parallel, the tensor-parallel) ranks. Checked at set-up on the first batch, so that a
    mismatch fails before the first step; ``None`` skips a check."""
    if config.pp > 1:
        check_microbatches(config, batch_size)
    if seq_len is None:
        return
    if config.cp > 1:
        check_sequence_length(seq_len, config.cp, config.cp_method)
    local = seq_len // config.cp
    if config.sequence_parallel and config.tp > 1 and local % config.tp:
        held = (f"the {local} tokens each context-parallel rank holds" if config.cp > 1 else
                f"a sequence of {seq_len} tokens")
        raise ValueError(f"sequence_parallel=True splits the sequence over tp={config.tp!r} "
                         f"ranks, but {held} cannot be split into {config.tp}; use a sequence length divisible by "
                         f"{config.tp * config.cp}")


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    model_map: ModelMap | None = None,
    *,
    training: bool = True,
    device: torch.device | None = None,
    device_ids: list[int] | None = None,
    sample_batch: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    log: Callable[[str], None] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    accumulate: int = 1,
    loss_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None,
    dry_run: Callable[[nn.Module, torch.device], bool] | None = None,
) -> Parallelized:
    """Apply every technique ``config`` asks for to ``model`` over ``mesh``; return the handle of the result
    (:class:`~lightning_par.parallel.parallelized.Parallelized`: the module to run and what a training loop asks).

    ``model_map`` locates blocks, attention and MLP for the model-parallel techniques and the ZeRO-3 units.
    With ``training=False`` (validate/test/predict) no gradient machinery is installed; replicas are made
    equal by a broadcast instead (ZeRO-3 still shards: that is what lets the model fit). Parameters
    created on the meta device are allocated on ``device`` (after sharding, under ZeRO-3).
    ``sample_batch`` (inputs, targets; one micro-batch of the data) is what the set-up's checks run on
    (:func:`runs_on_a_sample`; the tensor-parallel split's: ``model_map_check``), what pipeline parallel traces to
    place the code outside the blocks, and what balancing by profile times the blocks on; without it the model map
    is applied unchecked. ``log`` receives what was split and what the check changed. Under pipeline parallel, the
    handle's runner computes ``loss_fn(logits, targets)`` (the model's mean loss) for batches of which ``accumulate``
    make one optimizer step, weighing micro-batches by their ``loss_tokens(targets)`` where the model counts them.
    ``dry_run`` (``lightning_par.dry_run.FakeAllocation``) makes this a dry run: what was built on the meta device
    is allocated by ``dry_run(model, device)`` (as fake tensors), the set-up's runs of a small copy (pipeline
    trace, parts used outside blocks) run on the meta device, and the tensor-parallel split is applied unchecked
    (on the fake backend its collectives move nothing to compare).
    """
    device = device if device is not None else torch.device(mesh.device_type)
    _validate(config, device)
    applied = _applied_layout(model, mesh, config)
    # A model built on the meta device is initialised as one process would (parallel/initialize.py), by the
    # initialisers of the model as built: a pipeline stage holds a part of it, and the layout swaps some modules' class
    # (a vocabulary-parallel embedding, float8 linear layers).
    skeleton = meta_skeleton(model) if dry_run is None and applied is None and has_meta_tensors(model) else None
    allocate = dry_run or functools.partial(initialize_meta_model, skeleton=skeleton)
    random_state = RandomState(device)  # the set-up's runs of small copies must not move the user's random stream
    # A dry run's set-up needs only the shapes of the data, and runs its small copies on the meta device.
    analysis_device = torch.device("meta") if dry_run is not None else device
    if dry_run is not None and sample_batch is not None:
        sample_batch = tuple(t if t is None else t.to("meta") for t in sample_batch)  # type: ignore[assignment]
    stages = None
    if applied is None:  # steps 0-7 change the module in place, once: fit, then validate/test/predict, reuse them
        found = _preflight(model, mesh, config, model_map, sample_batch, analysis_device, log, checked=dry_run is None)
        stages = _apply_techniques(model, mesh, config, found, sample_batch, device, analysis_device, log)
        layout_record(model).layout = (mesh.sizes(), config)
    random_state.restore()
    allocate(model, device)
    _after_allocation(model, mesh, config, stages)
    pipeline = (PipelineRunner(layout_record(model).stages, mesh, config, loss_fn, accumulate=accumulate,
                               device=device, loss_tokens=loss_tokens) if config.pp > 1 else None)
    return _handle(model, mesh, config, pipeline, training=training, dry_run=dry_run is not None,
                   device_ids=device_ids)


def _validate(config: ParallelConfig, device: torch.device) -> None:
    """What the layout refuses before anything runs: a combination this version does not compose, a schedule's
    weight pass under ZeRO-3, async tensor parallel off CUDA (on CUDA, the compiled blocks are rewritten)."""
    config.check_composable()
    if config.pp > 1:
        check_weight_pass_with_zero3(config.pp_schedule, config.zero_stage)
    if config.async_tp:
        enable_async_tensor_parallel(device)


def _applied_layout(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig) -> tuple | None:
    """The layout ``model`` was parallelized for already (None: none yet), refused when it is another one."""
    record = layout_record(model)
    applied = record.layout if record is not None else None
    if applied is not None and applied != (mesh.sizes(), config):
        raise ValueError(f"this module was parallelized for {applied[1].named_sizes()} already and cannot be "
                         f"re-laid out as {config.named_sizes()}; build a new module (or load a checkpoint into one)")
    return applied


@dataclasses.dataclass
class _Preflight:
    """What the set-up found on the model as built, before anything is split."""

    model_map: ModelMap | None  # as checked (a derived tensor-parallel split may gather what it cannot compute alike)
    used_outside: dict[str, list[str]]  # blocks whose parts the network also runs outside them (ZeRO-3 keeps whole)
    gather_at_head: bool  # context parallel gathers the sequence before the head
    random_streams: bool  # dropout streams per rank, where the layout gives ranks different activations


def _preflight(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, model_map: ModelMap | None,
               sample_batch: tuple[torch.Tensor, torch.Tensor | None] | None, analysis_device: torch.device,
               log: Callable[[str], None] | None, *, checked: bool) -> _Preflight:
    """Step 0: the checks run on the model as built, and on ``sample_batch`` where there is one (which ones:
    :func:`runs_on_a_sample`); ``checked=False`` (a dry run) leaves out those that compare numbers."""
    _check_fsdp_roots(model, config)
    check_experts_found(model, model_map, config.ep)
    inputs = sample_batch[0] if sample_batch is not None and model_map is not None else None
    used_outside = (blocks_used_outside(model, model_map, inputs, analysis_device)
                    if config.zero.shards_parameters and config.pp == 1 and inputs is not None else {})
    if used_outside and log is not None:
        log(f"zero_stage=3: the network also runs {', '.join(p for ps in used_outside.values() for p in ps)} "
            f"outside {', '.join(used_outside)}: sharded with the root, gathered for the whole step")
    gather_at_head = (config.cp > 1 and inputs is not None
                      and head_follows_last_block(model, model_map, inputs.to(analysis_device)))
    if config.tp > 1 and inputs is not None and checked:
        model_map, notes = check_model_map(model, mesh, model_map, inputs, sequence_parallel=config.sequence_parallel,
                                           loss_parallel=config.loss_parallel, apply=apply_tensor_parallel)
        if log is not None:
            log(f"tensor-parallel split ({model_map.source}) checked on a sample: " + ("; ".join(notes) or "as given"))
    if inputs is not None and checked:
        _check_layout(model, mesh, config, model_map, inputs, gather_at_head, list(used_outside))
    # Dropout streams only where the layout gives ranks different activations, and only for a model that draws: a
    # model without dropout runs as it did, without the regions' bookkeeping (or graph breaks under compile). A dry
    # run draws no numbers that matter.
    random_streams = (checked and model_map is not None and (config.tp > 1 or config.cp > 1 or config.pp > 1)
                      and (inputs is None or draws_in_training(model, mesh, model_map, inputs)))
    return _Preflight(model_map, used_outside, gather_at_head, random_streams)


def _apply_techniques(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, found: _Preflight,
                      sample_batch: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device,
                      analysis_device: torch.device, log: Callable[[str], None] | None) -> StageLayout | None:
    """Steps 0 (float8) to 7 in order (module docstring); this rank's pipeline stages, where there are some."""
    model_map = found.model_map
    if config.float8 is not None and not config.float8_emulate:
        check_float8_device(device, config.float8, log=log)
    weight_pass = config.gathers_into_the_weight_pass
    float8_gather = config.zero.shards_parameters and not weight_pass
    if weight_pass and config.reshard_after_forward and log is not None:
        log(f"pipeline_schedule={config.pp_schedule!r} with zero_stage=3: each block stays gathered from its "
            "forward to its backward (ParallelConfig.gathers_into_the_weight_pass)")
    converted = apply_float8(model, model_map, config.float8, emulate=config.float8_emulate,
                             fsdp_all_gather=float8_gather)
    if converted is not None and log is not None:
        log(converted.describe())
    stages = None
    if config.pp > 1:  # 1
        stages = split_pipeline(model, mesh, model_map, schedule=config.pp_schedule,
                                virtual_stages=config.pp_virtual_stages, balance_by=config.pp_balance,
                                device=analysis_device, sample_batch=sample_batch)
    apply_tensor_parallel(model, mesh, model_map, sequence_parallel=config.sequence_parallel,  # 2
                          loss_parallel=config.loss_parallel)
    if config.tp > 1 and log is not None and model_map is not None:
        log(f"tensor parallel (tp={config.tp}) split, on this rank: {split_summary(model, model_map)}")
    apply_context_parallel(model, mesh, model_map, method=config.cp_method, gather_at_head=found.gather_at_head)  # 3
    apply_expert_parallel(model, mesh, config.ep, model_map, reduce_gradients=not config.zero.shards_parameters)  # 4
    if found.random_streams:  # 4, then dropout streams
        _apply_random_streams(model, mesh, config, model_map, found.gather_at_head)
    apply_activation_checkpointing(model, model_map, mode=config.activation_checkpointing,  # 5
                                   every=config.activation_checkpointing_every)
    apply_compile(model, model_map, enabled=config.compile)  # 6
    shard_root = None
    if config.zero.shards_parameters:  # 7: shard, then allocate only the shards of a meta-device model
        # Under pipeline parallel each stage is a root, sharded when it is built.
        shard_root = fully_shard_model(model, mesh, model_map,
                                       reshard_after_forward=config.reshard_after_forward and not weight_pass,
                                       param_dtype=_dtype(config.param_dtype), reduce_dtype=_dtype(config.reduce_dtype),
                                       cpu_offload=config.cpu_offload, root=stages is None,
                                       keep_gathered_blocks=config.keep_gathered_blocks,
                                       prefetch_blocks=config.prefetch_blocks, blocks_per_unit=config.blocks_per_unit,
                                       stage_blocks=None if stages is None else _stage_blocks(model, stages),
                                       blocks_used_outside=list(found.used_outside))
    record = layout_record(model, create=True)
    if stages is not None:  # 1, completed: each stage's view of the blocks as they now are
        record.stages = build_stages(model, stages, mesh, device, sequence_parallel=config.sequence_parallel,
                                     shard_root=shard_root)
        if found.random_streams:  # each stage draws from its own stream
            apply_stage_streams([stage.submod for stage in record.stages],
                                [stage.stage_index for stage in record.stages], mesh.device_type)
    if converted is not None and float8_gather and config.float8 == "tensorwise":  # float8 all-gather
        roots = ([(stage.submod, stage.submod) for stage in record.stages] if stages is not None
                 else [(model, model.get_submodule(network_prefix(model_map).rstrip(".")))])
        for root, network in roots:
            precompute_scales_before_forward(root, network)
    record.random_streams = found.random_streams
    return stages


def _after_allocation(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, stages: StageLayout | None) -> None:
    """What needs the allocated parameters: the shard streams (after allocation, so that a meta-device model's
    initialisation draws as it did), and the pipeline's copies of one tensor on several stages, made equal (a
    model built on the meta device gets new parameter objects when allocated)."""
    if layout_record(model).random_streams and config.tp > 1:
        install_shard_streams(mesh["tp"])
    if stages is not None:
        by_name = {clean_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
        ties = StageTies({by_name[n]: ranks for n, ranks in stages.shared.items()
                          if n in by_name and by_name[n].requires_grad}, mesh)
        layout_record(model, create=True).ties = ties
        ties.make_equal()


def _handle(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, pipeline: PipelineRunner | None, *,
            training: bool, dry_run: bool, device_ids: list[int] | None) -> Parallelized:
    """Step 7 for data parallelism, and the handle of the result: DDP wraps the model unless something else reduces
    the gradients."""
    # DDP reduces in its C++ reducer, which takes no fake tensor: a dry run reduces the same gradients in the
    # handle's flattened all-reduces over dp x cp instead (the bytes DDP's buckets move; their copy is not held).
    reduces_after_backward = training and (config.reduces_gradients_after_backward or dry_run)
    if config.zero.gradient_reduction != "all-reduce" or not training or reduces_after_backward:
        # ZeRO-3 reduces gradients in FSDP2's hooks, stage 2 in hooks installed by Parallelized.shard_optimizer(),
        # the others listed in ParallelConfig.reduces_gradients_after_backward in Parallelized.after_backward().
        if not config.zero.shards_parameters:
            broadcast_replicas(model, mesh)
        return Parallelized(model, mesh, config, reduces_after_backward=reduces_after_backward, pipeline=pipeline)
    wrapped = apply_data_parallel(model, mesh, bucket_cap_mb=config.ddp_bucket_cap_mb,
                                  static_graph=config.ddp_static_graph,
                                  find_unused_parameters=config.ddp_find_unused_parameters,
                                  gradient_compression=config.gradient_compression, device_ids=device_ids)
    return Parallelized(wrapped, mesh, config, reduces_after_backward=False, pipeline=pipeline)


def _check_layout(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, model_map: ModelMap,
                  inputs: torch.Tensor, gather_at_head: bool, used_outside: list[str]) -> None:
    """Before anything is split: the layout's techniques that change where or how the model computes, run on a small
    copy (``layout_check``; the pipeline's stages: ``pipeline.check``; ZeRO-3's units: ``zero_check``); the
    tensor-parallel split alone was checked with the model map."""
    check_routing_draws(model, mesh, config, model_map, inputs)
    if config.pp > 1:  # the stages, with what they send each other, against the whole model
        check_pipeline_split(model, mesh, config, model_map, inputs)
    if config.zero.shards_parameters and config.pp == 1 and config.ep == 1:  # units, gathered as the network runs
        check_sharded_units(model, mesh, config, model_map, inputs, shard=lambda model_copy: fully_shard_model(
            model_copy, mesh, model_map, reshard_after_forward=config.reshard_after_forward,
            keep_gathered_blocks=config.keep_gathered_blocks, blocks_per_unit=config.blocks_per_unit,
            blocks_used_outside=used_outside))
    routes_local_tokens = config.tp > 1 and config.sequence_parallel and moe_layers(model, model_map)
    if not (config.cp > 1 or config.ep > 1 or routes_local_tokens):
        return

    def lay_out(model_copy: nn.Module) -> None:  # as steps 2-4 below
        apply_tensor_parallel(model_copy, mesh, model_map, sequence_parallel=config.sequence_parallel)
        apply_context_parallel(model_copy, mesh, model_map, method=config.cp_method, gather_at_head=gather_at_head)
        apply_expert_parallel(model_copy, mesh, config.ep, model_map)

    check_layout_forward(model, mesh, config, model_map, inputs, apply=lay_out)


def _apply_random_streams(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, model_map: ModelMap,
                          gather_at_head: bool) -> None:
    """The regions of ``rng`` in the network as steps 2-4 laid it out: tensor parallel's split regions, and context
    parallel's blocks (with the final norm and head where they run on each rank's tokens)."""
    if config.tp > 1:
        apply_split_streams(model, split_regions(model, model_map, sequence_parallel=config.sequence_parallel),
                            mesh.local_rank("tp"), mesh.device_type)
    if config.cp > 1:
        held = dict(model.named_modules())  # a pipeline stage holds its own blocks, and the head on the last stage
        outside = [name for name in (model_map.final_norm, model_map.head) if name] if gather_at_head else []
        local = [name for name in model_map.block_names(model) + outside if name in held]
        apply_token_streams(model, local, mesh.local_rank("cp"), mesh.device_type)


def _check_fsdp_roots(model: nn.Module, config: ParallelConfig) -> None:
    """Under ZeRO-3 each pipeline stage is an FSDP2 root over the parameters outside its blocks, and a parameter
    can belong to one root only: refuse stages of one rank that would share one (a tied embedding and head)."""
    held = stages_per_rank(config.pp_schedule, config.pp_virtual_stages)  # pipeline stages per rank
    if config.zero.shards_parameters and config.pp > 1 and held > 1:
        tied = tied_groups(model)
        if tied:
            raise ValueError(f"pp={config.pp!r} with zero_stage=3 and pp_schedule={config.pp_schedule!r}: each rank "
                             f"holds several stages, and the tied parameter {' = '.join(tied[0])} would belong to "
                             f"two of them, which FSDP2 cannot shard twice; use pp_schedule 1f1b or gpipe (one stage "
                             f"per rank), zero_stage 0 or 1, or untie the weights")


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, DTYPES[name])


def _stage_blocks(model: nn.Module, layout: StageLayout) -> list[list[nn.Module]]:
    """This rank's blocks, one list per stage it holds."""
    network = model.get_submodule(layout.network)
    return [[network.get_submodule(name) for name in owned] for _, (owned, _) in sorted(layout.stages.items())]


__all__ = ["parallelize", "check_batch_fits", "runs_on_a_sample"]
