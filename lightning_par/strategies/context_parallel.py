"""ContextParallelStrategy (``context_parallel``): each sequence split over ranks. Megatron's sequence parallelism
(Korthikanti et al. 2022) is a tensor-parallel option instead (``sequence_parallel=True`` of ``tensor_parallel`` and
``hybrid3d``)."""

from __future__ import annotations

from typing import Any, Literal

from lightning_par.layout.config import ContextParallelMethod, ParallelConfig, Size
from lightning_par.layout.dimensions import strategy_spelling
from lightning_par.strategies.base import MeshStrategy


class ContextParallelStrategy(MeshStrategy):
    """Context parallelism: every sequence is split over ``context_parallel_size`` ranks.

    The blocks run on ``T / context_parallel_size`` tokens per rank; attention reaches the other ranks'
    tokens by the chosen ``context_parallel_method`` (see ``lightning_par.parallel.context``). The remaining ranks
    (``world_size / context_parallel_size``) are data parallel; gradients are averaged over data and
    context ranks together, by DDP (``zero_stage=0``) or FSDP2 (``zero_stage=3``).

    Args:
        context_parallel_size: ranks that share one sequence.
        context_parallel_method: ``ulysses`` (all-to-all of heads and sequence; heads must divide by
            ``context_parallel_size``), ``ring`` (key/value blocks passed round the ranks, causal load
            balancing; the sequence length must divide by ``2 x context_parallel_size``) or ``allgather``
            (Llama 3's: keys and values all-gathered, the same balancing); docs/context_parallel.md.
        data_parallel_size: ranks that read different samples; ``"auto"``: every remaining rank.
        zero_stage: 0 (DDP over data and context ranks) or 3 (FSDP2 shards over them).
    """

    strategy_name = "context_parallel"
    strategy_description = "context parallel: Ulysses, ring or all-gathered-keys attention"

    def __init__(self, context_parallel_size: int = 2, context_parallel_method: ContextParallelMethod = "ulysses",
                 data_parallel_size: Size = "auto", zero_stage: Literal[0, 3] = 0, **kwargs: Any) -> None:
        config = ParallelConfig(cp=context_parallel_size, cp_method=context_parallel_method,
                                dp_shard=data_parallel_size, zero_stage=zero_stage,
                                spelling=strategy_spelling("dp_shard"))
        super().__init__(config, **kwargs)

