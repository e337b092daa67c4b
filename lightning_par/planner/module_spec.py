"""The planner's ModelSpec read off a module's own parameters, for a model that carries no configuration.

``ModelSpec.from_module`` reads a LlamaConfig-like or Hugging Face-like ``.config``; a user's own module (a
nanoGPT, a stack of ``nn.TransformerEncoderLayer``) has none. :func:`derive_model_spec` describes it from what it
is made of, located by its :class:`~lightning_par.parallel.model_map.ModelMap` (the map tensor and pipeline
parallel use; docs/architecture.md, "How a model tells the strategy its shape"):

* ``vocab_size`` and ``hidden``: the embedding's table; ``layers``: the map's blocks; ``tie_embeddings``: the head's
  weight is the embedding's (the same ``Parameter``).
* attention: the block's ``nn.MultiheadAttention``, or its q/k/v (separate or fused) and output projections, found
  by the names decoder families use. Projection shapes give widths, not heads: a head count or head width must come
  from the attention module (or the block), as the attribute its forward uses (``n_heads``, ``num_heads``,
  ``n_head``, ``head_dim``, ``head_size``, ...). Then ``heads = o.in_features / head_dim`` and ``kv_heads`` follows
  from the key projection's width (or from what a fused q/k/v projection has beyond the queries).
* feed-forward: the block's other projections. The one that returns to the model width is ``down``; the ones that
  leave it hold one (plain: GPT-2's fc/proj) or two (gated: SwiGLU's gate and up, Shazeer 2020) ``ffn_hidden``-wide
  outputs.
* mixture of experts: the module named ``experts`` (the map's ``experts`` style); its experts are a ``ModuleList``
  or parameters stacked on a first dimension of ``moe_experts``; ``moe_top_k`` from the MoE module's attribute
  (``top_k``, ``num_experts_per_tok``, ...).

The description is then held to the module, as ``ModelSpec.from_hf_config`` holds a configuration to its model:
the planner's parameter count of the spec must be within 2 % of the module's, or the module is refused with both
counts (learned positions, biases, shared experts, latent attention: parts ModelSpec does not describe).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from lightning_par.parallel.adapters import outside_adapters
from lightning_par.parallel.model_map import (PROJECTION_NAMES, ModelMap, derive_model_map, huggingface_model_map,
                                              is_projection, projection_features)
from lightning_par.planner.model import _HF_COUNT_TOLERANCE, ModelSpec, UnknownConfig

# Projection names by role inside an attention module: the model map's vocabulary.
_QUERY, _KEY, _VALUE = PROJECTION_NAMES["query"], PROJECTION_NAMES["key"], PROJECTION_NAMES["value"]
_FUSED_QKV, _OUTPUT = PROJECTION_NAMES["qkv"], PROJECTION_NAMES["output"]
_ATTENTION_ROLES = _QUERY + _KEY + _VALUE + _FUSED_QKV
# Attributes an attention module keeps its sizes in (its forward reshapes by them).
_HEADS_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "heads", "n_heads_q")
_KV_HEADS_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head", "n_kv_heads_q")
_HEAD_DIM_ATTRS = ("head_dim", "head_size", "d_head", "dim_head")
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_top_k", "n_activated_experts", "topk", "k")


class CannotDescribe(ValueError):
    """The module's architecture is not one ModelSpec can state (the message says which part and why)."""


def module_spec(module: nn.Module, model_map: ModelMap | None = None) -> ModelSpec:
    """The planner's spec of ``module``: from its configuration when it carries one ``ModelSpec.from_module``
    reads, else derived from its parameters (:func:`derive_model_spec`). A configuration that is read and
    refused keeps its own reason."""
    try:
        return ModelSpec.from_module(module)
    except UnknownConfig as no_config:
        try:
            return derive_model_spec(module, model_map)
        except CannotDescribe as reason:
            raise ValueError(f"{no_config} The planner also tried to read the architecture off the module's "
                             f"parameters and could not: {reason}") from reason


def derive_model_spec(module: nn.Module, model_map: ModelMap | None = None) -> ModelSpec:
    """Describe ``module`` from its parameters and its model map (derived when not given); raises
    :class:`CannotDescribe` with the reason when it cannot, or when the description's parameter count is more
    than 2 % off the module's."""
    name = type(module).__name__
    if model_map is None:
        model_map = huggingface_model_map(module) or derive_model_map(module)
    if model_map is None:
        raise CannotDescribe(f"{name} has no list of transformer blocks the planner recognises (a ModuleList or "
                             "ModuleDict of identical modules holding linear layers)")
    blocks = list(module.get_submodule(model_map.blocks).children())
    if model_map.embedding is None:
        raise CannotDescribe(f"{name} has no token embedding (nn.Embedding) outside its blocks {model_map.blocks!r}: "
                             "the vocabulary size is unknown")
    embedding = module.get_submodule(model_map.embedding)
    vocab, hidden = int(embedding.num_embeddings), int(embedding.embedding_dim)
    head = module.get_submodule(model_map.head) if model_map.head else None
    # No head module: the logits come from the embedding's table (e.g. F.linear(h, embed.weight)): tied.
    tied = head is None or getattr(head, "weight", None) is embedding.weight

    attention = _attention(blocks[0], hidden, f"{model_map.blocks}.0")
    experts = [_experts_name(block) for block in blocks]
    moe_blocks = [(i, block, name) for i, (block, name) in enumerate(zip(blocks, experts)) if name is not None]
    dense = [(i, block) for i, (block, name) in enumerate(zip(blocks, experts)) if name is None]
    ffn_hidden, matrices = (_feed_forward(dense[0][1], hidden, f"{model_map.blocks}.{dense[0][0]}") if dense
                            else (None, None))
    moe: dict[str, Any] = {}
    if moe_blocks:
        index, block, experts_name = moe_blocks[0]
        moe = _mixture(block, experts_name, hidden, f"{model_map.blocks}.{index}", matrices)
        matrices = matrices or moe.pop("ffn_matrices")
        moe.pop("ffn_matrices", None)
        moe["moe_layers"] = len(moe_blocks)
        ffn_hidden = ffn_hidden or moe["expert_ffn_hidden"]
    spec = _same_width(ModelSpec(vocab_size=vocab, hidden=hidden, layers=len(blocks), ffn_hidden=int(ffn_hidden),
                                 tie_embeddings=tied, ffn_matrices=int(matrices), name=name, **attention, **moe))
    actual = sum(p.numel() for p in module.parameters())  # each shared (tied) parameter once
    if abs(spec.total_params - actual) > _HF_COUNT_TOLERANCE * actual:
        raise CannotDescribe(f"{name} has {actual:,} parameters, the planner's Llama-style layout of what it reads off "
                             f"the module ({_describe(spec)}) {spec.total_params:,}: parts it does not model, such as "
                             "learned positions, biases or shared experts, are more than 2% of the model")
    return spec


def _describe(spec: ModelSpec) -> str:
    return (f"vocab_size={spec.vocab_size}, hidden={spec.hidden}, layers={spec.layers}, heads={spec.heads}, "
            f"kv_heads={spec.kv_heads}, ffn_hidden={spec.ffn_hidden}, ffn_matrices={spec.ffn_matrices}"
            + (f", moe_experts={spec.moe_experts}, moe_layers={spec.moe_layers}" if spec.moe_experts else ""))


# ------------------------------------------------------------------------------------------------ attention
def _attention(block: nn.Module, hidden: int, where: str) -> dict[str, Any]:
    """heads, kv_heads and (where heads are not hidden / heads wide) attention_head_dim of ``block``."""
    modules = outside_adapters([(n, m) for n, m in block.named_modules() if not _inside_experts(n)])
    for name, sub in modules:
        if isinstance(sub, nn.MultiheadAttention):
            if not sub._qkv_same_embed_dim:
                raise CannotDescribe(f"{where}.{name} is an nn.MultiheadAttention with kdim/vdim != embed_dim")
            # in_proj_weight (3·h, h) holds q, k and v; every head has keys and values: kv_heads = heads.
            return _heads(sub.num_heads, sub.num_heads, sub.head_dim, hidden)
    projections = [(n, m) for n, m in modules if n and is_projection(m)]
    owner = _attention_owner(modules)
    if owner is not None:
        inside = [(n, m) for n, m in projections if n.startswith(owner + ".")]
    else:  # projections directly in the block, recognised by their names only
        inside = [(n, m) for n, m in projections if _leaf(n) in _ATTENTION_ROLES + _OUTPUT and "." not in n]
    roles: dict[str, tuple[int, int]] = {}
    for name, sub in inside:
        leaf = _leaf(name)
        for role, names in (("q", _QUERY), ("k", _KEY), ("v", _VALUE), ("qkv", _FUSED_QKV), ("o", _OUTPUT)):
            if leaf in names:
                roles.setdefault(role, projection_features(sub))
    where_attn = f"{where}.{owner}" if owner else where
    if "o" not in roles or not ({"q", "k", "v"} <= set(roles) or "qkv" in roles):
        found = ", ".join(_leaf(n) for n, _ in inside) or "none"
        raise CannotDescribe(f"{where_attn}: no query/key/value and output projections the planner recognises "
                             f"(projections found: {found}; multi-head latent attention and other shapes are not "
                             "described)")
    o_in = roles["o"][0]
    attention = block.get_submodule(owner) if owner else block
    head_dim = _attribute(attention, _HEAD_DIM_ATTRS) or _attribute(block, _HEAD_DIM_ATTRS)
    heads = _attribute(attention, _HEADS_ATTRS) or _attribute(block, _HEADS_ATTRS)
    if head_dim is None and heads is None:
        raise CannotDescribe(f"{where_attn} says neither its number of heads nor its head width (no attribute "
                             f"among {_HEADS_ATTRS + _HEAD_DIM_ATTRS}); its projections' shapes alone cannot tell")
    head_dim = head_dim or o_in // heads
    if o_in % head_dim:
        raise CannotDescribe(f"{where_attn}: the output projection's {o_in} input features are not whole heads of "
                             f"{head_dim}")
    heads = o_in // head_dim
    if "k" in roles:
        kv_width = roles["k"][1]
    else:  # a fused projection: queries, then keys and values of equal width
        kv_width = (roles["qkv"][1] - heads * head_dim) // 2
    kv_heads = _attribute(attention, _KV_HEADS_ATTRS) or (kv_width // head_dim if kv_width % head_dim == 0 else None)
    if not kv_heads or heads % kv_heads:
        raise CannotDescribe(f"{where_attn}: the key projection's width {kv_width} is not a divisor of the "
                             f"{heads} query heads of {head_dim}")
    return _heads(heads, int(kv_heads), head_dim, hidden)


def _heads(heads: int, kv_heads: int, head_dim: int, hidden: int) -> dict[str, Any]:
    return dict(heads=int(heads), kv_heads=int(kv_heads),
                attention_head_dim=None if heads * head_dim == hidden else int(head_dim))


def _attention_owner(modules: list[tuple[str, nn.Module]]) -> str | None:
    """The block-relative name of the module holding the attention projections: the outermost one with projections
    whose class or name says attention (``LlamaAttention``, ``attn``, ``self_attention``; not ``attention_norm``);
    None when the block holds them itself."""
    for name, sub in modules:
        says = "attention" in type(sub).__name__.lower() or "attn" in _leaf(name).lower() \
            or "attention" in _leaf(name).lower()
        if name and says and any(is_projection(m) for m in sub.modules()):
            return name
    return None


# --------------------------------------------------------------------------------------------- feed-forward
def _feed_forward(block: nn.Module, hidden: int, where: str) -> tuple[int, int]:
    """(ffn_hidden, ffn_matrices) of a dense block: its projections outside attention."""
    modules = outside_adapters([(n, m) for n, m in block.named_modules() if not _inside_experts(n)])
    owner = _attention_owner(modules)
    outside = [(n, m) for n, m in modules if n and is_projection(m)
               and not (owner and (n == owner or n.startswith(owner + ".")))
               and not any(isinstance(s, nn.MultiheadAttention) and n.startswith(sn + ".") for sn, s in modules if sn)
               and not (owner is None and "." not in n and _leaf(n) in _ATTENTION_ROLES + _OUTPUT)]
    return _ffn_of([projection_features(m) for _, m in outside], hidden, where)


def _ffn_of(shapes: list[tuple[int, int]], hidden: int, where: str) -> tuple[int, int]:
    """(ffn_hidden, matrices) from the (in, out) features of a feed-forward's projections: one returns to the
    model width (down), the others leave it and hold one (plain) or two (gated) ffn_hidden-wide outputs."""
    downs = [s for s in shapes if s[1] == hidden and s[0] != hidden] or [s for s in shapes if s[1] == hidden]
    if not downs:
        raise CannotDescribe(f"{where}: no feed-forward projection back to the model width {hidden} "
                             f"(projections: {shapes})")
    down = downs[-1]
    ffn = down[0]
    ups = list(shapes)
    ups.remove(down)
    width = sum(out for inp, out in ups if inp == hidden)
    if len(ups) != sum(1 for inp, _ in ups if inp == hidden) or width not in (ffn, 2 * ffn):
        raise CannotDescribe(f"{where}: a feed-forward of {shapes} (in, out) features is neither plain (up, down) nor "
                             "gated (gate, up, down) around one hidden width")
    return ffn, 2 if width == ffn else 3


# ------------------------------------------------------------------------------------------------- experts
def _experts_name(block: nn.Module) -> str | None:
    """The name in ``block`` of its first module called ``experts`` (an MoE block's), or None."""
    return next((name for name, _ in block.named_modules() if _leaf(name) == "experts"), None)


def _mixture(block: nn.Module, name: str, hidden: int, where: str, matrices: int | None) -> dict[str, Any]:
    """moe_experts, moe_top_k, expert_ffn_hidden (and ffn_matrices) of an MoE block whose experts are ``name``."""
    experts = block.get_submodule(name)
    parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
    # On the MoE module, its experts or its router (Hugging Face keeps top_k on the router, Qwen2MoeTopKRouter).
    top_k = next((k for k in (_attribute(m, _TOP_K_ATTRS) for m in (parent, experts, *parent.children())) if k),
                 None)
    if top_k is None:
        raise CannotDescribe(f"{where}.{name.rpartition('.')[0] or name}: the MoE module says not how many experts "
                             f"each token goes to (no attribute among {_TOP_K_ATTRS})")
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        count = len(experts)
        first = next(iter(experts.children()))
        ffn, found = _ffn_of([projection_features(m) for m in first.modules() if is_projection(m)], hidden,
                             f"{where}.{name}.0")
    else:  # experts stacked on a first dimension: (E, in, out) parameters
        stacked = list(experts.parameters(recurse=False)) or list(experts.parameters())
        if not stacked or len({p.shape[0] for p in stacked}) != 1 or any(p.dim() != 3 for p in stacked):
            raise CannotDescribe(f"{where}.{name}: experts neither a ModuleList nor parameters stacked as (experts, "
                                 "in, out)")
        count = int(stacked[0].shape[0])
        per_expert = sum(p[0].numel() for p in stacked)
        ffn = min(d for p in stacked for d in p.shape[1:] if d != hidden) if any(
            d != hidden for p in stacked for d in p.shape[1:]) else hidden
        found = round(per_expert / (hidden * ffn))
        if found not in (2, 3):
            raise CannotDescribe(f"{where}.{name}: {per_expert:,} parameters per expert are neither 2 nor 3 matrices "
                                 f"of {hidden} x {ffn}")
    if matrices is not None and found != matrices:
        raise CannotDescribe(f"{where}.{name}: experts with {found} matrices beside dense feed-forwards with {matrices}")
    return dict(moe_experts=count, moe_top_k=int(top_k), expert_ffn_hidden=int(ffn), ffn_matrices=found)


def _same_width(spec: ModelSpec) -> ModelSpec:
    """``expert_ffn_hidden`` left None where it is ``ffn_hidden`` (as the configuration readers leave it)."""
    if spec.expert_ffn_hidden == spec.ffn_hidden:
        return dataclasses.replace(spec, expert_ffn_hidden=None)
    return spec


# --------------------------------------------------------------------------------------------------- helpers
def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _inside_experts(name: str) -> bool:
    return "experts" in name.split(".")


def _attribute(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first positive integer attribute of ``module`` among ``names`` (a module's own, not its children's)."""
    for attr in names:
        value = module.__dict__.get(attr, getattr(type(module), attr, None))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


__all__ = ["CannotDescribe", "derive_model_spec", "module_spec"]
