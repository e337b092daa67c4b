"""Blocks whose parts the network calls from outside the block's own forward.

A DiT computes its final modulation with the timestep embedding of block 0 (``transformer_blocks[0].norm1.emb``)
after the last block has run. ZeRO-3 gathers a block's parameters when the block's forward starts and frees them
when it ends, so such a call would meet sharded parameters. Found by one forward of a small copy of the model
(``lightning_par.parallel.small_copy``: the first blocks, one of each kind, random values), such a block is not an
FSDP2 unit of its own (``lightning_par.parallel.zero.fully_shard_model``): its parameters join the root's unit,
gathered for the whole forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.parallel.model_map import ModelMap
from lightning_par.parallel.small_copy import small_copy


def blocks_used_outside(module: nn.Module, model_map: ModelMap, inputs: Tensor,
                        device: torch.device) -> dict[str, list[str]]:
    """``{block name: [its submodules called outside it]}`` for the forward of ``module`` on the first row of
    ``inputs`` (full names; blocks beyond the first of each kind are not run)."""
    model_copy = small_copy(module, model_map.blocks, device, torch.float32)
    running: list[nn.Module] = []
    found: dict[str, list[str]] = {}
    handles = []

    def enter(block: nn.Module) -> Any:
        return lambda *_: running.append(block)

    def leave(*_: Any) -> None:
        running.pop()

    def called(block: nn.Module, block_name: str, name: str) -> Any:
        def hook(*_: Any) -> None:
            parts = found.setdefault(block_name, [])
            if not any(r is block for r in running) and not any(name.startswith(p + ".") or name == p for p in parts):
                parts.append(name)
        return hook

    for index, block in model_copy.get_submodule(model_map.blocks).named_children():
        block_name = f"{model_map.blocks}.{index}"
        handles.append(block.register_forward_pre_hook(enter(block)))
        handles.append(block.register_forward_hook(leave, always_call=True))
        for name, sub in block.named_modules():
            if name and next(sub.parameters(), None) is not None:
                handles.append(sub.register_forward_pre_hook(called(block, block_name, f"{block_name}.{name}")))
    sample = inputs[:1].to(device)
    try:
        with torch.no_grad():
            model_copy(sample.float() if sample.is_floating_point() else sample)
    finally:
        for handle in handles:
            handle.remove()
    return {block: parts for block, parts in found.items() if parts}


__all__ = ["blocks_used_outside"]
