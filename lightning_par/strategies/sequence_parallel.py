"""SequenceParallelStrategy (``sequence_parallel``): context parallel, each sequence split over ranks."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_par.config import ParallelConfig
from lightning_par.strategies.base import SIZE_ARGUMENTS, MeshStrategy


class SequenceParallelStrategy(MeshStrategy):
    """Context parallelism: every sequence is split over ``context_parallel_size`` ranks.

    The blocks run on ``T / context_parallel_size`` tokens per rank; attention reaches the other ranks'
    tokens by the chosen ``method`` (see ``lightning_par.parallel.sequence``). The remaining ranks
    (``world_size / context_parallel_size``) are data parallel; gradients are averaged over data and
    context ranks together, by DDP (``zero_stage=0``) or FSDP2 (``zero_stage=3``).

    Args:
        context_parallel_size: ranks that share one sequence.
        method: ``ulysses`` (all-to-all of heads and sequence; heads must divide by
            ``context_parallel_size``) or ``ring`` (key/value blocks passed round the ranks, causal load
            balancing; the sequence length must divide by ``2 x context_parallel_size``).
        data_parallel_size: ``"auto"``: every remaining rank.
        zero_stage: 0 (DDP over data and context ranks) or 3 (FSDP2 shards over them).
        activation_checkpointing: ``none``, ``full`` or ``selective`` recomputation per block.
        activation_checkpointing_every: checkpoint one block in this many.
        plan: where the model keeps its blocks (derived for standard decoders; see docs/architecture.md).
        save_distributed_checkpoint: sharded DCP directory (default) or one full file from rank 0.
    """

    strategy_name = "sequence_parallel"
    argument_names = {**SIZE_ARGUMENTS, "dp_shard": "data_parallel_size", "cp_method": "method"}
    strategy_description = "context parallel: Ulysses or ring attention"

    def __init__(
        self,
        context_parallel_size: int = 2,
        method: Literal["ulysses", "ring"] = "ulysses",
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        zero_stage: Literal[0, 3] = 0,
        activation_checkpointing: Literal["none", "full", "selective"] = "none",
        activation_checkpointing_every: int = 1,
        plan: dict[str, Any] | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        config = ParallelConfig(cp=context_parallel_size, cp_method=method, dp_shard=data_parallel_size,
                                zero_stage=zero_stage, activation_checkpointing=activation_checkpointing,
                                activation_checkpointing_every=activation_checkpointing_every)
        super().__init__(config, plan=plan, save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout, **kwargs)
