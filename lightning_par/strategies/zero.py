"""ZeroStrategy (``zero1``, ``zero2``, ``zero3``, ``fsdp2``): ZeRO stages 1-3 and HSDP on the mesh."""

from __future__ import annotations

from typing import Any, Optional

from typing_extensions import override

from lightning_par.layout.config import Dtype, ParallelConfig, Size, shard_size
from lightning_par.layout.dimensions import strategy_spelling
from lightning_par.layout.zero_stages import ZERO_STAGE_ROWS
from lightning_par.strategies.base import MeshStrategy
from lightning_par.strategies.fault_tolerant import FaultTolerantReplicas, check_fault_tolerance


class ZeroStrategy(FaultTolerantReplicas, MeshStrategy):
    """ZeRO (Rajbhandari et al. 2020): shard model states over the data-parallel ranks.

    Args:
        zero_stage: 1 shards optimizer states, 2 also gradients, 3 also parameters (FSDP2, units of the
            transformer blocks of the model map: ``blocks_per_unit``). See ``lightning_par.parallel.zero``.
        data_parallel_size: ranks that read different samples (``replicate_size x`` sharded ranks); ``"auto"``
            uses every process.
        replicate_size: HSDP. Shard inside groups of ``data_parallel_size / replicate_size`` ranks and
            replicate across the groups (e.g. shard within a node, replicate across nodes).
        reshard_after_forward: stage 3 only. ``False`` keeps each block's gathered parameters from
            forward until backward (one all-gather per block instead of two, more memory).
        keep_gathered_blocks: stage 3 only. Keep the last N blocks gathered from forward until backward, which
            starts with them: N all-gathers fewer per step for N blocks' memory.
        prefetch_blocks: stage 3 only. Gather the next N blocks' parameters as a block starts, in forward and in
            backward (0: FSDP2's own lookahead of one block in backward).
        blocks_per_unit: stage 3 only. Gather and reduce every K consecutive blocks together, as one FSDP2 unit:
            K times fewer collectives and hooks, for K blocks gathered at once (see ``lightning_par.parallel.zero``).
            ``"auto"`` (the default, for any of these three): chosen from the size of the model's blocks and the
            least memory of any rank at set-up, and logged (``lightning_par.layout.zero_units.choose_units``).
        param_dtype: stage 3 only. Compute in ``bf16``/``fp16`` from fp32 shards (mixed precision);
            for stages 1-2 use ``Trainer(precision="bf16-mixed")``.
        reduce_dtype: stage 3 only. Dtype of the gradient reduce-scatter (default: ``param_dtype``;
            ``fp32`` keeps full-precision reductions under bf16 compute).
        cpu_offload: stage 3 only. Shards, gradients and optimizer states live in host memory.
        sharded_accumulation: stages 2 and 3, under ``accumulate_grad_batches``: reduce gradients on every
            micro-batch so that each rank keeps only its part between them (gradient memory ``1/N``, the
            reduction traffic once per micro-batch), instead of accumulating whole gradients and reducing once.
        fault_tolerance: fault-tolerant HSDP with torchft (``lightning_par.health.fault_tolerance``): this launch
            is one replica group of ``{"replica_groups": R, "min_replicas": K, "spares": False, "lighthouse":
            "http://host:port", "replica_group_id": G}`` (``lighthouse`` and ``replica_group_id`` default to
            ``$TORCHFT_LIGHTHOUSE`` and ``$REPLICA_GROUP_ID``; ``spares``: keep the global batch at K groups, see
            ``FaultTolerance``). FSDP2 shards over the group's ranks; gradients are averaged across the groups
            that are up, and a restarted group heals from the others. zero_stage=3 and replicate_size=1 only.
    """

    strategy_name = "zero"

    def __init__(self, zero_stage: int = 3, data_parallel_size: Size = "auto", replicate_size: int = 1,
                 reshard_after_forward: bool = True, param_dtype: Dtype = "fp32", reduce_dtype: Optional[Dtype] = None,
                 cpu_offload: bool = False, sharded_accumulation: bool = False, keep_gathered_blocks: Size = "auto",
                 prefetch_blocks: Size = "auto", blocks_per_unit: Size = "auto",
                 fault_tolerance: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        units = self._unit_controls(keep_gathered_blocks=keep_gathered_blocks, prefetch_blocks=prefetch_blocks,
                                    blocks_per_unit=blocks_per_unit)
        config = ParallelConfig(dp_replicate=replicate_size, dp_shard=shard_size(data_parallel_size, replicate_size),
                                zero_stage=zero_stage, reshard_after_forward=reshard_after_forward,
                                param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload,
                                sharded_accumulation=sharded_accumulation, **units,
                                spelling=strategy_spelling("dp_shard" if replicate_size == 1 else "dp"))
        super().__init__(config, **kwargs)
        self._fault_tolerance = check_fault_tolerance(fault_tolerance, self.parallel_config)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for row in ZERO_STAGE_ROWS.values():
            if row.shards_optimizer_states:  # "zero0" would be DDP under another name
                strategy_registry.register(f"zero{row.level}", cls, description=f"ZeRO stage {row.level} ({row.label})",
                                           zero_stage=row.level, override=True)
        strategy_registry.register("fsdp2", cls, description="FSDP2 = ZeRO stage 3", zero_stage=3, override=True)
