"""ZeRO-3's gather controls chosen from a model's blocks and a rank's memory: how many blocks make one FSDP2 unit,
how many of the last stay gathered from forward into backward, how many are prefetched. The strategies choose them
at set-up for the controls left ``"auto"`` (their default), the planner for the layouts it costs; see
``docs/zero.md``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


# DDP's default bucket (bucket_cap_mb=25): the size above which a collective's fixed cost (its launch, the hooks
# around it, the ranks meeting) is small against moving the bytes.
UNIT_BYTES = 25 * 2**20
# Of a rank's memory, what gathered units may take at once (the running, the prefetched and the kept ones). Chosen,
# not measured; docs/planner.md shows the 405B / 128K plan unchanged from 0.05 to 0.2.
GATHERED_MEMORY_SHARE = 0.1


@dataclass(frozen=True)
class UnitChoice:
    """ZeRO-3's gather controls chosen for a model (see :func:`choose_units`)."""

    blocks_per_unit: int
    keep_gathered_blocks: int
    prefetch_blocks: int
    block_bytes: float  # a block's gathered parameters, the mean over the blocks

    def describe(self) -> str:
        mib = self.block_bytes / 2**20
        plural = "s" if self.blocks_per_unit > 1 else ""
        return (f"units of {self.blocks_per_unit} block{plural} ({self.blocks_per_unit * mib:.1f} MiB gathered, blocks "
                f"of {mib:.1f} MiB against {UNIT_BYTES / 2**20:.0f} MiB that amortise a collective's fixed cost), the "
                f"last {self.keep_gathered_blocks} blocks kept gathered into backward, {self.prefetch_blocks} "
                "prefetched ahead")


def choose_units(block_bytes: Sequence[float], *, memory_bytes: float | None = None, prefetch: bool = True,
                 accelerator: bool = True, blocks_per_unit: int | None = None) -> UnitChoice:
    """Units of enough blocks that each all-gather and reduce-scatter moves about :data:`UNIT_BYTES` (a small block
    pays a collective's fixed cost for few bytes; torch's DDP buckets gradients for the same reason), and one unit
    prefetched ahead (``prefetch=False`` under a pipeline schedule, which orders the blocks itself). The last unit is
    kept gathered from forward into backward, which starts with it (torchtitan does the same for the last block).

    ``accelerator``: the collectives run on a stream of their own beside the compute, so there are at least two
    units, one gathering while another computes; and no more are kept gathered than the last, since a kept unit is
    held at the activations' peak (the start of backward), which is not known at set-up. On CPUs the collectives
    take their time from the cores that compute, fewer units cost less, and the last units are kept gathered as far
    as the memory allows: their all-gathers in backward are saved.

    ``memory_bytes`` (a rank's device memory, or its share of the host's): the gathered units, the running and the
    prefetched one and those kept, stay within :data:`GATHERED_MEMORY_SHARE` of it (unknown: the last unit alone is
    kept). ``blocks_per_unit``: the user's, kept."""
    if not block_bytes:
        return UnitChoice(blocks_per_unit or 1, 0, 0, 0.0)
    blocks, per_block = len(block_bytes), max(1.0, sum(block_bytes) / len(block_bytes))
    budget = GATHERED_MEMORY_SHARE * memory_bytes / per_block if memory_bytes else None  # in blocks
    units = blocks_per_unit
    if units is None:
        units = min(math.ceil(UNIT_BYTES / per_block), max(1, math.ceil(blocks / 2)) if accelerator else blocks)
        if budget is not None:
            units = max(1, min(units, int(budget // 3)))
    kept_units = max(1, int((budget - 2 * units) // units)) if budget is not None and not accelerator else 1
    return UnitChoice(units, min(blocks, kept_units * units), units if prefetch else 0, per_block)


__all__ = ["GATHERED_MEMORY_SHARE", "UNIT_BYTES", "UnitChoice", "choose_units"]
