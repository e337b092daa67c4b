"""ModelPlan: derived for the reference model and for Hugging Face Llama naming; declarative form checked."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_par.models import LlamaConfig, Transformer
from lightning_par.parallel.plan import ModelPlan, derive_plan


class _HFAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))


class _HFMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)


class _HFDecoderLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.self_attn = _HFAttention(dim)
        self.mlp = _HFMLP(dim)
        self.input_layernorm = nn.RMSNorm(dim)
        self.post_attention_layernorm = nn.RMSNorm(dim)


class _HFModel(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_HFDecoderLayer(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)


class HFLlamaLike(nn.Module):
    """The module tree of transformers' LlamaForCausalLM (names only; no transformers import needed)."""

    def __init__(self, vocab: int = 50, dim: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.model = _HFModel(vocab, dim, layers)
        self.lm_head = nn.Linear(dim, vocab, bias=False)


def test_plan_of_reference_model() -> None:
    model = nn.Module()
    model.model = Transformer(LlamaConfig(dim=16, n_layers=3, n_heads=2))
    plan = derive_plan(model)
    assert plan is not None
    assert (plan.blocks, plan.embedding, plan.final_norm, plan.head) == (
        "model.layers", "model.embed_tokens", "model.norm", "model.lm_head")
    assert plan.block_names(model) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert plan.style_of("model.layers.2.attention.q_proj") == "colwise"
    assert plan.style_of("model.layers.0.attention.o_proj") == "rowwise"
    assert plan.style_of("model.layers.1.mlp.gate_proj") == "colwise"
    assert plan.style_of("model.layers.1.mlp.down_proj") == "rowwise"
    assert plan.style_of("model.layers.1.attention_norm") == "sequence"
    assert plan.style_of("model.embed_tokens") == "vocab"
    plan.check(model)


def test_plan_of_hugging_face_llama_naming() -> None:
    model = HFLlamaLike()
    plan = derive_plan(model)
    assert plan is not None
    assert (plan.blocks, plan.embedding, plan.final_norm, plan.head) == (
        "model.layers", "model.embed_tokens", "model.norm", "lm_head")
    assert plan.style_of("model.layers.1.self_attn.k_proj") == "colwise"
    assert plan.style_of("model.layers.1.mlp.up_proj") == "colwise"
    assert plan.style_of("model.layers.2.self_attn.o_proj") == "rowwise"
    assert plan.style_of("model.layers.0.post_attention_layernorm") == "sequence"


def test_no_plan_for_a_model_without_blocks() -> None:
    assert derive_plan(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) is None


def test_declarative_plan_from_yaml_dict() -> None:
    spec = {"blocks": "model.layers", "embedding": "model.embed_tokens", "head": "lm_head",
            "styles": {"model.layers.*.self_attn.q_proj": "colwise"}, "split_points": ["model.layers.2"]}
    plan = ModelPlan.from_dict(spec)
    plan.check(HFLlamaLike())
    assert plan.split_points == ("model.layers.2",)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"embedding": "x"}, "needs 'blocks'"),
        ({"blocks": "model.layers", "heads": "lm_head"}, r"unknown ModelPlan keys \['heads'\]"),
        ({"blocks": "model.layers", "styles": {"*.q_proj": "columnwise"}}, "style 'columnwise' for '\\*.q_proj'"),
    ],
)
def test_bad_declarative_plans(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelPlan.from_dict(spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"blocks": "model.blocks"}, r"ModelPlan.blocks='model.blocks' is not a module of HFLlamaLike"),
        ({"blocks": "model.layers", "styles": {"*.wq": "colwise"}}, r"pattern '\*.wq' matches no module"),
    ],
)
def test_plan_checked_against_the_model(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelPlan.from_dict(spec).check(HFLlamaLike())
