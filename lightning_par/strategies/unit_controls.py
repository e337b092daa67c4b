"""ZeRO-3's gather controls left ``"auto"`` in a strategy's arguments (their default), resolved at set-up from the
model's blocks and the least memory of any rank (``lightning_par.layout.zero_units.choose_units``; docs/zero.md)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.layout.config import DTYPES, ZERO3_UNIT_DEFAULTS, ParallelConfig
from lightning_par.parallel.model_map import ModelMap
from lightning_par.layout.zero_units import choose_units


def split_auto(given: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The controls as a configuration holds them until set-up (``"auto"`` -> the default), and which were auto."""
    auto = {name for name, value in given.items() if value == "auto"}
    return {name: ZERO3_UNIT_DEFAULTS[name] if name in auto else value for name, value in given.items()}, auto


def resolve_units(config: ParallelConfig, auto: set[str], module: nn.Module, model_map: ModelMap | None,
                  device: torch.device, processes: int, *, log: Callable[[str], None]) -> ParallelConfig:
    """``config`` with the controls named in ``auto`` chosen for ZeRO-3 from the sizes of ``module``'s blocks and
    the memory (logged once); unchanged without ZeRO-3, a model map or anything left auto. Collective when it chooses:
    every rank must call it alike."""
    if not auto or not config.zero.shards_parameters or model_map is None:
        return config
    blocks = [block for block in module.get_submodule(model_map.blocks).children()
              if next(block.parameters(), None) is not None]
    # what a block's all-gather produces on a rank: its parameters in the compute dtype, less tensor parallel's split
    compute_dtype = getattr(torch, DTYPES[config.param_dtype])
    gathered = [sum(p.numel() * compute_dtype.itemsize for p in block.parameters()) / config.tp
                for block in blocks][: max(1, len(blocks) // config.pp)]
    choice = choose_units(gathered, memory_bytes=least_memory(device, processes), prefetch=config.pp == 1,
                          accelerator=device.type != "cpu",
                          blocks_per_unit=None if "blocks_per_unit" in auto else config.blocks_per_unit)
    log(f"ZeRO-3 {choice.describe()} (chosen for {', '.join(sorted(auto))}: set them to override)")
    return dataclasses.replace(config, **{name: getattr(choice, name) for name in auto})


def least_memory(device: torch.device, processes: int) -> float | None:
    """A rank's device memory (on a CPU its share of the host's among ``processes``; None where unknown), the least
    over every rank: ranks must choose the same units, whose collectives FSDP2 runs together, and a mixed cluster's
    differ."""
    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else host_memory() / max(1, processes) if device.type == "cpu" else 0.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        least = torch.tensor([memory], dtype=torch.float64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        memory = least.item()
    return memory or None


def host_memory() -> float:
    """The machine's physical memory in bytes (0 where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


__all__ = ["host_memory", "least_memory", "resolve_units", "split_auto"]
