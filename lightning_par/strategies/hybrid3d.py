"""Hybrid3DStrategy (``hybrid3d``): data, tensor, pipeline, context and expert parallel on one mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_par.layout.config import (
    ContextParallelMethod,
    Dtype,
    GradientCompression,
    ParallelConfig,
    PipelineBalance,
    PipelineSchedule,
    Size,
    shard_size,
)
from lightning_par.layout.dimensions import strategy_spelling
from lightning_par.strategies.base import MeshStrategy

# The sizes the planner may choose (ParallelConfig fields).
PLANNABLE_SIZES = ("tp", "pp", "cp", "ep", "zero_stage")


class Hybrid3DStrategy(MeshStrategy):
    """Every technique of lightning_par composed on one device mesh ``pp x dp_replicate x dp_shard x cp x tp``.

    The techniques are applied in the fixed order of ``lightning_par.parallel.compose`` (pipeline split,
    tensor/sequence parallel, context parallel, expert parallel, activation checkpointing, ZeRO/FSDP2 or
    data-parallel gradient averaging), as in Megatron-LM's PTD-P (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") and torchtitan. Combinations
    this version cannot compose are refused at construction with the reason (docs/hybrid3d.md lists them).

    Sizes left ``"auto"`` are chosen by the planner (``lightning_par.planner``) when the processes start,
    from the model, the world size and ``device``; the chosen layout and the ranking are logged.

    Args:
        data_parallel_size: ranks that read different samples (``replicate_size x`` sharded ranks);
            ``"auto"``: every rank the other sizes leave.
        tensor_parallel_size: ranks that split each layer (keep inside a node).
        pipeline_parallel_size: ranks the stages are spread over (outermost: across nodes).
        context_parallel_size: ranks that split each sequence.
        expert_parallel_size: ranks the experts of an MoE layer are spread over, taken from the data- and
            context-parallel ranks (does not multiply the world size).
        zero_stage: 0 (gradients averaged), 1 (optimizer states sharded; composes with tensor and pipeline parallel),
            2 (gradients too; plain data parallel only) or 3 (FSDP2; with tensor, context, expert and pipeline
            parallel).
        replicate_size: HSDP under ``zero_stage=3``: shard within groups, replicate across them.
        sequence_parallel: with tensor parallel, keep activations between regions split along the sequence.
        loss_parallel: with tensor parallel, cross-entropy on vocabulary-sharded logits.
        context_parallel_method: ``ulysses``, ``ring`` or ``allgather`` (docs/context_parallel.md).
        pipeline_schedule: a schedule of ``lightning_par.layout.schedules.SCHEDULES`` (``gpipe``, ``1f1b``,
            ``interleaved_1f1b``, ``zbv``, ``dualpipev``, ...).
        microbatches: micro-batches per batch under pipeline parallel.
        virtual_stages: stages per rank for a schedule of virtual stages (``interleaved_1f1b``).
        pipeline_balance: ``parameters`` or ``profile``.
        reshard_after_forward: ZeRO-3: ``False`` keeps gathered blocks from forward to backward.
        keep_gathered_blocks: ZeRO-3: keep the last N blocks gathered from forward to backward.
        prefetch_blocks: ZeRO-3 without pipeline parallel: gather the next N blocks as a block starts.
        blocks_per_unit: ZeRO-3: gather and reduce every K consecutive blocks together (see ``ZeroStrategy``).
            ``"auto"`` (the default, for any of these three): chosen from the model's blocks at set-up, as
            ``ZeroStrategy`` does.
        param_dtype: ZeRO-3: the dtype blocks compute in, from fp32 shards (see ``ZeroStrategy``).
        reduce_dtype: ZeRO-3: the dtype of the gradient reduce-scatter (default: ``param_dtype``).
        cpu_offload: ZeRO-3: shards, gradients and optimizer states in host memory.
        sharded_accumulation: ZeRO-2/3 without pipeline parallel: reduce gradients on every accumulated batch so
            that they stay sharded (see ``ZeroStrategy``).
        bucket_cap_mb: gradient bucket size of the data-parallel all-reduce (DDP's, or the one after backward
            under pipeline or tensor parallel).
        static_graph: DDP: the set of used parameters never changes (see ``DataParallelStrategy``).
        find_unused_parameters: DDP: allow parameters that receive no gradient in a step.
        gradient_compression: DDP: ``bf16`` or ``fp16`` halves all-reduce bytes; ``none`` keeps fp32.
        device: the accelerator the planner assumes for ``"auto"`` sizes (a preset of
            ``lightning_par.planner``, e.g. ``h100-80gb``); by default ``cpu`` on CPU, ``h100-80gb`` on GPU.
        model_spec: the architecture the planner assumes for ``"auto"`` sizes: a preset name (``llama3-8b``) or
            the sizes of ``lightning_par.planner.ModelSpec`` (``vocab_size``, ``hidden``, ``layers``, ``heads``,
            ``kv_heads``, ``ffn_hidden``, ...); by default read from the model's configuration.
        save_distributed_checkpoint: sharded DCP directory (default; required with pipeline parallel).
    """

    strategy_name = "hybrid3d"
    strategy_description = "data x tensor x pipeline x context x expert parallel on one mesh"

    def __init__(
        self,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = 1,
        pipeline_parallel_size: Size = 1,
        context_parallel_size: Size = 1,
        expert_parallel_size: Size = 1,
        zero_stage: Size = 0,
        replicate_size: int = 1,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        context_parallel_method: ContextParallelMethod = "ulysses",
        pipeline_schedule: PipelineSchedule = "1f1b",
        microbatches: int = 4,
        virtual_stages: int = 2,
        pipeline_balance: PipelineBalance = "parameters",
        reshard_after_forward: bool = True,
        keep_gathered_blocks: Size = "auto",
        prefetch_blocks: Size = "auto",
        blocks_per_unit: Size = "auto",
        param_dtype: Dtype = "fp32",
        reduce_dtype: Optional[Dtype] = None,
        cpu_offload: bool = False,
        sharded_accumulation: bool = False,
        bucket_cap_mb: float = 25.0,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_compression: GradientCompression = "none",
        device: Optional[str] = None,
        model_spec: Union[str, dict[str, Any], None] = None,
        **kwargs: Any,
    ) -> None:
        requested = dict(zip(PLANNABLE_SIZES, (tensor_parallel_size, pipeline_parallel_size, context_parallel_size,
                                               expert_parallel_size, zero_stage)))
        # Sizes for the planner: what it may choose is "auto"; a checkable placeholder until it has chosen.
        self._planned = {name for name, value in requested.items() if value == "auto"}
        chosen = {name: (1 if value == "auto" else value) for name, value in requested.items()}
        config = ParallelConfig(
            dp_replicate=replicate_size, dp_shard=shard_size(data_parallel_size, replicate_size), **chosen,
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, cp_method=context_parallel_method,
            pp_schedule=pipeline_schedule, microbatches=microbatches, pp_virtual_stages=virtual_stages,
            pp_balance=pipeline_balance, reshard_after_forward=reshard_after_forward,
            **self._unit_controls(keep_gathered_blocks=keep_gathered_blocks, prefetch_blocks=prefetch_blocks,
                                  blocks_per_unit=blocks_per_unit), param_dtype=param_dtype,
            reduce_dtype=reduce_dtype, cpu_offload=cpu_offload,
            sharded_accumulation=sharded_accumulation,
            ddp_bucket_cap_mb=bucket_cap_mb, ddp_static_graph=static_graph,
            ddp_find_unused_parameters=find_unused_parameters, gradient_compression=gradient_compression,
            spelling=strategy_spelling("dp_shard" if replicate_size == 1 else "dp"),
        )
        if device is not None:
            from lightning_par.planner import ClusterSpec

            ClusterSpec.from_preset(device)  # an unknown preset fails here, not when the processes have started
        self._device_preset = device
        self._model_spec = _model_spec(model_spec)
        super().__init__(config, **kwargs)

    #: Whether the planner measures this machine (``lightning_par.planner.measure``) instead of trusting the device
    #: preset's data sheet; ``AutoParallelStrategy(calibrate=True)`` sets it.
    _calibrate: bool = False

    @override
    def _choose_layout(self, config: ParallelConfig) -> ParallelConfig:
        if not self._planned:
            return config
        from lightning_par.planner import ClusterSpec, explain, format_table
        from lightning_par.planner.runtime import plan_for_run
        from lightning_par.planner.module_spec import module_spec

        module = self.lightning_module
        trainer = module.trainer
        batch_size, seq_len = _loader_shape(trainer.datamodule, module)
        device = self._device_preset or ("cpu" if self.root_device.type == "cpu" else "h100-80gb")
        cluster = ClusterSpec.from_preset(device, nodes=self.num_nodes, devices_per_node=self.num_processes)
        fixed: dict[str, Any] = {name: getattr(config, name) for name in PLANNABLE_SIZES
                                 if name not in self._planned}
        if isinstance(config.dp_shard, int):
            fixed["dp"] = config.dp
        fixed.update({name: getattr(config, name) for name in (*KNOBS, "loss_parallel") if name not in self._planned})
        if not self._save_distributed_checkpoint:
            fixed.setdefault("pp", 1)  # a full-file checkpoint cannot hold a pipeline
        # The architecture: model_spec if given, else the module's configuration, else read off its parameters.
        spec = self._model_spec or module_spec(module, self._model_map)
        precision = _planner_precision(trainer.precision)
        if self._calibrate:
            cluster = self._measured_cluster(cluster, spec, batch_size=batch_size, seq_len=seq_len,
                                             precision=precision)
        # Emulated float8 multiplies at the high-precision rate: costed as such.
        speed = {"compiled": config.compile, "float8": config.float8 is not None and not config.float8_emulate}
        candidates = plan_for_run(spec, cluster, batch_size_per_rank=batch_size,
                                  seq_len=seq_len, precision=precision,
                                  accumulate_grad_batches=trainer.accumulate_grad_batches, fixed=fixed,
                                  training_options=speed)
        self.planned_layouts = candidates
        self.planned_cluster = cluster
        chosen = candidates[0].config
        rank_zero_info(f"{type(self).__name__}: planned {chosen.describe()}, zero_stage={chosen.zero_stage}, "
                       f"activation_checkpointing={chosen.activation_checkpointing}, sequence_parallel="
                       f"{chosen.sequence_parallel}\n{format_table(candidates, top=5)}\n{explain(candidates)}")
        planned = {name: getattr(chosen, name) for name in self._planned}
        if "pp" in self._planned and chosen.pp > 1:
            planned["microbatches"] = chosen.microbatches
        return dataclasses.replace(config, dp_replicate=chosen.dp_replicate, dp_shard=chosen.dp_shard, **planned)

    def _measured_cluster(self, preset: Any, spec: Any, *, batch_size: int, seq_len: int, precision: str) -> Any:
        """``preset`` with the rates every rank measured at start-up (``lightning_par.planner.measure``).

        The ranks must plan alike, so they measure together and agree on the slowest rank's figures over the
        default process group, which is therefore started here, before the layout is chosen (starting it again
        later is a no-op). The probes run on one micro-batch: the whole loader batch without a pipeline."""
        from lightning_par.planner.measure import measure_rates, measured_cluster

        if self.world_size > 1:
            self._start_process_group()
        rates = measure_rates(spec, seq_len=seq_len, microbatch_size=batch_size, precision=precision,
                              device=self.root_device, local_world_size=self.num_processes)
        # CPU ranks use every core (processes.py gives each its share): gloo's reductions take their time from the
        # compute they would overlap, so nothing is hidden (measured: docs/planner.md).
        cluster = measured_cluster(rates, nodes=self.num_nodes, devices_per_node=self.num_processes, base=preset,
                                   collective_overlap=0.0 if self.root_device.type == "cpu" else None)
        rank_zero_info(f"{type(self).__name__}: measured {rates} at start-up; planning for {cluster}")
        return cluster


# Knobs the planner chooses together with the sizes when the strategy leaves them to it.
KNOBS = ("sequence_parallel", "activation_checkpointing", "pp_schedule", "cp_method", "sharded_accumulation")


def _loader_shape(datamodule: Any, module: Any) -> tuple[int, int]:
    """(batch size per data-parallel rank, sequence length) the run will train on."""
    batch_size = getattr(datamodule, "batch_size", None)
    seq_len = getattr(datamodule, "seq_len", None) or getattr(getattr(module, "config", None), "max_seq_len", None)
    if not isinstance(batch_size, int) or not isinstance(seq_len, int):
        raise ValueError("sizes left 'auto' are planned from the batch size and sequence length of the data, and "
                         f"the datamodule {type(datamodule).__name__} does not say them (batch_size={batch_size!r}, "
                         f"seq_len={seq_len!r}): give every size, or use a datamodule with batch_size and seq_len")
    return batch_size, seq_len


def _model_spec(value: Any) -> Any:
    """The planner's ModelSpec from a preset name or a mapping of its fields (checked at construction)."""
    if value is None:
        return None
    from lightning_par.planner import ModelSpec

    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, str):
        return ModelSpec.preset(value)
    if isinstance(value, Mapping):
        fields = {field.name for field in dataclasses.fields(ModelSpec)}
        unknown = sorted(set(value) - fields)
        missing = sorted({"vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden"} - set(value))
        if unknown or missing:
            raise ValueError(f"model_spec={dict(value)!r}: " + "; ".join(
                ([f"unknown fields {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else []))
                + f" (ModelSpec's fields: {sorted(fields)})")
        return ModelSpec(**value)
    raise ValueError(f"model_spec={value!r} is neither a preset name nor a mapping of ModelSpec's sizes")


def _planner_precision(precision: str) -> str:
    """Lightning's precision name as the planner's memory model knows it (others are counted as fp32)."""
    from lightning_par.planner.memory import LIGHTNING_PRECISIONS

    return LIGHTNING_PRECISIONS.get(str(precision), "32-true")


class AutoParallelStrategy(Hybrid3DStrategy):
    """The planner (``lightning_par.planner``) chooses the whole layout when the processes start.

    Sizes, ZeRO stage, activation checkpointing, sequence parallel, the pipeline schedule and its
    micro-batches are chosen to fit ``device``'s memory and train the most tokens per second for the
    model, the world size and the data's batch size and sequence length; the ranking and the reason are
    logged. Any of the sizes can still be fixed (an integer) and the planner fills in the rest.

    Args:
        device: the accelerator to plan for (a preset of ``lightning_par.planner``: ``h100-80gb``,
            ``a100-40gb``, ...); by default ``cpu`` on CPU, ``h100-80gb`` on GPU.
        calibrate: measure this machine when the processes start instead of trusting ``device``'s data sheet:
            every rank times a large matmul, one block of the model (its projections, attention and element-wise
            ops) on one micro-batch, and an all-reduce, and all plan with the slowest rank's rates
            (``lightning_par.planner.measure``; about a second on a CPU). ``device`` keeps what is not measured.
            Off by default: a measured layout depends on the machine's load, a data-sheet layout is reproducible.
        model_spec: the architecture (a preset name or ``ModelSpec``'s sizes); by default read from the model's
            configuration, or, for a module without one, off its parameters
            (``lightning_par.planner.module_spec``).
        data_parallel_size: ``"auto"`` (default) or a fixed number of data-parallel ranks.
        tensor_parallel_size: ``"auto"`` (default) or fixed.
        pipeline_parallel_size: ``"auto"`` (default) or fixed.
        context_parallel_size: ``"auto"`` (default) or fixed.
        expert_parallel_size: ``"auto"`` (default) or fixed.
        zero_stage: ``"auto"`` (default) or fixed (0-3).
        model_map: where the model keeps its blocks (derived for standard decoders; see docs/architecture.md).
        save_distributed_checkpoint: sharded DCP directory (default); ``False`` keeps the planner away from
            pipeline parallel.
    """

    strategy_name = "auto_parallel"
    strategy_description = "layout chosen by the lightning_par planner"

    def __init__(
        self,
        device: Optional[str] = None,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = "auto",
        pipeline_parallel_size: Size = "auto",
        context_parallel_size: Size = "auto",
        expert_parallel_size: Size = "auto",
        zero_stage: Size = "auto",
        calibrate: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         pipeline_parallel_size=pipeline_parallel_size, context_parallel_size=context_parallel_size,
                         expert_parallel_size=expert_parallel_size, zero_stage=zero_stage, device=device, **kwargs)
        self._planned |= set(KNOBS)
        if not isinstance(calibrate, bool):
            raise ValueError(f"calibrate must be true or false, got {calibrate!r}")
        self._calibrate = calibrate
