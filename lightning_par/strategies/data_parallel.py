"""DataParallelStrategy (``strategy="data_parallel"``): DDP over the data-parallel ranks of the mesh."""

from __future__ import annotations

from typing import Any

from lightning_par.layout.config import GradientCompression, ParallelConfig, Size
from lightning_par.layout.dimensions import strategy_spelling
from lightning_par.strategies.base import MeshStrategy


class DataParallelStrategy(MeshStrategy):
    """Distributed data parallel (Li et al. 2020) on lightning_par's mesh.

    Every rank holds the whole model and reads its own shard of the data; gradients are averaged with
    bucketed all-reduces that overlap the backward pass. Under gradient accumulation the all-reduce runs
    only on the last micro-batch before each optimizer step.

    Args:
        data_parallel_size: ranks that read different samples (in every strategy; here each holds a whole replica
            of the model); ``"auto"`` uses every process.
        bucket_cap_mb: gradient bucket size of the all-reduce (larger: fewer, bigger messages).
        static_graph: tell DDP the set of used parameters never changes (enables more overlap).
        find_unused_parameters: allow parameters that receive no gradient in a step (costs a graph walk).
        gradient_compression: ``"bf16"`` or ``"fp16"`` halves all-reduce bytes; ``"none"`` keeps fp32.
    """

    strategy_name = "data_parallel"
    strategy_description = "DDP over lightning_par's data-parallel mesh"

    def __init__(self, data_parallel_size: Size = "auto", bucket_cap_mb: float = 25.0, static_graph: bool = False,
                 find_unused_parameters: bool = False, gradient_compression: GradientCompression = "none",
                 **kwargs: Any) -> None:
        config = ParallelConfig(
            dp_replicate=data_parallel_size,
            dp_shard=1,
            ddp_bucket_cap_mb=bucket_cap_mb,
            ddp_static_graph=static_graph,
            ddp_find_unused_parameters=find_unused_parameters,
            gradient_compression=gradient_compression,
            spelling=strategy_spelling("dp_replicate"),
        )
        super().__init__(config, **kwargs)
