"""Reference Llama-style decoder: a pure PyTorch ``Transformer`` and its LightningModule ``LlamaLM``; a vision
transformer classifier ``ViTClassifier``; a diffusion transformer ``DiTDenoiser`` (diffusers).

``LlamaLM``, ``ViTClassifier`` and ``DiTDenoiser`` are imported lazily (PEP 562) so that ``lightning_par.models.llama`` and the names below
other than ``LlamaLM`` can be used without importing Lightning (the planner and ``parallel/`` must not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_par.models.llama import (
    Attention,
    FeedForward,
    LlamaConfig,
    RMSNorm,
    Transformer,
    TransformerBlock,
    apply_rotary,
    llama_flops_per_token,
    rope_tables,
)
from lightning_par.models.moe import GroupedExperts, MoEFeedForward, RoutingStats

if TYPE_CHECKING:
    from lightning_par.models.diffusion import DiTDenoiser
    from lightning_par.models.hf import HFCausalLM
    from lightning_par.models.lightning_module import LlamaLM
    from lightning_par.models.vision import ViTClassifier

__all__ = [
    "Attention",
    "DiTDenoiser",
    "FeedForward",
    "GroupedExperts",
    "HFCausalLM",
    "LlamaConfig",
    "LlamaLM",
    "MoEFeedForward",
    "RMSNorm",
    "RoutingStats",
    "Transformer",
    "TransformerBlock",
    "ViTClassifier",
    "apply_rotary",
    "llama_flops_per_token",
    "rope_tables",
]


def __getattr__(name: str) -> Any:
    if name == "LlamaLM":
        from lightning_par.models.lightning_module import LlamaLM

        return LlamaLM
    if name == "DiTDenoiser":
        from lightning_par.models.diffusion import DiTDenoiser

        return DiTDenoiser
    if name == "ViTClassifier":
        from lightning_par.models.vision import ViTClassifier

        return ViTClassifier
    if name == "HFCausalLM":
        from lightning_par.models.hf import HFCausalLM

        return HFCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
