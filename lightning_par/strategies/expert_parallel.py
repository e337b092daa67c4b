"""ExpertParallelStrategy (``expert_parallel``): MoE experts split over ranks, tokens routed by all-to-all."""

from __future__ import annotations

from typing import Any, Literal, Union

from lightning_par.config import ParallelConfig, Recompute
from lightning_par.strategies.base import SIZE_ARGUMENTS, MeshStrategy


class ExpertParallelStrategy(MeshStrategy):
    """Expert parallelism (GShard, Lepikhin et al. 2021) for models with ``MoEFeedForward`` blocks.

    The experts of every MoE block are split over groups of ``expert_parallel_size`` ranks; each token is
    sent to the rank holding each of its experts and its results come back (two all-to-alls forward, two
    backward). The ranks are borrowed from data parallelism: with ``expert_parallel_size=4`` on 4
    processes the dense layers stay 4-way data parallel (DDP), while each expert lives on one rank.
    See ``lightning_par.parallel.experts``.

    Args:
        expert_parallel_size: ranks that share one copy of the experts (must divide the data-parallel
            size and every MoE block's number of experts).
        data_parallel_size: ``"auto"``: every process.
        activation_checkpointing: ``none``, ``full`` or ``selective`` recomputation per block.
        activation_checkpointing_every: checkpoint one block in this many.
        plan: where the model keeps its blocks (derived for standard decoders).
        save_distributed_checkpoint: sharded DCP directory (default) or one full file from rank 0.
    """

    strategy_name = "expert_parallel"
    argument_names = {**SIZE_ARGUMENTS, "dp_shard": "data_parallel_size"}
    strategy_description = "MoE experts split over ranks"

    def __init__(
        self,
        expert_parallel_size: int = 2,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        activation_checkpointing: Recompute = "none",
        activation_checkpointing_every: int = 1,
        **kwargs: Any,
    ) -> None:
        config = ParallelConfig(ep=expert_parallel_size, dp_shard=data_parallel_size,
                                activation_checkpointing=activation_checkpointing,
                                activation_checkpointing_every=activation_checkpointing_every)
        super().__init__(config, **kwargs)
