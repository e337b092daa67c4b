"""ModelPlan: where a decoder transformer keeps its blocks, attention, MLP, embedding and head.

Tensor, pipeline, sequence and expert parallelism all need to know the shape of the model. A plan
comes, in order of precedence, from (DESIGN.md):

1. the model itself (a ``parallelize(mesh, config)`` hook: the strategy then applies nothing itself);
2. a declarative plan (constructor argument or YAML): :meth:`ModelPlan.from_dict`;
3. :func:`derive_plan`, which recognises standard decoder transformers by structure and by the usual
   names (the project's reference model, Hugging Face's Llama/Mistral/Qwen family, torchtitan's Llama).

Styles name what a technique does to a module:
``colwise`` (split the output features), ``rowwise`` (split the input features), ``vocab``
(vocabulary-parallel embedding), ``sequence`` (norms that run on sequence-sharded activations),
``experts`` (an MoE expert group), ``replicate`` (leave whole).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from torch import nn

STYLES = ("colwise", "rowwise", "vocab", "sequence", "experts", "replicate")

# Names used across decoder families for the same role inside a block.
_COLWISE_NAMES = ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "gate_proj", "up_proj", "w1", "w3", "fc1")
_ROWWISE_NAMES = ("o_proj", "wo", "out_proj", "down_proj", "w2", "fc2")
_EXPERT_NAMES = ("experts",)
_FINAL_NORM_NAMES = ("norm", "final_norm", "ln_f", "final_layernorm", "norm_f")
_FUSED_QKV_NAMES = ("qkv_proj", "Wqkv", "c_attn", "query_key_value")


@dataclass(frozen=True)
class ModelPlan:
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

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, str) or not self.blocks:
            raise ValueError(f"ModelPlan.blocks must name the module holding the blocks, got {self.blocks!r}")
        for pattern, style in self.styles.items():
            if style not in STYLES:
                raise ValueError(f"ModelPlan style {style!r} for {pattern!r} is not one of {STYLES}")

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> ModelPlan:
        """Build a plan from a YAML/dict spec with the field names of this class."""
        unknown = set(spec) - {"blocks", "embedding", "final_norm", "head", "styles", "split_points"}
        if unknown:
            raise ValueError(f"unknown ModelPlan keys {sorted(unknown)}; expected blocks, embedding, final_norm, "
                             "head, styles, split_points")
        if "blocks" not in spec:
            raise ValueError("a ModelPlan spec needs 'blocks': the dotted name of the list of transformer blocks")
        spec = dict(spec)
        spec["split_points"] = tuple(spec.get("split_points", ()))
        spec["styles"] = dict(spec.get("styles", {}))
        return cls(**spec)

    def style_of(self, module_name: str) -> str | None:
        """The style of the first pattern matching ``module_name`` (None when no pattern matches)."""
        for pattern, style in self.styles.items():
            if fnmatch.fnmatchcase(module_name, pattern):
                return style
        return None

    def block_names(self, model: nn.Module) -> list[str]:
        """Full names of the blocks, in execution order."""
        container = model.get_submodule(self.blocks)
        return [f"{self.blocks}.{name}" for name, _ in container.named_children()]

    def check(self, model: nn.Module) -> None:
        """Raise ``ValueError`` if a named module does not exist in ``model``."""
        names = dict(model.named_modules())
        for role in ("blocks", "embedding", "final_norm", "head"):
            name = getattr(self, role)
            if name is not None and name not in names:
                raise ValueError(f"ModelPlan.{role}={name!r} is not a module of {type(model).__name__}")
        for pattern in self.styles:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ValueError(f"ModelPlan style pattern {pattern!r} matches no module of {type(model).__name__}")


def derive_plan(model: nn.Module) -> ModelPlan | None:
    """Recognise a standard decoder transformer; return None when the model does not look like one.

    The blocks are the longest ``ModuleList``/``ModuleDict`` of identical modules that contain linear
    projections; the embedding is the ``nn.Embedding`` outside them; the head is the last ``nn.Linear``
    outside them whose output size is the vocabulary; the final norm is the norm beside the blocks.
    """
    blocks = _find_blocks(model)
    if blocks is None:
        return None
    outside = [(n, m) for n, m in model.named_modules() if n and not (n == blocks or n.startswith(blocks + "."))]
    embeddings = [(n, m) for n, m in outside if isinstance(m, nn.Embedding)]
    embedding = embeddings[0][0] if embeddings else None
    vocab = embeddings[0][1].num_embeddings if embeddings else None
    heads = [n for n, m in outside if isinstance(m, nn.Linear) and (vocab is None or m.out_features == vocab)]
    head = heads[-1] if heads else None
    parent = blocks.rpartition(".")[0]
    norms = [n for n, _ in outside if n.rpartition(".")[0] == parent and n.rpartition(".")[2] in _FINAL_NORM_NAMES]
    final_norm = norms[0] if norms else None

    styles: dict[str, str] = {}
    # Every block, not just the first: blocks of one type may differ inside (dense and MoE feed-forwards).
    block_modules = [(name, sub) for block in model.get_submodule(blocks).children()
                     for name, sub in block.named_modules()]
    for name, sub in block_modules:
        leaf = name.rpartition(".")[2]
        pattern = f"{blocks}.*.{name}"
        if leaf in _EXPERT_NAMES:
            styles[pattern] = "experts"
        elif leaf in _FUSED_QKV_NAMES:
            styles[pattern] = "replicate"  # a fused projection cannot be split column-wise per head
        elif isinstance(sub, nn.Linear) and not _inside_experts(name):
            if leaf in _COLWISE_NAMES:
                styles[pattern] = "colwise"
            elif leaf in _ROWWISE_NAMES:
                styles[pattern] = "rowwise"
        elif "norm" in type(sub).__name__.lower() or "norm" in leaf.lower():
            if "." not in name:  # norms directly in the block, not inside attention (q/k norms)
                styles[pattern] = "sequence"
    if embedding:
        styles[embedding] = "vocab"
    if head:
        styles[head] = "colwise"
    if final_norm:
        styles[final_norm] = "sequence"
    return ModelPlan(blocks=blocks, embedding=embedding, final_norm=final_norm, head=head, styles=styles)


def _inside_experts(name: str) -> bool:
    return any(part in _EXPERT_NAMES for part in name.split("."))


def _find_blocks(model: nn.Module) -> str | None:
    best: tuple[int, str] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
            continue
        children = list(module.children())
        if len({type(c) for c in children}) != 1:
            continue
        if not any(isinstance(m, nn.Linear) for m in children[0].modules()):
            continue
        if _inside_experts(name):
            continue
        if best is None or len(children) > best[0]:
            best = (len(children), name)
    return best[1] if best else None


__all__ = ["ModelPlan", "derive_plan", "STYLES"]
