"""TensorParallelStrategy (``tensor_parallel``): Megatron-style tensor parallelism on the mesh."""

from __future__ import annotations

from typing import Any

from lightning_par.layout.config import ParallelConfig, Size
from lightning_par.layout.dimensions import strategy_spelling
from lightning_par.strategies.base import MeshStrategy


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallelism (Shoeybi et al. 2019) on DTensor, with FSDP2 over the remaining ranks.

    Each block's attention heads and MLP hidden units are split over ``tensor_parallel_size`` ranks, the
    embedding and head over the vocabulary (see ``lightning_par.parallel.tensor``). The remaining ranks
    (``world_size / tensor_parallel_size``) are data parallel; their gradients and model states are
    sharded with FSDP2 (ZeRO-3), the data parallelism that composes with DTensor.

    Args:
        tensor_parallel_size: ranks that split each layer (keep them inside a node: they all-reduce twice
            per block in forward and backward).
        data_parallel_size: ranks that read different samples; ``"auto"``: every remaining rank.
        sequence_parallel: keep norm/residual activations split along the sequence between the
            tensor-parallel regions (all-gather + reduce-scatter instead of all-reduce; the sequence length
            must be divisible by ``tensor_parallel_size``).
        loss_parallel: keep the logits split over the vocabulary and compute the cross-entropy on the
            shards (never gathering (B, T, vocab) logits). ``F.cross_entropy``/``F.nll_loss`` in the
            LightningModule work unchanged and return plain tensors; other uses of the logits see a
            DTensor (``logits.full_tensor()`` gathers them).
        model_map: which layers are column-/row-wise (derived for standard decoders; see docs/architecture.md).
    """

    strategy_name = "tensor_parallel"
    strategy_description = "Megatron-style tensor parallel on DTensor"

    def __init__(self, tensor_parallel_size: int = 2, data_parallel_size: Size = "auto",
                 sequence_parallel: bool = False, loss_parallel: bool = False, **kwargs: Any) -> None:
        config = ParallelConfig(tp=tensor_parallel_size, dp_shard=data_parallel_size, zero_stage=3,
                                sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                spelling=strategy_spelling("dp_shard"))
        super().__init__(config, **kwargs)
