"""ModelMap: where a decoder transformer keeps its blocks, attention, MLP, embedding and head.

Tensor, pipeline, sequence and expert parallelism all need to know the shape of the model. A model map
comes, in order of precedence, from (docs/architecture.md):

1. the model itself (a ``parallelize(mesh, config)`` hook: the strategy then applies nothing itself);
2. a declarative map (constructor argument or YAML): :meth:`ModelMap.from_dict`;
3. the model's own map where it has one: Hugging Face configs carry ``base_model_tp_plan`` and
   ``base_model_pp_plan`` (:func:`huggingface_model_map` translates them);
4. :func:`derive_model_map`, which recognises decoder transformers by structure and by the usual names (the
   project's reference model, Llama/Mistral/Qwen/Gemma, GPT-2's ``Conv1D``, GPT-NeoX, Phi, nanoGPT, MLA).

Whatever its source, a tensor-parallel split is then checked against what the model computes
(``lightning_par.parallel.model_map_check``) before anything trains.

Styles name what a technique does to a module:
``colwise`` (split the output features), ``rowwise`` (split the input features), ``colwise_gather`` (split
the output features, then gather them: for a projection whose output the model slices by global sizes, such
as a fused q/k/v), ``rowwise_split`` (split the input features of a layer whose input arrives whole),
``vocab`` (vocabulary-parallel embedding), ``sequence`` (norms that run on sequence-sharded activations),
``per_shard`` (a replicated module applied to each rank's split activations, such as a per-head q/k norm:
its gradients are summed over the tensor-parallel ranks), ``shared_rope_key`` (a replicated projection whose last
``qk_rope_head_dim`` output features, the rotary key multi-head latent attention shares among all heads, reach each
rank's split heads directly: their gradient is summed over the tensor-parallel ranks), ``experts`` (an MoE expert
group), ``replicate`` (leave whole).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_par.parallel.adapters import base_layer
from lightning_par.parallel.modules import holds_for_submodule, tied_groups

STYLES = ("colwise", "rowwise", "colwise_gather", "rowwise_split", "vocab", "sequence", "per_shard",
          "shared_rope_key", "experts", "replicate")
SPLIT_STYLES = ("colwise", "rowwise", "colwise_gather", "rowwise_split")  # styles that shard a projection
MAP_SOURCES = ("given", "huggingface", "derived", "structure")

# The names model families give a projection of each role inside a block: one vocabulary for the model map (which
# pairs projections for tensor parallel) and for the planner's description of a module
# (lightning_par.planner.module_spec). Llama/Mistral/Qwen q_proj..., Meta's wq..., BERT-style query...,
# GPT-2 c_attn/c_proj, GPT-NeoX query_key_value/dense, Phi dense/fc1/fc2, MLA's q_b_proj/kv_b_proj, single letters.
PROJECTION_NAMES: dict[str, tuple[str, ...]] = {
    "query": ("q_proj", "wq", "query", "q", "q_b_proj"),
    "key": ("k_proj", "wk", "key", "k", "kv_b_proj"),
    "value": ("v_proj", "wv", "value", "v"),
    # q, k and v in one matrix
    "qkv": ("qkv_proj", "Wqkv", "c_attn", "query_key_value", "W_pack", "qkv", "in_proj"),
    "output": ("o_proj", "wo", "out_proj", "c_proj", "dense", "o", "proj"),
    "up": ("gate_proj", "up_proj", "w1", "w3", "fc1", "c_fc", "fc_in", "dense_h_to_4h"),
    "gate_up": ("gate_up_proj",),
    "down": ("down_proj", "w2", "fc2", "c_proj", "fc_out", "dense_4h_to_h", "dense"),
}
# Names too generic to pair by name (single letters; ``proj`` ends both the attention and the MLP of a ViT and of
# litgpt; ``in_proj`` is nn.MultiheadAttention's bare parameter): the model map leaves them to the pairs found from
# what the blocks compute (lightning_par.parallel.model_map_structure).
_GENERIC_NAMES = ("q", "k", "v", "o", "proj", "in_proj")


def _names(*roles: str) -> tuple[str, ...]:
    return tuple(n for role in roles for n in PROJECTION_NAMES[role] if n not in _GENERIC_NAMES)


_COLWISE_NAMES = _names("query", "key", "value", "up")
_ROWWISE_NAMES = _names("output", "down")
# Several projections in one matrix: split like the others when each rank's rows hold whole heads (GPT-NeoX's
# per-head q/k/v), gathered when the model slices the output by global sizes; the tensor-parallel check decides.
_FUSED_NAMES = _names("qkv", "gate_up")
_EXPERT_NAMES = ("experts",)
_FINAL_NORM_NAMES = ("norm", "final_norm", "ln_f", "final_layernorm", "norm_f", "final_layer_norm")

# Hugging Face's tensor-parallel styles -> ours (transformers' ParallelInterface names). Expert styles are
# left to expert parallel; styles not listed are left out of the model map.
HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "colwise_gather",
             "rowwise_split_input": "rowwise_split", "embedding_rowwise": "vocab",
             "replicated_with_grad_allreduce": "per_shard", "mla_kv_a_proj": "shared_rope_key",
             "moe_tp_experts": "experts"}


def is_projection(module: nn.Module) -> bool:
    """A linear map tensor parallel can split: ``nn.Linear``, GPT-2's ``Conv1D`` (weight stored (in, out)), or an
    adapter layer (peft's LoRA) on one of them, split with it."""
    base = base_layer(module)
    return isinstance(base, nn.Linear) or is_conv1d(base)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D``: a linear layer whose weight is (in_features, out_features), recognised by shape
    (``nf`` output features) so that transformers need not be imported."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and weight is not None and weight.dim() == 2 and weight.shape[1] == module.nf)


def projection_features(module: nn.Module) -> tuple[int, int]:
    """(input features, output features) of a projection (of the layer an adapter layer adapts)."""
    module = base_layer(module)
    if is_conv1d(module):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return module.in_features, module.out_features


@dataclass(frozen=True)
class ModelMap:
    """Module names (dotted paths from the model root) and the parallel style of each pattern.

    ``styles`` maps ``fnmatch`` patterns over full module names to a style, e.g.
    ``{"model.layers.*.attention.q_proj": "colwise"}``. ``split_points`` are block names before which a
    pipeline stage starts (empty: let the balancer decide).
    """

    blocks: str
    embedding: str | None = None
    final_norm: str | None = None
    head: str | None = None
    styles: dict[str, str] = field(default_factory=dict)
    split_points: tuple[str, ...] = ()
    # Patterns of split modules whose head counts are set to each rank's (lightning_par.parallel.local_heads).
    local_heads: tuple[str, ...] = ()
    # Fused column-wise projections by pattern -> the sizes of the sections their output is cut into ([q, k, v]):
    # each rank holds its part of every section (lightning_par.parallel.regroup).
    sections: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # given (by the user), huggingface (the model's config), derived (derive_model_map: names and shapes), structure
    # (derived, with pairs found from what the blocks compute: lightning_par.parallel.model_map_structure)
    source: str = "given"

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, str) or not self.blocks:
            raise ValueError(f"ModelMap.blocks must name the module holding the blocks, got {self.blocks!r}")
        for pattern, style in self.styles.items():
            if style not in STYLES:
                raise ValueError(f"ModelMap style {style!r} for {pattern!r} is not one of {STYLES}")
        for pattern, sizes in self.sections.items():
            if not (isinstance(sizes, tuple) and len(sizes) > 1 and all(isinstance(n, int) and n > 0 for n in sizes)):
                raise ValueError(f"ModelMap sections for {pattern!r} must be two or more positive sizes (the widths of "
                                 f"the projections fused in one layer, such as [q, k, v]), got {sizes!r}")
        if self.source not in MAP_SOURCES:
            raise ValueError(f"ModelMap.source={self.source!r} is not one of {MAP_SOURCES}")

    def with_styles(self, styles: dict[str, str]) -> ModelMap:
        """The same map with ``styles`` in place of its own."""
        return replace(self, styles=dict(styles))

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> ModelMap:
        """Build a model map from a YAML/dict spec with the field names of this class."""
        keys = ("blocks", "embedding", "final_norm", "head", "styles", "split_points", "local_heads", "sections")
        unknown = set(spec) - set(keys)
        if unknown:
            raise ValueError(f"unknown ModelMap keys {sorted(unknown)}; expected {', '.join(keys)}")
        if "blocks" not in spec:
            raise ValueError("a ModelMap spec needs 'blocks': the dotted name of the list of transformer blocks")
        spec = dict(spec)
        spec["split_points"] = tuple(spec.get("split_points", ()))
        spec["styles"] = dict(spec.get("styles", {}))
        spec["local_heads"] = tuple(spec.get("local_heads", ()))
        spec["sections"] = {pattern: tuple(sizes) if isinstance(sizes, (list, tuple)) else sizes
                            for pattern, sizes in dict(spec.get("sections", {})).items()}
        return cls(**spec)

    def style_of(self, module_name: str) -> str | None:
        """The style of the first pattern matching ``module_name`` (None when no pattern matches)."""
        for pattern, style in self.styles.items():
            if fnmatch.fnmatchcase(module_name, pattern):
                return style
        return None

    def sections_of(self, module_name: str) -> tuple[int, ...] | None:
        """The sections of the fused projection ``module_name`` (None when it is not cut into sections)."""
        return next((sizes for pattern, sizes in self.sections.items() if fnmatch.fnmatchcase(module_name, pattern)),
                    None)

    def has_local_heads(self, module_name: str) -> bool:
        """Whether the head counts of ``module_name`` are each rank's under tensor parallel."""
        return any(fnmatch.fnmatchcase(module_name, pattern) for pattern in self.local_heads)

    def block_names(self, model: nn.Module) -> list[str]:
        """Full names of the blocks, in execution order (an entry that repeats an earlier entry's module, as in
        ``nn.ModuleList([block] * 4)``, is not a block of its own: :meth:`shared_blocks` names them)."""
        container = model.get_submodule(self.blocks)
        return [f"{self.blocks}.{name}" for name, _ in container.named_children()]

    def shared_blocks(self, model: nn.Module) -> list[list[str]]:
        """The entries of the block list that hold one module between them (ALBERT-style weight sharing), each
        group by its full names; empty when every entry is a module of its own."""
        entries: dict[int, list[str]] = {}
        for name, block in model.get_submodule(self.blocks)._modules.items():
            if block is not None:
                entries.setdefault(id(block), []).append(f"{self.blocks}.{name}")
        return [names for names in entries.values() if len(names) > 1]

    def validate(self, model: nn.Module) -> None:
        """Raise ``ValueError`` if a named module does not exist in ``model``."""
        names = dict(model.named_modules())
        for role in ("blocks", "embedding", "final_norm", "head"):
            name = getattr(self, role)
            if name is not None and name not in names:
                raise ValueError(f"ModelMap.{role}={name!r} is not a module of {type(model).__name__}")
        for pattern in (*self.styles, *self.local_heads, *self.sections):
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ValueError(f"ModelMap pattern {pattern!r} matches no module of {type(model).__name__}")


def network_prefix(model_map: ModelMap) -> str:
    """The path of the module whose forward runs the whole network: the map's names share it
    (``model.model.layers`` and ``model.lm_head`` -> ``model.``; empty when the model root is the network)."""
    names = [n for n in (model_map.blocks, model_map.embedding, model_map.final_norm, model_map.head) if n]
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if len(common) == len(parts[0]) and len(names) == 1:
        common = common[:-1]
    return ".".join(common) + "." if common else ""


def derive_model_map(model: nn.Module) -> ModelMap | None:
    """Recognise a decoder transformer; return None when the model does not look like one.

    The blocks are the model's layer list (:func:`find_blocks`): the ``ModuleList``/``ModuleDict`` holding most of the
    parameters among those whose layers contain projections (``nn.Linear`` or ``Conv1D``), whatever classes its layers
    are of (attention and recurrent layers interleaved, as hybrid models do); the embedding is the ``nn.Embedding``
    outside them; the head is the last projection outside them whose output size is the vocabulary; the final norm is
    the norm beside the blocks. Inside each layer, projections are marked by their usual names and kept only in pairs:
    a module (attention, MLP, or the layer itself) with at least one column-wise layer and exactly one row-wise layer,
    which restores the whole activation. A row-wise layer without its partner (``nn.MultiheadAttention``'s
    ``out_proj``, whose input projection is a bare parameter) stays whole. Every name of a tied tensor gets the
    same style, or none does (:func:`tie_styles`).
    """
    blocks = find_blocks(model)
    if blocks is None:
        return None
    outside = [(n, m) for n, m in model.named_modules() if n and not (n == blocks or n.startswith(blocks + "."))]
    embeddings = [(n, m) for n, m in outside if isinstance(m, nn.Embedding)]
    embedding = embeddings[0][0] if embeddings else None
    vocab = embeddings[0][1].num_embeddings if embeddings else None
    heads = [n for n, m in outside if is_projection(m) and (vocab is None or projection_features(m)[1] == vocab)]
    head = heads[-1] if heads else None
    parent = blocks.rpartition(".")[0]
    norms = [n for n, _ in outside if n.rpartition(".")[0] == parent and n.rpartition(".")[2] in _FINAL_NORM_NAMES]
    final_norm = norms[0] if norms else None

    # Every layer, not just the first: layers may be of several classes (attention and recurrent layers) or of one
    # class that differs inside (dense and MoE feed-forwards). A name that means one style in every layer holding it
    # gets one pattern for the whole list; one that means different styles in different layers, a pattern per layer.
    per_block = [(key, {name for name, _ in block.named_modules()}, _block_styles(block))
                 for key, block in model.get_submodule(blocks).named_children()]
    by_name: dict[str, dict[str, str]] = {}
    for key, _, styles_of_block in per_block:
        for name, style in styles_of_block.items():
            by_name.setdefault(name, {})[key] = style
    styles: dict[str, str] = {}
    for name, per_key in by_name.items():
        holders = [key for key, names, _ in per_block if name in names]
        if len(set(per_key.values())) == 1 and len(per_key) == len(holders):
            styles[f"{blocks}.*.{name}"] = next(iter(per_key.values()))
        else:
            styles.update({f"{blocks}.{key}.{name}": style for key, style in per_key.items()})
    if embedding:
        styles[embedding] = "vocab"
    if head:
        styles[head] = "colwise"
    if final_norm:
        styles[final_norm] = "sequence"
    model_map = ModelMap(blocks=blocks, embedding=embedding, final_norm=final_norm, head=head, styles=styles,
                         source="derived")
    return model_map.with_styles(tie_styles(model, model_map.styles))


def _block_styles(block: nn.Module) -> dict[str, str]:
    """The styles the name rules give inside one layer (names relative to it)."""
    modules = list(block.named_modules())
    styles: dict[str, str] = {}
    regions: dict[str, dict[str, str]] = {}  # parent (relative to the layer) -> {layer: style}
    for name, sub in modules:
        leaf = name.rpartition(".")[2]
        if leaf in _EXPERT_NAMES:
            styles[name] = "experts"
        elif is_projection(sub) and not _inside_experts(name) and not _inside(name, modules, nn.MultiheadAttention):
            role = ("colwise" if leaf in _COLWISE_NAMES or leaf in _FUSED_NAMES
                    else "rowwise" if leaf in _ROWWISE_NAMES else None)
            if role is not None:
                regions.setdefault(name.rpartition(".")[0], {})[name] = role
        elif "norm" in type(sub).__name__.lower() or "norm" in leaf.lower():
            if name and "." not in name:  # norms directly in the layer, not inside attention (q/k norms)
                styles[name] = "sequence"
    for layers in regions.values():
        roles = list(layers.values())
        if roles.count("rowwise") == 1 and "colwise" in roles:
            styles.update(layers)
    return styles


def tie_styles(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """``styles`` (of a map the project found) with every name of a tied tensor split alike, or none split.

    A tensor several modules hold (an embedding tied to the head, Press & Wolf 2017; an encoder-decoder's ``shared``,
    encoder and decoder ``embed_tokens`` and ``lm_head``, as T5 and BART tie them) stays one tensor under tensor
    parallel (:func:`~lightning_par.parallel.modules.retie`), so it has one layout. Where some of its holders are split
    and others left whole, each whole one takes the style of a split holder of its kind: another ``nn.Embedding`` of
    a ``vocab`` embedding, another projection of a projection's style, an ``nn.Linear`` head ``colwise`` beside a
    ``vocab`` embedding (both split the [vocabulary, width] weight by rows). Where a whole holder has no such partner,
    no holder is split. The styles added name single modules and come first, so they win over the patterns.
    """
    def style_of(name: str) -> str | None:
        return next((style for pattern, style in styles.items() if fnmatch.fnmatchcase(name, pattern)), None)

    modules = dict(model.named_modules(remove_duplicate=False))
    exact: dict[str, str] = {}
    for group in tied_groups(model):
        holders = list(dict.fromkeys(name.rpartition(".")[0] for name in group
                                     if not holds_for_submodule(name, group)))
        current = {holder: exact.get(holder, style_of(holder)) for holder in holders}
        split = {holder: style for holder, style in current.items() if style in (*SPLIT_STYLES, "vocab")}
        if not split or len(split) == len(holders):
            continue
        partners = {holder: next((alike for other, style in split.items()
                                  if (alike := _style_alike(modules[holder], modules[other], style)) is not None), None)
                    for holder in holders if holder not in split}
        if all(style is not None for style in partners.values()):
            exact.update(partners)  # type: ignore[arg-type]
        else:
            exact.update({holder: "replicate" for holder in split})
    return {**exact, **{pattern: style for pattern, style in styles.items() if pattern not in exact}}


def _style_alike(module: nn.Module, split: nn.Module, style: str) -> str | None:
    """The style under which ``module`` splits a weight it shares with ``split`` (split by ``style``) the same way, or
    None where it has none."""
    linear = isinstance(base_layer(module), nn.Linear)
    if isinstance(module, nn.Embedding):
        if style == "vocab" and isinstance(split, nn.Embedding):
            return "vocab"
        return "vocab" if style == "colwise" and isinstance(base_layer(split), nn.Linear) else None
    if style == "vocab":
        return "colwise" if linear and isinstance(split, nn.Embedding) else None
    if is_projection(module) and is_projection(split) and is_conv1d(base_layer(module)) == is_conv1d(base_layer(split)):
        return style
    return None


def huggingface_model_map(model: nn.Module) -> ModelMap | None:
    """The model map a Hugging Face model's config states, translated; None when ``model`` holds no such model.

    transformers configs carry ``base_model_tp_plan`` (module patterns -> styles, relative to the base model)
    and ``base_model_pp_plan`` (the embedding, the blocks and the final norm, in order); the causal-LM class adds
    its head. The blocks, embedding and head come from ``base_model_pp_plan`` where there is one; the styles inside the
    blocks from ``base_model_tp_plan`` (:data:`HF_STYLES`), the others (embedding, head, norms for sequence parallel) as
    :func:`derive_model_map` would set them.
    """
    for name, sub in model.named_modules():
        # The model's own attributes, not those a wrapper forwards from the model it holds (peft's PeftModel and
        # LoraModel answer for their base model's config): the names must be where the modules are.
        config = sub.__dict__.get("config")
        tp_plan = getattr(config, "base_model_tp_plan", None) or {}
        pp_plan = getattr(config, "base_model_pp_plan", None) or {}
        base_prefix = getattr(sub, "base_model_prefix", None)
        if not (tp_plan or pp_plan) or not isinstance(base_prefix, str):
            continue
        base = f"{name}.{base_prefix}" if base_prefix in sub._modules else name
        base = base.strip(".")
        derived = derive_model_map(model)
        if derived is None:
            return None

        def full(key: str) -> str:
            return f"{base}.{key}" if base else key

        keys = list(pp_plan)
        block_keys = [k for k in keys if isinstance(_get(model, full(k)), (nn.ModuleList, nn.ModuleDict))]
        blocks = full(block_keys[0]) if block_keys else derived.blocks
        after = keys[keys.index(block_keys[0]) + 1:] if block_keys else []
        head_keys = [k for k in getattr(sub, "_pp_plan", None) or {} if _get(model, f"{name}.{k}" if name else k)]
        styles = {full(pattern): HF_STYLES[style] for pattern, style in tp_plan.items() if style in HF_STYLES}
        # Block internals from the config; the rest (embedding, head, norms between regions) as derived. A
        # config that says nothing about the blocks (only its embedding) leaves them to derivation too.
        from_config = any(p.startswith(blocks + ".") for p in styles)
        styles.update({p: s for p, s in derived.styles.items()
                       if not from_config or not p.startswith(blocks + ".") or s in ("sequence", "experts")})
        styles = tie_styles(model, styles)
        return replace(derived, blocks=blocks,
                       embedding=full(keys[0]) if keys and isinstance(_get(model, full(keys[0])), nn.Embedding)
                       else derived.embedding,
                       final_norm=full(after[-1]) if after else derived.final_norm,
                       head=(f"{name}.{head_keys[0]}" if name else head_keys[0]) if head_keys else derived.head,
                       styles=styles, source="huggingface" if from_config else "derived")
    return None


def _get(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule at ``name``, through registered children only (not attributes a wrapper forwards)."""
    for part in name.split(".") if name else ():
        model = model._modules.get(part)
        if model is None:
            return None
    return model


def _inside_experts(name: str) -> bool:
    return any(part in _EXPERT_NAMES for part in name.split("."))


def _inside(name: str, modules: list[tuple[str, nn.Module]], kind: type) -> bool:
    """Whether ``name`` lies inside a module of type ``kind`` (names relative to the same block)."""
    return any(isinstance(m, kind) and name.startswith(n + ".") for n, m in modules if n)


def find_blocks(model: nn.Module) -> str | None:
    """The name of the model's layer list: of the ``ModuleList``/``ModuleDict`` whose entries all hold projections, the
    one holding most of the parameters (then the one with most entries; None when there is none).

    The list the network iterates over holds most of the parameters, whatever classes its layers are of (Jamba's and
    Zamba's attention and Mamba layers, LFM2's attention and convolution layers) and whether a module is shared by
    several of its layers (Zamba's shared transformer block). A list inside a layer (Zamba2's per-position adapters, an
    MoE layer's experts) holds part of one layer's parameters, so it is never chosen over the layer list.
    """
    best: tuple[tuple[int, int], str] | None = None
    for name, module in _block_lists(model):
        if _inside_experts(name) or not _holds_projections(module):
            continue
        key = (_parameter_count(module), len(module))
        if best is None or key > best[0]:
            best = (key, name)
    return best[1] if best else None


def _block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0]


def _holds_projections(container: nn.Module) -> bool:
    """Whether every entry of ``container`` holds a projection: a layer transforms the hidden states with weights
    (a named collection of parts, such as nanoGPT's ``transformer`` dict of embeddings, layers and norm, is not a
    layer list)."""
    return all(any(is_projection(m) for m in entry.modules()) for entry in container.children())


def _parameter_count(module: nn.Module) -> int:
    """Elements of the distinct parameters of ``module`` (a tensor shared by several layers counts once)."""
    return sum(p.numel() for p in module.parameters())


def why_no_blocks(model: nn.Module) -> str:
    """Why no model map could be derived for ``model``: the lists of modules it examined as candidate blocks and why
    each was rejected (for the refusal of a layout that needs one)."""
    reasons = []
    for name, module in _block_lists(model):
        if not _holds_projections(module):
            empty = sorted({type(c).__name__ for c in module.children()
                            if not any(is_projection(m) for m in c.modules())})
            reason = f"its {', '.join(empty)} entries hold no nn.Linear or Conv1D"
        elif _inside_experts(name):
            reason = "it holds experts, inside a block"
        else:
            continue
        reasons.append(f"{name or type(model).__name__} ({len(module)} entries): {reason}")
    if not reasons:
        return f"{type(model).__name__} holds no nn.ModuleList or nn.ModuleDict of blocks"
    return "candidate block lists examined: " + "; ".join(reasons[:4])


def resolve_model_map(given: ModelMap | None, model: nn.Module) -> ModelMap | None:
    """The model map to lay ``model`` out by: ``given`` (checked against the model), else the one a Hugging Face model's
    config states, else one derived from the model's shape (None if it has no standard shape)."""
    if given is not None:
        given.validate(model)
        return given
    return huggingface_model_map(model) or derive_model_map(model)


__all__ = ["HF_STYLES", "MAP_SOURCES", "ModelMap", "PROJECTION_NAMES", "SPLIT_STYLES", "STYLES", "derive_model_map",
           "huggingface_model_map", "is_conv1d", "is_projection", "network_prefix",
           "find_blocks", "projection_features", "resolve_model_map", "tie_styles", "why_no_blocks"]
