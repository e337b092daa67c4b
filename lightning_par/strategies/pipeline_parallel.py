"""PipelineParallelStrategy (``pipeline_parallel``): stages of blocks on successive ranks, micro-batched."""

from __future__ import annotations

from typing import Any

from lightning_par.layout.config import ParallelConfig, PipelineBalance, PipelineSchedule
from lightning_par.layout.dimensions import strategy_spelling
from lightning_par.strategies.base import MeshStrategy


class PipelineParallelStrategy(MeshStrategy):
    """Pipeline parallelism on ``torch.distributed.pipelining``: each rank holds consecutive blocks.

    The first stage owns the embedding, the last the final norm, the head and the loss. Each batch is
    split into ``microbatches`` that flow through the stages in the order of ``pipeline_schedule`` (see
    ``lightning_par.parallel.pipeline``).

    The model contract (the schedule runs forward and loss itself, so ``training_step`` and ``validation_step``
    are not called): ``split_batch(batch) -> (inputs, targets)``, ``forward(inputs) -> logits`` through a network
    submodule that holds the blocks, embedding and head, and ``loss_fn(logits, targets) -> mean loss``. The
    strategy logs ``train_loss`` / ``val_loss`` / ``test_loss``, the same value on every rank
    (``lightning_par.parallel.pipeline.runner``).

    Args:
        pipeline_parallel_size: number of ranks the stages are spread over.
        pipeline_schedule: a schedule of ``lightning_par.layout.schedules.SCHEDULES``, each row saying its stages
            per rank, placement and fewest micro-batches: ``gpipe``, ``1f1b``, ``interleaved_1f1b``
            (``virtual_stages`` stages per rank), ``zbv`` (two stages per rank in a V, zero-bubble), ``dualpipev``
            (DeepSeek's DualPipe in a V), ...
        microbatches: micro-batches per batch (the batch size must divide by it; 1F1B-type schedules need
            at least ``pipeline_parallel_size``, ``dualpipev`` twice that).
        virtual_stages: stages per rank for a schedule of virtual stages (``interleaved_1f1b``).
        pipeline_balance: how blocks are assigned to stages without split points in the model map: ``parameters``
            (equal parameter counts, embedding and head included) or ``profile`` (measured forward +
            backward time per block, embedding and head/loss).
        model_map: where the model keeps its blocks; ``split_points`` names the blocks that start stages.
        save_distributed_checkpoint: must be true (each rank saves its stages; ``lightning-par-export``
            consolidates).
    """

    strategy_name = "pipeline_parallel"
    strategy_description = "pipeline parallel (GPipe, 1F1B, interleaved, ZB-V, DualPipeV)"

    def __init__(self, pipeline_parallel_size: int = 2, pipeline_schedule: PipelineSchedule = "1f1b",
                 microbatches: int = 4, virtual_stages: int = 2, pipeline_balance: PipelineBalance = "parameters",
                 **kwargs: Any) -> None:
        config = ParallelConfig(pp=pipeline_parallel_size, dp_shard=1, pp_schedule=pipeline_schedule,
                                microbatches=microbatches, pp_virtual_stages=virtual_stages,
                                pp_balance=pipeline_balance, spelling=strategy_spelling(None))
        super().__init__(config, **kwargs)
