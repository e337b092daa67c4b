"""What Muon adds to a training step (``optimizer="muon"``, ``lightning_par.optim.muon``).

* States: one momentum buffer per matrix of the blocks (4 bytes a parameter in fp32), AdamW's two moments for the
  rest (embedding, head, gains): model states of 12 bytes a block matrix's parameter instead of AdamW's 16.
* The Newton-Schulz iteration, per ``rows x cols`` matrix (``m = min, n = max``): each of its 5 steps forms
  ``A = XX^T`` (``2m^2 n`` FLOPs), ``bA + cA^2`` (``2m^3``) and ``(..)X`` (``2m^2 n``). A rank runs it for every
  matrix it holds a piece of: whole on every rank of a ZeRO-3 or tensor-parallel shard's mesh, once by its owner
  under ZeRO-1/2 (a share of the matrices), on every rank under plain data parallel (as torch's Muon under DDP).
* The all-gather of each sharded matrix's update (ZeRO-3 over ``dp_shard x cp`` and ``tp``, tensor parallel over
  ``tp``), in fp32, exposed: it runs in the optimizer step. Stacks of expert matrices split by whole experts need no
  gather.
"""

from __future__ import annotations

from lightning_par.layout.config import ParallelConfig
from lightning_par.planner.model import ModelSpec

NEWTON_SCHULZ_STEPS = 5
_ATTENTION_AND_ROUTER = ("q", "k", "v", "o", "router")


def block_matrices(model: ModelSpec, moe: bool) -> tuple[tuple[str, int, int, int], ...]:
    """``(name, rows, cols, count)`` of the matrices of a dense (or MoE) block that Muon steps
    (``ModelSpec.block_matmuls``; an expert projection is a stack of ``moe_experts`` matrices)."""
    shapes = []
    for name, weights, width in model.block_matmuls(moe):
        experts = moe and name not in _ATTENTION_AND_ROUTER
        per_token = model.moe_top_k if experts else 1  # the top-k copies of a token each meet one expert's matrix
        shapes.append((name, weights // width, width // per_token, model.moe_experts if experts else 1))
    return tuple(shapes)


def newton_schulz_flops(rows: int, cols: int, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def muon_step(model: ModelSpec, config: ParallelConfig, n_dense: int, n_moe: int) -> tuple[float, float]:
    """(Newton-Schulz FLOPs, bytes all-gathered) of one optimizer step on a rank holding ``n_dense`` dense and
    ``n_moe`` MoE blocks."""
    zero, partition = config.zero, int(config.dp_shard) * config.cp
    owners = partition if zero.shards_optimizer_states and not zero.shards_parameters else 1
    sharded = config.tp * (partition if zero.shards_parameters else 1)
    flops = gathered = 0.0
    for blocks, moe in ((n_dense, False), (n_moe, True)):
        if not blocks:
            continue
        for name, rows, cols, count in block_matrices(model, moe):
            if moe and name not in _ATTENTION_AND_ROUTER:  # this rank's experts, whole: no gather
                flops += blocks * count / config.ep * newton_schulz_flops(rows, cols) / owners
            else:
                flops += blocks * count * newton_schulz_flops(rows, cols) / owners
                gathered += blocks * count * 4.0 * rows * cols * (sharded - 1) / sharded / owners
    return flops, gathered


def muon_state_share(muon_params: float, params: float) -> float:
    """Optimizer-state bytes under Muon as a share of AdamW's: ``muon_params`` of ``params`` keep one buffer, not two."""
    return 1.0 - muon_params / (2 * params) if params else 1.0


__all__ = ["NEWTON_SCHULZ_STEPS", "block_matrices", "muon_state_share", "muon_step", "newton_schulz_flops"]
