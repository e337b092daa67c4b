"""ExpertParallelStrategy (``expert_parallel``): MoE experts split over ranks, tokens routed by all-to-all."""

from __future__ import annotations

from typing import Any

from lightning_par.layout.config import ParallelConfig, Size
from lightning_par.layout.dimensions import strategy_spelling
from lightning_par.strategies.base import MeshStrategy


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
        data_parallel_size: ranks that read different samples; ``"auto"``: every process.
    """

    strategy_name = "expert_parallel"
    strategy_description = "MoE experts split over ranks"

    def __init__(self, expert_parallel_size: int = 2, data_parallel_size: Size = "auto", **kwargs: Any) -> None:
        config = ParallelConfig(ep=expert_parallel_size, dp_shard=data_parallel_size,
                                spelling=strategy_spelling("dp_shard"))
        super().__init__(config, **kwargs)
