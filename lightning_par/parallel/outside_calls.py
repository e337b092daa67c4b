"""Blocks whose parts the network calls from outside the block's own forward.

A DiT computes its final modulation with the timestep embedding of block 0 (``transformer_blocks[0].norm1.emb``)
after the last block has run. ZeRO-3 gathers a block's parameters when the block's forward starts and frees them
when it ends, so such a call would meet sharded parameters. Found by one forward of a small copy of the model
(``lightning_par.parallel.small_copy``: the first blocks, one of each kind, random values), such a block is not an
FSDP2 unit of its own (``lightning_par.parallel.zero.fully_shard_model``): its parameters join the root's unit,
gathered for the whole forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.parallel.model_map import ModelMap
from lightning_par.parallel.small_copy import model_dtype, small_copy
from lightning_par.parallel.model_call import run_model


@dataclass(frozen=True)
class PartCall:
    """A call of a part of a block (a submodule holding parameters), and where the forward was then."""

    block: str  # the block's full name
    part: str  # the part's full name
    inside_its_block: bool  # its own block's forward was running (or another's that holds the same part)
    inside_a_block: bool  # some block's forward was running
    after_every_block_started: bool


@contextmanager
def watching_block_parts(blocks: Iterable[tuple[str, nn.Module]]) -> Iterator[list[PartCall]]:
    """Record every call of a part of ``blocks`` ((full name, block) pairs) while the context is open: a list the
    context yields, filled as the forward runs. The pipeline trace keeps the calls after every block; ZeRO-3 those
    outside their own block."""
    blocks = list(blocks)
    running: list[nn.Module] = []
    started: set[int] = set()
    calls: list[PartCall] = []
    handles = []

    def enter(block: nn.Module) -> Any:
        def hook(*_: Any) -> None:
            running.append(block)
            started.add(id(block))
        return hook

    def leave(*_: Any) -> None:  # (a forward hook that returned the popped block would replace the output)
        running.pop()

    # A part several blocks hold (a shared transformer block) runs inside its own block when any of them runs it.
    holders: dict[int, list[nn.Module]] = {}
    for _, block in blocks:
        for sub in block.modules():
            holders.setdefault(id(sub), []).append(block)

    def called(sub: nn.Module, block_name: str, part: str) -> Any:
        def hook(*_: Any) -> None:
            inside = any(r is b for r in running for b in holders[id(sub)])
            calls.append(PartCall(block_name, part, inside, bool(running), len(started) == len(blocks)))
        return hook

    for block_name, block in blocks:
        handles.append(block.register_forward_pre_hook(enter(block)))
        handles.append(block.register_forward_hook(leave, always_call=True))
        for name, sub in block.named_modules():
            if name and next(sub.parameters(), None) is not None:
                handles.append(sub.register_forward_pre_hook(called(sub, block_name, f"{block_name}.{name}")))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def outermost(names: Iterable[str]) -> list[str]:
    """``names`` without repeats and without those inside another of them (a part's own submodules)."""
    names = list(dict.fromkeys(names))
    return [n for n in names if not any(n.startswith(other + ".") for other in names)]


def blocks_used_outside(module: nn.Module, model_map: ModelMap, inputs: Tensor,
                        device: torch.device) -> dict[str, list[str]]:
    """``{block name: [its submodules called outside it]}`` for the forward of ``module`` on the first row of
    ``inputs`` (full names; blocks beyond the first of each kind are not run)."""
    dtype = model_dtype(module)
    model_copy = small_copy(module, model_map.blocks, device, dtype)
    blocks = [(f"{model_map.blocks}.{index}", block)
              for index, block in model_copy.get_submodule(model_map.blocks).named_children()]
    sample = inputs[:1].to(device)
    with watching_block_parts(blocks) as calls, torch.no_grad():
        run_model(model_copy, sample.to(dtype) if sample.is_floating_point() else sample)
    outside: dict[str, list[str]] = {}
    for call in calls:
        if not call.inside_its_block:
            outside.setdefault(call.block, []).append(call.part)
    return {block: outermost(parts) for block, parts in outside.items()}


__all__ = ["PartCall", "blocks_used_outside", "outermost", "watching_block_parts"]
