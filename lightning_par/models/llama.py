"""A Llama-style decoder-only transformer in pure PyTorch (no Lightning).

The architecture follows Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language
Models"): pre-norm blocks with RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et
al. 2021, "RoFormer"), a SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer") and
optional grouped-query attention (Ainslie et al. 2023, "GQA").

The module is written so that the parallel techniques in ``lightning_par.parallel`` can be applied to
it without special cases:

* tensor parallel: attention derives its number of heads from the projection output, so a
  column-sharded ``q_proj`` simply yields fewer local heads;
* pipeline parallel: ``embed_tokens``, ``norm`` and ``lm_head`` may be set to ``None`` and entries of
  the ``layers`` ModuleDict deleted; names of the remaining layers stay stable ("0", "1", ...);
* context parallel: ``forward`` takes explicit ``positions`` so a rank holding a slice of the
  sequence uses the right rotary angles;
* meta-device initialisation: each part initialises its own tensors (the root its rotary tables, the
  embedding and head their weights, each block its own), so a layout initialises one part at a time
  (``lightning_par.parallel.initialize``); ``Transformer.initialize`` runs them all, in the same order.

Submodule names match Hugging Face's Llama (``q_proj``, ``gate_proj``, ``embed_tokens``, ...) so that
one automatic map covers both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_par.models.moe import MoEFeedForward, RoutingStats, check_moe


@dataclass
class LlamaConfig:
    """Hyperparameters of :class:`Transformer`. ``None`` sizes are resolved by the properties below."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None -> n_heads (multi-head); fewer -> grouped-query attention
    ffn_hidden_size: int | None = None  # None -> SwiGLU rule from the Llama paper, see below
    multiple_of: int = 32
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Mixture of experts (lightning_par.parallel.experts): 0 experts keeps every feed-forward dense.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_layers: list[int] | None = None  # which blocks get experts; None: all of them
    moe_capacity_factor: float | None = None  # None: dropless
    moe_aux_loss_weight: float = 0.01
    moe_z_loss_weight: float = 0.001

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_experts > 0 and (self.moe_layers is None or index in self.moe_layers)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def resolved_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        # SwiGLU has three matrices instead of two; 2/3 of the usual 4*dim keeps the parameter count
        # of a classic MLP (Shazeer 2020). Rounding up to `multiple_of` keeps matmuls aligned.
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending values if the configuration cannot be built."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        for name in ("n_kv_heads", "ffn_hidden_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"LlamaConfig.{name} must be a positive integer or None, got {value!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"LlamaConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.resolved_n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                f"({self.resolved_n_kv_heads}) for grouped-query attention"
            )
        if self.moe_experts:
            check_moe(self.moe_experts, self.moe_top_k, self.moe_capacity_factor)
            unknown = sorted(set(self.moe_layers or ()) - set(range(self.n_layers)))
            if unknown:
                raise ValueError(f"LlamaConfig.moe_layers {unknown} are not blocks of a {self.n_layers}-layer model")
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"rotary embeddings need an even head_dim, got dim // n_heads = "
                f"{self.dim} // {self.n_heads} = {self.head_dim}"
            )


def llama_flops_per_token(config: LlamaConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token (forward + backward), as in PaLM (Chowdhery et al. 2022, appendix B).

    ``6 * N + 12 * n_layers * dim * seq_len``, where ``N`` counts the weights of every matmul a token goes
    through: the attention and MLP projections of each layer (for a mixture-of-experts layer, ``top_k``
    experts and the router) and the ``lm_head`` (counted once even when tied to the
    embedding). The embedding lookup does no matmul and is excluded, as are the norm weights. The second
    term is the attention score and value matmuls (no discount for the causal mask, as in PaLM).
    ``seq_len`` defaults to ``config.max_seq_len``.
    """
    seq_len = config.max_seq_len if seq_len is None else seq_len
    d, hd = config.dim, config.head_dim
    kv_dim = config.resolved_n_kv_heads * hd
    attention = d * d + 2 * d * kv_dim + d * d  # q, k, v, o
    mlp = 3 * d * config.resolved_ffn_hidden_size  # gate, up, down
    # An MoE layer runs top_k experts per token, plus its router.
    moe_mlp = config.moe_top_k * mlp + d * config.moe_experts
    mlps = sum(moe_mlp if config.is_moe_layer(i) else mlp for i in range(config.n_layers))
    n_matmul = config.n_layers * attention + mlps + d * config.vocab_size  # + lm_head
    return 6 * n_matmul + 12 * config.n_layers * d * seq_len


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): rescale only, no mean-centering, no bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32: the mean of squares loses precision in bf16/fp16.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, positions: Tensor, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """Rotary angles for ``positions`` (RoFormer, Su et al. 2021) as real ``(cos, sin)`` tensors.

    Returns two tensors of shape ``positions.shape + (head_dim // 2,)``. Real tables instead of complex
    numbers keep the computation friendly to DTensor and sharding.
    """
    # Frequency i rotates the pair (x_i, x_{i + head_dim/2}) by position * theta^(-2i/head_dim).
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., D/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape (B, T, H, D) by angles ``cos``/``sin`` of shape (T, D/2) or (B, T, D/2).

    Uses the "rotate half" pairing (dimension i with i + D/2), as in GPT-NeoX and Hugging Face Llama.
    """
    cos = cos.unsqueeze(-2).to(x.dtype)  # (T, 1, D/2) or (B, T, 1, D/2): broadcast over heads
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, T, H, D)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and optional grouped-query attention (GQA)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        kv_dim = config.resolved_n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def init_weights(self, init_std: float, out_std: float) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(proj.weight, mean=0.0, std=init_std)
        nn.init.normal_(self.o_proj.weight, mean=0.0, std=out_std)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # Head counts come from the projection outputs, not the config: under tensor parallel the
        # column-sharded projections return only this rank's heads, and everything below still holds.
        q = self.q_proj(x)
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim)  # (B, T, Hq, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            # GQA: query head h reads kv head h // n_rep. Consecutive grouping stays consistent when
            # q and kv heads are both split into contiguous chunks across tensor-parallel ranks.
            k = k.repeat_interleave(n_rep, dim=1)  # (B, Hq, T, D)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, Hq, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, Hq * D)
        return self.o_proj(y)  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_size, bias=False)
        self.up_proj = nn.Linear(dim, hidden_size, bias=False)
        self.down_proj = nn.Linear(hidden_size, dim, bias=False)

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_proj.weight, mean=0.0, std=init_std)
        nn.init.normal_(self.up_proj.weight, mean=0.0, std=init_std)
        nn.init.normal_(self.down_proj.weight, mean=0.0, std=out_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``; ``mlp`` may be a mixture
    of experts."""

    def __init__(self, config: LlamaConfig, moe: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp: nn.Module = (
            MoEFeedForward(config.dim, config.resolved_ffn_hidden_size, config.moe_experts, config.moe_top_k,
                           config.moe_capacity_factor, aux_loss_weight=config.moe_aux_loss_weight,
                           z_loss_weight=config.moe_z_loss_weight)
            if moe else FeedForward(config.dim, config.resolved_ffn_hidden_size)
        )
        self.init_std, self.out_std = config.init_std, config.init_std / math.sqrt(2 * config.n_layers)

    @torch.no_grad()
    def init_weights(self) -> None:
        """This block's tensors: norms at one, projections Normal(0, init_std), the projections that write into the
        residual stream at the depth-scaled ``out_std`` (:meth:`Transformer.initialize`)."""
        self.attention_norm.reset_parameters()
        self.attention.init_weights(self.init_std, self.out_std)
        self.mlp_norm.reset_parameters()
        self.mlp.init_weights(self.init_std, self.out_std)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # cos/sin by keyword: the positional input is the one activation that parallel styles re-lay out
        # (Hugging Face passes position embeddings the same way).
        h = x + self.attention(self.attention_norm(x), cos=cos, sin=sin)  # (B, T, C)
        return h + self.mlp(self.mlp_norm(h))  # (B, T, C)


class TokenEmbedding(nn.Embedding):
    """The token embedding, initialised Normal(0, ``init_std``)."""

    def __init__(self, vocab_size: int, dim: int, init_std: float) -> None:
        super().__init__(vocab_size, dim)
        self.init_std = init_std

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class OutputHead(nn.Linear):
    """The head to the vocabulary, initialised Normal(0, ``init_std``), or left to the embedding it is tied to."""

    def __init__(self, dim: int, vocab_size: int, init_std: float) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.init_std = init_std
        self.tied = False  # set by Transformer.tie_weights: the embedding's initialisation is the head's

    @torch.no_grad()
    def init_weights(self) -> None:
        if not self.tied:
            nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


def _weight(module: nn.Module | None) -> Tensor | None:
    """The module's weight, or None for a part this pipeline stage does not hold."""
    return getattr(module, "weight", None)


class Transformer(nn.Module):
    """Decoder-only Llama-style language model: ``embed_tokens -> layers -> norm -> lm_head``.

    ``forward(tokens, positions=None)`` maps token ids (B, T) to logits (B, T, vocab). For pipeline
    stages, ``embed_tokens``, ``norm`` and ``lm_head`` may be ``None`` (the stage then takes or returns
    hidden states (B, T, dim)) and entries of ``layers`` may be deleted.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embed_tokens: nn.Embedding | None = TokenEmbedding(config.vocab_size, config.dim, config.init_std)
        # A ModuleDict keyed by the layer index: a pipeline stage deletes the layers it does not own and
        # the remaining parameter names ("layers.5.attention.q_proj.weight") match the full model's.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, config.is_moe_layer(i))
                                     for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.lm_head: nn.Linear | None = OutputHead(config.dim, config.vocab_size, config.init_std)
        # Non-persistent: derived from the config, so they stay out of state_dict and checkpoints.
        rope_shape = (config.max_seq_len, config.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(rope_shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(rope_shape), persistent=False)
        self.tie_weights()
        self.initialize()

    def tie_weights(self) -> None:
        """Share one tensor between ``embed_tokens`` and ``lm_head`` when ``config.tie_embeddings``.

        Called again by :meth:`initialize` because ``to_empty`` materialises each module's parameters
        separately and so unties them.
        """
        embedding, head = _weight(self.embed_tokens), _weight(self.lm_head)
        if self.config.tie_embeddings and embedding is not None and head is not None and head is not embedding:
            self.lm_head.weight = embedding
        if isinstance(self.lm_head, OutputHead):
            self.lm_head.tied = self.config.tie_embeddings

    def _init_rope(self) -> None:
        positions = torch.arange(self.config.max_seq_len, device=self.rope_cos.device)
        cos, sin = rope_tables(self.config.head_dim, positions, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The tensors this module holds itself: the rotary tables."""
        self._init_rope()

    @torch.no_grad()
    def initialize(self) -> None:
        """Initialise every parameter and buffer, each part its own in module order (the rotary tables, the
        embedding, each block, the final norm, the head); deterministic under ``torch.manual_seed``.

        Normal(0, init_std) for embeddings and linear weights; the projections that write into the
        residual stream (``o_proj``, ``down_proj``) use ``init_std / sqrt(2 * n_layers)`` so the residual
        variance does not grow with depth (GPT-2, Radford et al. 2019; Megatron-LM, Shoeybi et al. 2019).
        Works after ``to_empty`` on a module built on the meta device. A layout initialises a model built on the
        meta device part by part in the same order (``lightning_par.parallel.initialize``), so no part but the
        largest is ever whole on a rank.
        """
        self.tie_weights()
        self.reset_parameters()
        # On a pipeline stage the parts other stages run are stand-ins without weights (or are None).
        for part in (self.embed_tokens, *self.layers.values(), self.norm, self.lm_head):
            if isinstance(part, (TokenEmbedding, TransformerBlock, OutputHead)):
                part.init_weights()
            elif isinstance(part, RMSNorm):
                part.reset_parameters()

    def rope(self, seq_len: int, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Rotary ``(cos, sin)`` for ``positions`` (default ``arange(seq_len)``): (T, D/2) or (B, T, D/2)."""
        if positions is None:
            if seq_len > self.config.max_seq_len:
                raise ValueError(f"sequence length {seq_len} exceeds max_seq_len ({self.config.max_seq_len})")
            return self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        return self.rope_cos[positions], self.rope_sin[positions]

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); hidden states in or out on pipeline stages."""
        # The sequence length of the input, not of `h`: under sequence parallelism `h` holds only this
        # rank's slice of the sequence, while attention runs on the whole of it.
        cos, sin = self.rope(tokens.shape[1], positions)  # (T, D/2) or (B, T, D/2)
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens  # (B, T, C)
        for layer in self.layers.values():
            h = layer(h, cos, sin)  # (B, T, C)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h  # (B, T, V)

    def routing_stats(self) -> dict[str, RoutingStats]:
        """The routing statistics of every mixture-of-experts block's last forward, by block name."""
        return {name: layer.mlp.stats for name, layer in self.layers.items()
                if isinstance(getattr(layer, "mlp", None), MoEFeedForward) and layer.mlp.stats is not None}

    def auxiliary_loss(self) -> Tensor | float:
        """The weighted load-balancing and z-losses of the last forward (0 for a dense model), but for blocks
        that add theirs in backward (``MoEFeedForward.loss_scale_in_backward``: under pipeline parallel)."""
        return sum(layer.mlp.weighted_auxiliary_loss() for layer in self.layers.values()
                   if isinstance(getattr(layer, "mlp", None), MoEFeedForward) and layer.mlp.stats is not None
                   and layer.mlp.loss_scale_in_backward is None)

    def num_parameters(self, exclude_embedding: bool = False) -> int:
        """Number of parameters held by this module, each shared tensor counted once.

        With ``exclude_embedding`` the embedding table is left out, unless it is tied to ``lm_head``: then
        it is also the output projection's weight and is kept. Counts only what this module still holds,
        so a pipeline stage reports its own share.
        """
        params = {id(p): p for p in self.parameters()}
        if exclude_embedding and self.embed_tokens is not None:
            tied = self.lm_head is not None and self.lm_head.weight is self.embed_tokens.weight
            if not tied:
                params.pop(id(self.embed_tokens.weight), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token of the full model; see :func:`llama_flops_per_token` (PaLM, app. B)."""
        return llama_flops_per_token(self.config, seq_len)
