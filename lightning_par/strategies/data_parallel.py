"""DataParallelStrategy (``strategy="data_parallel"``): DDP over the data-parallel ranks of the mesh."""

from __future__ import annotations

from typing import Any, Literal, Union

from lightning_par.config import GradientCompression, ParallelConfig, Recompute
from lightning_par.strategies.base import DDP_ARGUMENTS, SIZE_ARGUMENTS, MeshStrategy


class DataParallelStrategy(MeshStrategy):
    """Distributed data parallel (Li et al. 2020) on lightning_par's mesh.

    Every rank holds the whole model and reads its own shard of the data; gradients are averaged with
    bucketed all-reduces that overlap the backward pass. Under gradient accumulation the all-reduce runs
    only on the last micro-batch before each optimizer step.

    Args:
        data_parallel_size: number of model replicas; ``"auto"`` uses every process.
        bucket_cap_mb: gradient bucket size of the all-reduce (larger: fewer, bigger messages).
        static_graph: tell DDP the set of used parameters never changes (enables more overlap).
        find_unused_parameters: allow parameters that receive no gradient in a step (costs a graph walk).
        gradient_compression: ``"bf16"`` or ``"fp16"`` halves all-reduce bytes; ``"none"`` keeps fp32.
        activation_checkpointing: ``none``, ``full`` or ``selective`` recomputation per block.
        activation_checkpointing_every: checkpoint one block in this many.
        plan: where the model keeps its blocks (derived for standard decoders; see docs/architecture.md).
        save_distributed_checkpoint: sharded DCP directory (default) or one full file from rank 0.
    """

    strategy_name = "data_parallel"
    strategy_description = "DDP over lightning_par's data-parallel mesh"
    argument_names = {**SIZE_ARGUMENTS, **DDP_ARGUMENTS, "dp_replicate": "data_parallel_size"}

    def __init__(
        self,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        bucket_cap_mb: float = 25.0,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_compression: GradientCompression = "none",
        activation_checkpointing: Recompute = "none",
        activation_checkpointing_every: int = 1,
        **kwargs: Any,
    ) -> None:
        config = ParallelConfig(
            dp_replicate=data_parallel_size,
            dp_shard=1,
            ddp_bucket_cap_mb=bucket_cap_mb,
            ddp_static_graph=static_graph,
            ddp_find_unused_parameters=find_unused_parameters,
            gradient_compression=gradient_compression,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_every=activation_checkpointing_every,
        )
        super().__init__(config, **kwargs)
