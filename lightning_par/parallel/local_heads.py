"""Head counts per rank for attention split over tensor-parallel ranks.

A rank of a split attention computes 1/tp of the heads. A model that reshapes its projections by its own head
counts (litgpt's ``config.n_head`` and ``n_query_groups``, BERT's ``num_attention_heads`` and ``all_head_size``,
diffusers' ``heads``, GPT-2's ``split_size``) would cut a rank's share into the global number of heads. Megatron-LM's
attention holds the counts of its partition (``num_attention_heads_per_partition``; Shoeybi et al. 2019); here the
counts a split module keeps are set to each rank's: its own attributes and those of a config object it holds,
which is copied first (one config is often shared by every block and by the model, whose other readers need the
global counts). The tensor-parallel check (:mod:`lightning_par.parallel.model_map_check`) tries this where a split
region does not compute what the whole one does, and keeps it only where the outputs and gradients then agree.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from torch import nn


# Attributes holding a number of heads or a width of all heads, by the names model families give them.
HEAD_COUNT_NAMES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "heads", "n_query_groups",
                    "num_key_value_heads", "num_kv_heads", "n_kv_heads", "all_head_size", "split_size")


def head_counts(module: nn.Module, parts: int) -> dict[str, tuple[int, int]] | None:
    """``attribute`` paths (``config.n_head``, ``self.num_attention_heads``) relative to ``module`` -> (count,
    count per rank) of every head count it and its submodules keep; None when one does not divide by ``parts``
    (the heads cannot be split so)."""
    found: dict[str, tuple[int, int]] = {}
    for name, sub in module.named_modules():
        for path, holder in _holders(name, sub):
            for attribute, value in _counts(holder):
                if value % parts:
                    return None
                found[".".join(filter(None, (path, attribute)))] = (value, value // parts)
    return found


def localize_head_counts(modules: Iterable[nn.Module], parts: int) -> None:
    """Set the head counts of ``modules`` (and their submodules) to each rank's share, in place; a config they hold
    is replaced by a copy (one copy per shared config). Raises ``ValueError`` naming a count ``parts`` does not
    divide (and the tensor-parallel size)."""
    copies: dict[int, Any] = {}
    for module in modules:
        for sub in module.modules():
            config = sub.__dict__.get("config")
            if config is not None and not isinstance(config, nn.Module) and any(True for _ in _counts(config)):
                if id(config) not in copies:
                    copies[id(config)] = _localized(copy.copy(config), parts, type(sub).__name__ + ".config")
                sub.config = copies[id(config)]
            _localized(sub, parts, type(sub).__name__)


def _localized(holder: Any, parts: int, what: str) -> Any:
    counts = list(_counts(holder))
    for attribute, value in counts:  # all checked before any is set
        if value % parts:
            raise ValueError(f"tp={parts!r} does not divide {what}.{attribute}={value}: its heads "
                             f"cannot be split over the tensor-parallel ranks; sizes that fit: "
                             f"{[d for d in range(1, min(value, 64) + 1) if value % d == 0]}")
    for attribute, value in counts:
        setattr(holder, attribute, value // parts)
    return holder


def _holders(name: str, module: nn.Module) -> list[tuple[str, Any]]:
    holders: list[tuple[str, Any]] = [(name, module)]
    config = module.__dict__.get("config")
    if config is not None and not isinstance(config, nn.Module):
        holders.append((".".join(filter(None, (name, "config"))), config))
    return holders


def _counts(holder: Any) -> Iterable[tuple[str, int]]:
    attributes = getattr(holder, "__dict__", {})
    for attribute in HEAD_COUNT_NAMES:
        value = attributes.get(attribute)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            yield attribute, value


__all__ = ["HEAD_COUNT_NAMES", "head_counts", "localize_head_counts"]
