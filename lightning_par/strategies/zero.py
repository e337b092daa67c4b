"""ZeroStrategy (``zero1``, ``zero2``, ``zero3``, ``fsdp2``): ZeRO stages 1-3 and HSDP on the mesh."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from typing_extensions import override

from lightning_par.config import Dtype, ParallelConfig, Recompute, shard_size
from lightning_par.strategies.base import SIZE_ARGUMENTS, MeshStrategy


class ZeroStrategy(MeshStrategy):
    """ZeRO (Rajbhandari et al. 2020): shard model states over the data-parallel ranks.

    Args:
        stage: 1 shards optimizer states, 2 also gradients, 3 also parameters (FSDP2, one unit per
            transformer block from the model plan). See ``lightning_par.parallel.zero``.
        data_parallel_size: number of data-parallel ranks; ``"auto"`` uses every process.
        replicate_size: HSDP. Shard inside groups of ``data_parallel_size / replicate_size`` ranks and
            replicate across the groups (e.g. shard within a node, replicate across nodes).
        reshard_after_forward: stage 3 only. ``False`` keeps each block's gathered parameters from
            forward until backward (one all-gather per block instead of two, more memory).
        param_dtype: stage 3 only. Compute in ``bf16``/``fp16`` from fp32 shards (mixed precision);
            for stages 1-2 use ``Trainer(precision="bf16-mixed")``.
        reduce_dtype: stage 3 only. Dtype of the gradient reduce-scatter (default: ``param_dtype``;
            ``fp32`` keeps full-precision reductions under bf16 compute).
        cpu_offload: stage 3 only. Shards, gradients and optimizer states live in host memory.
        activation_checkpointing: ``none``, ``full`` or ``selective`` recomputation per block.
        activation_checkpointing_every: checkpoint one block in this many.
        plan: where the model keeps its blocks (derived for standard decoders; see docs/architecture.md).
        save_distributed_checkpoint: sharded DCP directory (default) or one full file from rank 0.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 3,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        replicate_size: int = 1,
        reshard_after_forward: bool = True,
        param_dtype: Dtype = "fp32",
        reduce_dtype: Optional[Dtype] = None,
        cpu_offload: bool = False,
        activation_checkpointing: Recompute = "none",
        activation_checkpointing_every: int = 1,
        **kwargs: Any,
    ) -> None:
        self.argument_names = {**SIZE_ARGUMENTS, "zero_stage": "stage", "dp_replicate": "replicate_size",
                               **({"dp_shard": "data_parallel_size"} if replicate_size == 1 else {})}
        config = ParallelConfig(dp_replicate=replicate_size, dp_shard=shard_size(data_parallel_size, replicate_size),
                                zero_stage=stage, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                                reduce_dtype=reduce_dtype, cpu_offload=cpu_offload,
                                activation_checkpointing=activation_checkpointing,
                                activation_checkpointing_every=activation_checkpointing_every)
        super().__init__(config, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in (1, 2, 3):
            strategy_registry.register(f"zero{stage}", cls, description=f"ZeRO stage {stage}", stage=stage,
                                       override=True)
        strategy_registry.register("fsdp2", cls, description="FSDP2 = ZeRO stage 3", stage=3, override=True)
