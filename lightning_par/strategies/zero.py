"""ZeroStrategy (``zero1``, ``zero2``, ``zero3``, ``fsdp2``): ZeRO stages 1-3 and HSDP on the mesh."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from typing_extensions import override

from lightning_par.config import ParallelConfig
from lightning_par.strategies.base import MeshStrategy


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
        plan: dict[str, Any] | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        if isinstance(data_parallel_size, int) and not isinstance(data_parallel_size, bool) and isinstance(
            replicate_size, int) and replicate_size > 0 and data_parallel_size % replicate_size != 0:
            raise ValueError(f"replicate_size={replicate_size} does not divide data_parallel_size="
                             f"{data_parallel_size}: HSDP needs equal shard groups")
        shard: Union[int, Literal["auto"]] = (
            data_parallel_size // replicate_size
            if isinstance(data_parallel_size, int) and isinstance(replicate_size, int) and replicate_size > 0
            else "auto"
        )
        config = ParallelConfig(dp_replicate=replicate_size, dp_shard=shard, zero_stage=stage,
                                reshard_after_forward=reshard_after_forward)
        super().__init__(config, plan=plan, save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in (1, 2, 3):
            strategy_registry.register(f"zero{stage}", cls, description=f"ZeRO stage {stage}", stage=stage,
                                       override=True)
        strategy_registry.register("fsdp2", cls, description="FSDP2 = ZeRO stage 3", stage=3, override=True)
