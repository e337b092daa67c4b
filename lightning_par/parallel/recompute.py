"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

- ``full``: a checkpointed block keeps only its input; backward re-runs the whole block
  (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").
- ``selective``: a checkpointed block keeps the outputs of its matmuls and attention, and recomputes
  only the cheap element-wise work around them (norms, activations, rotary, residual adds): most of the
  memory of full recomputation for a fraction of its FLOPs (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models").
- ``op``: per-op selective checkpointing as torchtitan's ``op`` policy runs it: a checkpointed block keeps
  its attention outputs and every second matmul output (the first, third, ... of each block call), and
  recomputes the rest. Between the two above: about half of selective's kept matmul outputs, for one
  recomputed matmul in two.

``every`` checkpoints one block in ``every`` (1: all of them), trading memory for recompute time.
Blocks come from the model map; the wrapper keeps parameter names (checkpoint wrappers strip their own
prefix from state dicts), so checkpoints stay compatible with and without recomputation.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_par.layout.config import RECOMPUTE_MODES
from lightning_par.parallel.model_map import ModelMap

# Ops whose outputs selective recomputation keeps: the expensive ones. Everything else is recomputed.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


# Grouped experts' GEMM (models.moe.grouped_matmul), where this torch has it.
_GROUPED_MM = {torch.ops.aten._grouped_mm.default} if hasattr(torch.ops.aten, "_grouped_mm") else set()
_SAVED_OPS |= _GROUPED_MM
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, *_GROUPED_MM}


def _keep_matmul_outputs(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _every_second_matmul_contexts() -> tuple[object, object]:
    """One block call's contexts for ``op``: a fresh count of matmuls for its forward, and one for its recomputation
    where a torch version asks the policy again there, so both passes pick the same outputs."""
    counts = {False: 0, True: 0}

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if op in _MATMULS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in _SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(module: nn.Module, model_map: ModelMap | None, *, mode: str = "full",
                                   every: int = 1) -> nn.Module:
    """Wrap the blocks of ``model_map`` in ``module`` for recomputation; returns ``module`` (changed in place)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {RECOMPUTE_MODES}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"activation_checkpointing_every must be a positive integer, got {every!r}")
    if mode == "none":
        return module
    if model_map is None:
        raise ValueError(
            f"activation_checkpointing={mode!r} needs to know where the transformer blocks are, and no model "
            "map was found: give the strategy a model map (model_map: {blocks: ...}) or use a standard decoder layout"
        )
    container = module.get_submodule(model_map.blocks)
    for index, (name, block) in enumerate(list(container.named_children())):
        if index % every != 0 or next(block.parameters(), None) is None:
            continue  # not this one, or nothing to recompute (a pipeline stage's pass-through)
        if mode == "full":
            wrapped = checkpoint_wrapper(block)
        elif mode == "selective":
            wrapped = checkpoint_wrapper(block, context_fn=partial(create_selective_checkpoint_contexts,
                                                                   _keep_matmul_outputs))
        else:
            wrapped = checkpoint_wrapper(block, context_fn=_every_second_matmul_contexts)
        container.register_module(name, wrapped)
    return module


__all__ = ["apply_activation_checkpointing", "RECOMPUTE_MODES"]
