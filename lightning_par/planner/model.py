"""ModelSpec: the shape of a decoder-only transformer, as the planner needs it.

Only sizes, no weights (a Hugging Face config is checked against its model built on the meta device). Parameter
counts follow the reference model
(``lightning_par.models.llama``: RMSNorm, q/k/v/o projections with grouped-query attention, SwiGLU
gate/up/down, optional mixture-of-experts feed-forwards with a linear router) and Hugging Face's Llama /
Mistral / Mixtral, which have the same matrices. Training FLOPs per token use the convention of
``llama_flops_per_token`` (PaLM, Chowdhery et al. 2022, appendix B): ``6 x`` the matmul weights a token
passes through plus ``12 x layers x hidden x seq_len`` for the attention scores and values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any


class UnknownConfig(ValueError):
    """A configuration object of neither known kind (LlamaConfig-like, Hugging Face-like)."""


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a Llama-style decoder. ``moe_layers`` counts the blocks whose feed-forward is a mixture of
    ``moe_experts`` experts (each a SwiGLU of ``expert_ffn_hidden``, default ``ffn_hidden``). ``ffn_matrices`` is
    3 for a gated feed-forward (SwiGLU, GeGLU: gate, up, down), 2 for a plain one (GPT-2's up and down).
    ``attention_head_dim`` is the width of a head where it is not ``hidden / heads`` (Gemma's)."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    tie_embeddings: bool = False
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_layers: int = 0
    expert_ffn_hidden: int | None = None
    ffn_matrices: int = 3
    attention_head_dim: int | None = None
    name: str = "model"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{field} must be a positive integer, got {value!r}")
        if (self.attention_head_dim is None and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec: hidden={self.hidden} must divide into heads={self.heads}, and heads into "
                             f"kv_heads={self.kv_heads}")
        if self.ffn_matrices not in (2, 3):
            raise ValueError(f"ModelSpec.ffn_matrices={self.ffn_matrices!r} must be 3 (gated) or 2 (plain)")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"ModelSpec.moe_top_k={self.moe_top_k} must be between 1 and moe_experts={self.moe_experts}")
        if not 0 <= self.moe_layers <= self.layers or (self.moe_layers and not self.moe_experts):
            raise ValueError(f"ModelSpec.moe_layers={self.moe_layers} must be between 0 and layers={self.layers}, and "
                             "needs moe_experts > 0")

    # ------------------------------------------------------------------------------ derived sizes
    # These and the parameter counts below are cached on the instance (frozen, so they cannot go stale): the
    # planner's search reads them millions of times.
    @functools.cached_property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.heads

    @functools.cached_property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``kv_heads x head_dim``."""
        return self.kv_heads * self.head_dim

    @functools.cached_property
    def is_moe(self) -> bool:
        return self.moe_experts > 0 and self.moe_layers > 0

    @functools.cached_property
    def expert_hidden(self) -> int:
        return self.expert_ffn_hidden or self.ffn_hidden

    def moe_layer(self, index: int) -> bool:
        """Whether block ``index`` holds experts. The planner only needs how many; it spreads them evenly so
        that pipeline stages get their share (Mixtral: all of them)."""
        if not self.is_moe:
            return False
        return math.floor((index + 1) * self.moe_layers / self.layers) > math.floor(index * self.moe_layers / self.layers)

    # ------------------------------------------------------------------------------ parameter counts
    @functools.cached_property
    def attention_params(self) -> int:
        """q and o are ``hidden x heads·head_dim`` (``hidden x hidden`` but for Gemma's wider heads); k and v
        ``hidden x kv_dim`` (GQA, Ainslie et al. 2023)."""
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_dim

    @functools.cached_property
    def mlp_params(self) -> int:
        """A dense feed-forward: gate, up and down for SwiGLU (Shazeer 2020), up and down for a plain one."""
        return self.ffn_matrices * self.hidden * self.ffn_hidden

    @functools.cached_property
    def expert_params(self) -> int:
        """The experts of one MoE block (``moe_experts`` SwiGLUs), without the router."""
        return self.moe_experts * self.ffn_matrices * self.hidden * self.expert_hidden

    @functools.cached_property
    def router_params(self) -> int:
        return self.hidden * self.moe_experts

    @functools.cached_property
    def norm_params(self) -> int:
        """The two RMSNorm gains of a block."""
        return 2 * self.hidden

    def block_matmuls(self, moe: bool) -> tuple[tuple[str, int, int], ...]:
        """A block's matmuls in the order its forward runs them, each ``(name, weights one token multiplies, output
        width)``: q, k, v, o, then the router and the top-k experts' (grouped) matmuls, or the dense feed-forward's.
        Per-op recomputation keeps the odd ones' outputs (``lightning_par.parallel.recompute``)."""
        q_width = self.heads * self.head_dim
        ffn = ("gate", "up", "down")[3 - self.ffn_matrices:]
        attention = (("q", self.hidden * q_width, q_width), ("k", self.hidden * self.kv_dim, self.kv_dim),
                     ("v", self.hidden * self.kv_dim, self.kv_dim), ("o", q_width * self.hidden, self.hidden))
        if not moe:
            return attention + tuple((name, self.hidden * self.ffn_hidden,
                                      self.hidden if name == "down" else self.ffn_hidden) for name in ffn)
        k, f = self.moe_top_k, self.expert_hidden
        return attention + (("router", self.router_params, self.moe_experts),) + tuple(
            (name, k * self.hidden * f, k * (self.hidden if name == "down" else f)) for name in ffn)

    def block_params(self, index: int) -> int:
        """All parameters of block ``index``."""
        return self.norm_params + self.attention_params + self.block_ffn_params(index)

    def block_ffn_params(self, index: int) -> int:
        if self.moe_layer(index):
            return self.expert_params + self.router_params
        return self.mlp_params

    @functools.cached_property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden

    @functools.cached_property
    def head_params(self) -> int:
        """The output projection; 0 extra parameters when tied to the embedding (still a matmul)."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden

    @functools.cached_property
    def final_norm_params(self) -> int:
        return self.hidden

    @functools.cached_property
    def total_params(self) -> int:
        blocks = sum(self.block_params(i) for i in range(self.layers))
        return self.embedding_params + blocks + self.final_norm_params + self.head_params

    @functools.cached_property
    def total_expert_params(self) -> int:
        return self.moe_layers * self.expert_params

    @functools.cached_property
    def active_matmul_params(self) -> int:
        """Matmul weights one token goes through: every attention, the dense or top-k expert feed-forwards
        with their routers, and the head (counted even when tied); no embedding lookup, no norms."""
        moe_ffn = self.moe_top_k * self.ffn_matrices * self.hidden * self.expert_hidden + self.router_params
        ffns = sum(moe_ffn if self.moe_layer(i) else self.mlp_params for i in range(self.layers))
        return self.layers * self.attention_params + ffns + self.hidden * self.vocab_size

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), as ``llama_flops_per_token`` counts them."""
        return 6 * self.active_matmul_params + 12 * self.layers * self.hidden * seq_len

    def block_flops_per_token(self, moe: bool, seq_len: int) -> int:
        """Training FLOPs per token of a dense (or ``moe``) block: its matmuls and its attention."""
        ffn = (self.moe_top_k * self.ffn_matrices * self.hidden * self.expert_hidden + self.router_params if moe
               else self.mlp_params)
        return 6 * (self.attention_params + ffn) + 12 * self.hidden * seq_len

    @functools.cached_property
    def head_flops_per_token(self) -> int:
        return 6 * self.hidden * self.vocab_size

    # ------------------------------------------------------------------------------ constructors
    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """A published architecture by name: see :data:`MODEL_PRESETS`."""
        key = name.lower()
        if key not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; presets: {sorted(MODEL_PRESETS)}")
        return dataclasses.replace(MODEL_PRESETS[key], name=key)

    @classmethod
    def from_llama_config(cls, config: Any, name: str = "llama") -> ModelSpec:
        """From a ``lightning_par.models.llama.LlamaConfig`` (or anything with its attribute names)."""
        moe_experts = int(getattr(config, "moe_experts", 0) or 0)
        is_moe = getattr(config, "is_moe_layer", None)
        if moe_experts and callable(is_moe):
            moe_layers = sum(bool(is_moe(i)) for i in range(config.n_layers))
        else:
            moe_layers = config.n_layers if moe_experts else 0
        return cls(vocab_size=config.vocab_size, hidden=config.dim, layers=config.n_layers, heads=config.n_heads,
                   kv_heads=config.resolved_n_kv_heads, ffn_hidden=config.resolved_ffn_hidden_size,
                   tie_embeddings=bool(getattr(config, "tie_embeddings", False)), moe_experts=moe_experts,
                   moe_top_k=int(getattr(config, "moe_top_k", 2) or 2) if moe_experts else 2,
                   moe_layers=moe_layers, name=name)

    @classmethod
    def from_hf_config(cls, config: Any, name: str | None = None) -> ModelSpec:
        """From a Hugging Face ``PretrainedConfig`` (or anything with its attribute names).

        A real ``PretrainedConfig`` is checked against the model it describes, built on the meta device: the
        planner's count of its parameters must be within 2 % of the model's (with a gated or a plain feed-forward,
        whichever fits), or the architecture is refused, with both counts, rather than planned for as something
        else (a model with parts ModelSpec does not describe)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
        top_k = getattr(config, "num_experts_per_tok", None) or 2
        expert_ffn = getattr(config, "moe_intermediate_size", None)
        ffn = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
               or 4 * config.hidden_size)  # GPT-2's default
        head_dim = getattr(config, "head_dim", None)
        spec = cls(vocab_size=config.vocab_size, hidden=config.hidden_size, layers=config.num_hidden_layers,
                   heads=heads, kv_heads=kv_heads, ffn_hidden=ffn,
                   tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)), moe_experts=int(experts),
                   moe_top_k=int(top_k) if experts else 2, moe_layers=config.num_hidden_layers if experts else 0,
                   expert_ffn_hidden=expert_ffn if experts else None,
                   attention_head_dim=head_dim if head_dim and head_dim * heads != config.hidden_size else None,
                   name=name or getattr(config, "model_type", None) or "hf-model")
        actual = _hf_parameter_count(config)
        if actual is None:
            return spec
        closest = min((dataclasses.replace(spec, ffn_matrices=m) for m in (3, 2)),
                      key=lambda candidate: abs(candidate.total_params - actual))
        if abs(closest.total_params - actual) > _HF_COUNT_TOLERANCE * actual:
            raise ValueError(f"the planner cannot describe {spec.name!r}: its model has {actual:,} parameters, the "
                             f"planner's Llama-style layout of its config {closest.total_params:,} (parts it does not "
                             "model, such as learned positions or shared experts); give every size instead of "
                             "'auto', or a ModelSpec to the planner")
        return closest

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelSpec:
        """From either kind of configuration object, recognised by its attribute names."""
        if hasattr(config, "n_layers") and hasattr(config, "dim"):
            return cls.from_llama_config(config, name=name or "llama")
        if hasattr(config, "num_hidden_layers") and hasattr(config, "hidden_size"):
            return cls.from_hf_config(config, name=name)
        raise UnknownConfig(f"{type(config).__name__} is neither a LlamaConfig-like (dim, n_layers, ...) nor a Hugging "
                         "Face-like (hidden_size, num_hidden_layers, ...) configuration")

    @classmethod
    def from_module(cls, module: Any) -> ModelSpec:
        """From a module carrying its configuration as ``.config`` or ``.model_config``, on itself or on its
        ``.model`` (``LlamaLM``, ``Transformer``, a Hugging Face ``...ForCausalLM``, ``HFCausalLM``, which knows its
        configuration before it builds its model, or a LightningModule wrapping one)."""
        for owner in (module, getattr(module, "model", None)):
            config = getattr(owner, "config", None) or getattr(owner, "model_config", None)
            if config is None:
                continue
            try:
                return cls.from_config(config, name=type(owner).__name__)
            except UnknownConfig:  # a configuration read and refused raises its own reason
                continue
        # UnknownConfig: nothing was read (callers may describe the module otherwise, from its parameters:
        # lightning_par.planner.module_spec); a configuration read and refused raised its own ValueError above.
        raise UnknownConfig(f"cannot read the architecture of {type(module).__name__}: the planner looks for a "
                         "LlamaConfig-like or Hugging Face-like `.config` on the module or on its `.model`; give the "
                         "strategy's model_spec instead (a preset name such as 'llama3-8b', or the sizes: "
                         "vocab_size, hidden, layers, heads, kv_heads, ffn_hidden)")


_HF_COUNT_TOLERANCE = 0.02


def _hf_parameter_count(config: Any) -> int | None:
    """Parameters of the model a transformers ``PretrainedConfig`` describes (built on the meta device), or None
    for another kind of configuration."""
    if not callable(getattr(config, "to_json_string", None)):
        return None
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds for a config it cannot build
        raise ValueError(f"transformers cannot build the {getattr(config, 'model_type', '?')!r} model of this "
                         f"config: {type(error).__name__}: {error}") from error
    return sum(parameter.numel() for parameter in model.parameters())


MODEL_PRESETS: dict[str, ModelSpec] = {
    # Llama 3.2 1B (tied embeddings), Llama 3.1 8B / 70B / 405B: Grattafiori et al. 2024, "The Llama 3 Herd of
    # Models", table 3, and the released configs.
    "llama3-1b": ModelSpec(vocab_size=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn_hidden=8192,
                           tie_embeddings=True),
    "llama3-8b": ModelSpec(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336),
    "llama3-70b": ModelSpec(vocab_size=128256, hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672),
    "llama3-405b": ModelSpec(vocab_size=128256, hidden=16384, layers=126, heads=128, kv_heads=8, ffn_hidden=53248),
    # Mixtral 8x7B (Jiang et al. 2024): Mistral 7B's attention, 8 SwiGLU experts per block, top-2 routing.
    "mixtral-8x7b": ModelSpec(vocab_size=32000, hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336,
                              moe_experts=8, moe_top_k=2, moe_layers=32),
}

__all__ = ["ModelSpec", "MODEL_PRESETS", "parameter_count"]


def parameter_count(count: float) -> str:
    """``count`` parameters in the unit that reads (``803.9 K``, ``12.3 M``, ``70.55 B``)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.{2 if unit == 'B' else 1}f} {unit}"
    return f"{count:.0f}"
