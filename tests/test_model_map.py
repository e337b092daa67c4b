"""ModelMap: derived for the reference model and for Hugging Face Llama naming; declarative form checked."""

from __future__ import annotations

import pytest
from installed import require
import torch
from torch import nn

from lightning_par.models import LlamaConfig, Transformer
from lightning_par.parallel.model_map import ModelMap, derive_model_map


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


def test_model_map_of_reference_model() -> None:
    model = nn.Module()
    model.model = Transformer(LlamaConfig(dim=16, n_layers=3, n_heads=2))
    model_map = derive_model_map(model)
    assert model_map is not None
    assert (model_map.blocks, model_map.embedding, model_map.final_norm, model_map.head) == (
        "model.layers", "model.embed_tokens", "model.norm", "model.lm_head")
    assert model_map.block_names(model) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert model_map.style_of("model.layers.2.attention.q_proj") == "colwise"
    assert model_map.style_of("model.layers.0.attention.o_proj") == "rowwise"
    assert model_map.style_of("model.layers.1.mlp.gate_proj") == "colwise"
    assert model_map.style_of("model.layers.1.mlp.down_proj") == "rowwise"
    assert model_map.style_of("model.layers.1.attention_norm") == "sequence"
    assert model_map.style_of("model.embed_tokens") == "vocab"
    model_map.validate(model)


def test_model_map_of_hugging_face_llama_naming() -> None:
    model = HFLlamaLike()
    model_map = derive_model_map(model)
    assert model_map is not None
    assert (model_map.blocks, model_map.embedding, model_map.final_norm, model_map.head) == (
        "model.layers", "model.embed_tokens", "model.norm", "lm_head")
    assert model_map.style_of("model.layers.1.self_attn.k_proj") == "colwise"
    assert model_map.style_of("model.layers.1.mlp.up_proj") == "colwise"
    assert model_map.style_of("model.layers.2.self_attn.o_proj") == "rowwise"
    assert model_map.style_of("model.layers.0.post_attention_layernorm") == "sequence"


def test_no_model_map_for_a_model_without_blocks() -> None:
    assert derive_model_map(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) is None


def test_declarative_model_map_from_yaml_dict() -> None:
    spec = {"blocks": "model.layers", "embedding": "model.embed_tokens", "head": "lm_head",
            "styles": {"model.layers.*.self_attn.q_proj": "colwise"}, "split_points": ["model.layers.2"]}
    model_map = ModelMap.from_dict(spec)
    model_map.validate(HFLlamaLike())
    assert model_map.split_points == ("model.layers.2",)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"embedding": "x"}, "needs 'blocks'"),
        ({"blocks": "model.layers", "heads": "lm_head"}, r"unknown ModelMap keys \['heads'\]"),
        ({"blocks": "model.layers", "styles": {"*.q_proj": "columnwise"}}, "style 'columnwise' for '\\*.q_proj'"),
    ],
)
def test_bad_declarative_model_maps(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelMap.from_dict(spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"blocks": "model.blocks"}, r"ModelMap.blocks='model.blocks' is not a module of HFLlamaLike"),
        ({"blocks": "model.layers", "styles": {"*.wq": "colwise"}}, r"pattern '\*.wq' matches no module"),
    ],
)
def test_model_map_checked_against_the_model(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelMap.from_dict(spec).validate(HFLlamaLike())


class Conv1D(nn.Module):
    """Hugging Face's Conv1D in shape: weight (in, out), ``nf`` output features."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


class _Block(nn.Module):
    def __init__(self, dim: int, attention: str, mlp: tuple[str, str]) -> None:
        super().__init__()
        if attention == "mha":
            self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        else:
            self.attn = nn.Module()
            self.attn.c_attn, self.attn.c_proj = Conv1D(3 * dim, dim), Conv1D(dim, dim)
        self.mlp = nn.Module()
        self.mlp.add_module(mlp[0], nn.Linear(dim, 2 * dim))
        self.mlp.add_module(mlp[1], nn.Linear(2 * dim, dim))


class _Network(nn.Module):
    def __init__(self, attention: str = "conv1d", mlp: tuple[str, str] = ("c_fc", "c_proj")) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 8)
        self.h = nn.ModuleList(_Block(8, attention, mlp) for _ in range(2))
        self.ln_f = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 50, bias=False)


def test_derived_model_map_splits_conv1d_and_fused_projections() -> None:
    """GPT-2's Conv1D layers are projections; a fused q/k/v is marked column-wise like the rest (the tensor-parallel check
    decides whether it can stay split or must be gathered)."""
    model_map = derive_model_map(_Network())
    assert model_map is not None and model_map.source == "derived"
    assert (model_map.blocks, model_map.embedding, model_map.final_norm, model_map.head) == ("h", "wte", "ln_f", "lm_head")
    assert model_map.style_of("h.1.attn.c_attn") == "colwise" and model_map.style_of("h.1.attn.c_proj") == "rowwise"
    assert model_map.style_of("h.0.mlp.c_fc") == "colwise" and model_map.style_of("h.0.mlp.c_proj") == "rowwise"


def test_derived_model_map_pairs_projections_or_leaves_them_whole() -> None:
    """nn.MultiheadAttention's out_proj has no column-wise partner (its input projection is a bare parameter):
    left whole. Projections no rule recognises are left whole too."""
    model_map = derive_model_map(_Network(attention="mha", mlp=("fc1", "fc2")))
    assert model_map.style_of("h.0.attn.out_proj") is None
    assert model_map.style_of("h.0.mlp.fc1") == "colwise" and model_map.style_of("h.0.mlp.fc2") == "rowwise"
    model_map = derive_model_map(_Network(attention="mha", mlp=("lin_in", "lin_out")))
    assert not [p for p, s in model_map.styles.items() if p.startswith("h.") and s in ("colwise", "rowwise")]


def test_an_explicit_model_map_cannot_split_multihead_attention() -> None:
    from lightning_par.parallel.tensor import check_tensor_parallel

    model = _Network(attention="mha", mlp=("fc1", "fc2"))
    model_map = ModelMap.from_dict({"blocks": "h", "styles": {"h.*.attn.out_proj": "rowwise"}})
    with pytest.raises(ValueError, match=r"cannot split 'h.0.attn.out_proj' \(rowwise\): it belongs to "
                                         r"nn.MultiheadAttention 'h.0.attn'"):
        check_tensor_parallel(model, model_map, 2)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (dict(model_type="gpt_neox"), {"model.gpt_neox.embed_in": "vocab",
                                        "model.gpt_neox.layers.1.attention.query_key_value": "colwise",
                                        "model.gpt_neox.layers.0.mlp.dense_4h_to_h": "rowwise"}),
        (dict(model_type="qwen3", head_dim=8), {"model.model.layers.0.self_attn.q_norm": "per_shard",
                                                 "model.model.layers.0.self_attn.o_proj": "rowwise"}),
        (dict(model_type="phi3", pad_token_id=0), {"model.model.layers.0.self_attn.qkv_proj": "colwise_gather",
                                   "model.model.layers.0.mlp.down_proj": "rowwise_split"}),
    ],
    ids=["gpt_neox", "qwen3", "phi3"],
)
def test_hugging_face_plans_are_translated(config: dict, expected: dict) -> None:
    """The config's base_model_tp_plan gives the styles inside the blocks, its base_model_pp_plan the parts
    (GPT-NeoX's final norm is final_layer_norm), the causal-LM class its head."""
    transformers = require("transformers")
    from lightning_par.parallel.model_map import huggingface_model_map

    model_config = transformers.AutoConfig.for_model(**config, vocab_size=64, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4)
    model = nn.Module()
    model.model = transformers.AutoModelForCausalLM.from_config(model_config)
    model_map = huggingface_model_map(model)
    assert model_map is not None and model_map.source == "huggingface"
    for name, style in expected.items():
        assert model_map.style_of(name) == style, name
    assert model_map.head == "model.lm_head" and model_map.style_of(model_map.head) == "colwise"
    if config["model_type"] == "gpt_neox":
        assert (model_map.blocks, model_map.final_norm) == ("model.gpt_neox.layers", "model.gpt_neox.final_layer_norm")
    assert huggingface_model_map(_Network()) is None  # not a Hugging Face model


def test_the_shared_rotary_key_style_comes_from_the_plan_and_needs_the_rotary_width() -> None:
    """transformers' ``mla_kv_a_proj`` (multi-head latent attention's projection to the latent and the shared rotary
    key) becomes ``shared_rope_key``, whose width is the attention's ``qk_rope_head_dim``; a module without one is
    refused, naming the projection."""
    transformers = require("transformers")
    from lightning_par.parallel.model_map import huggingface_model_map
    from lightning_par.parallel.tensor import tensor_parallel_styles

    config = transformers.AutoConfig.for_model("deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, q_lora_rank=16,
                                               kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    model = nn.Module()
    model.model = transformers.AutoModelForCausalLM.from_config(config)
    # The plan as transformers states it for MLA (older releases leave the attention out of it).
    model.model.model.config.base_model_tp_plan = {"layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
                                                   "layers.*.self_attn.kv_b_proj": "colwise",
                                                   "layers.*.self_attn.o_proj": "rowwise"}
    model_map = huggingface_model_map(model)
    projection = "model.model.layers.0.self_attn.kv_a_proj_with_mqa"
    assert model_map.style_of(projection) == "shared_rope_key"
    assert tensor_parallel_styles(model, model_map)[projection].rope_features == 4

    plain = HFLlamaLike()
    plain_map = ModelMap.from_dict({"blocks": "model.layers", "styles": {"model.layers.*.self_attn.q_proj":
                                                                         "shared_rope_key"}})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj' the style 'shared_rope_key'.*"
                                         r"_HFAttention 'model.layers.0.self_attn' holds no qk_rope_head_dim"):
        tensor_parallel_styles(plain, plain_map)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_the_tensor_parallel_checks_copy_cuts_the_vocabulary(model_type: str) -> None:
    """The tensor-parallel check's copy keeps a few rows per rank of a large embedding and linear head (tied ones stay
    tied; the remainder modulo tp is kept), and the cut model runs; a head of another kind is left whole."""
    transformers = require("transformers")
    from lightning_par.parallel.small_copy import Vocabulary, small_copy

    arguments = {"llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               tie_word_embeddings=True),
                 "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=32)}[model_type]
    config = transformers.AutoConfig.for_model(model_type, vocab_size=1001, **arguments)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model_map = derive_model_map(model)
    vocabulary = Vocabulary.to_cut(model, model_map.embedding, model_map.head, rows=16 * 2 + 1001 % 2)
    model_copy = small_copy(model, model_map.blocks, torch.device("cpu"), torch.float64, vocabulary=vocabulary)
    embedding = model_copy.get_submodule(model_map.embedding)
    assert embedding.weight.shape == (33, 32) and model.get_submodule(model_map.embedding).weight.shape == (1001, 32)
    assert model_copy.get_submodule(model_map.head).weight is embedding.weight
    assert model_copy(torch.arange(8).reshape(1, 8)).logits.shape == (1, 8, 33)
    assert Vocabulary.to_cut(model, model_map.embedding, model_map.head, rows=2000) is None  # no larger than the model's
    assert Vocabulary.to_cut(model, model_map.blocks, None, rows=8) is None  # not an embedding
    model.lm_head = transformers.pytorch_utils.Conv1D(1001, 32)
    assert Vocabulary.to_cut(model, model_map.embedding, model_map.head, rows=33) is None


def test_no_model_map_names_the_block_lists_it_examined_and_why_each_was_rejected() -> None:
    """A model whose lists hold no projection gets no derived map; the refusal names each list and the reason, not
    only that none was found."""
    from lightning_par.parallel.model_map import derive_model_map
    from lightning_par.parallel.tensor import check_tensor_parallel

    class Unlisted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.projections = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            self.norms = nn.ModuleList([nn.LayerNorm(8), nn.RMSNorm(8)])

    model = Unlisted()
    assert derive_model_map(model) is None
    with pytest.raises(ValueError, match=r"no model map was found \(candidate block lists examined: norms \(2 "
                                         r"entries\): its LayerNorm, RMSNorm entries hold no nn.Linear or Conv1D\)"):
        check_tensor_parallel(model, None, 2)


def _structural_pairs(model: nn.Module, model_map: ModelMap, inputs: torch.Tensor) -> dict[str, str]:
    from lightning_par.parallel.model_map_structure import structural_styles
    from lightning_par.parallel.small_copy import small_copy

    copy = small_copy(model, model_map.blocks, torch.device("cpu"), torch.float32)
    return structural_styles(copy, model_map, lambda: copy(inputs))


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gpt2", "gpt_neox", "phi3", "olmo2", "phi", "nanogpt"])
def test_pairs_found_from_the_computation_are_those_the_name_rules_give(name: str) -> None:
    """With the names forgotten, the column/row-wise pairs read off one forward of the blocks are exactly the pairs
    the name rules give each family of the zoo (fused q/k/v, Conv1D, parallel residuals, post-norms)."""
    require("transformers")
    import zoo

    model = zoo.make_model(name)
    named = derive_model_map(model)
    pairs = {p: s for p, s in named.styles.items()
             if s in ("colwise", "rowwise") and p.startswith(named.blocks + ".")}
    assert pairs
    unnamed = named.with_styles({p: s for p, s in named.styles.items() if p not in pairs})
    assert _structural_pairs(model, unnamed, torch.randint(0, zoo.VOCAB, (1, 8))) == pairs


def test_pairs_are_found_from_the_computation_where_no_name_rule_knows_the_layers() -> None:
    """litgpt's fused q/k/v of all query groups and fc_1/fc_2/proj, projections directly in the block, and a DiT's
    attention (output projection in to_out.0) and feed-forward (net.0.proj, net.2) beside its adaLN-Zero
    modulation (a projection of the timestep embedding, which reads no block input and stays whole)."""
    import zoo

    cases = {"flat_block": (zoo.make_model("flat_block"), {"q": "colwise", "k": "colwise", "v": "colwise",
                                                         "o": "rowwise", "fc_a": "colwise", "fc_b": "rowwise"})}
    cases["litgpt_llama"] = (zoo.make_model("litgpt_llama"),
                             {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc_1": "colwise",
                              "mlp.fc_2": "colwise", "mlp.proj": "rowwise"})
    for name, (model, expected) in cases.items():
        model_map = derive_model_map(model)
        found = _structural_pairs(model, model_map, torch.randint(0, zoo.VOCAB, (1, 8)))
        assert found == {f"{model_map.blocks}.*.{layer}": style for layer, style in expected.items()}, name
    require("diffusers")
    from lightning_par.models import DiTDenoiser

    dit = DiTDenoiser(image_size=8, channels=4, classes=4, patch_size=2, heads=2, head_dim=8, depth=2)
    model_map = derive_model_map(dit)
    found = _structural_pairs(dit, model_map, torch.zeros(1, 5, 8, 8))
    expected = {"attn1.to_q": "colwise", "attn1.to_k": "colwise", "attn1.to_v": "colwise", "attn1.to_out.0": "rowwise",
                "ff.net.0.proj": "colwise", "ff.net.2": "rowwise"}
    assert found == {f"model.transformer_blocks.*.{layer}": style for layer, style in expected.items()}


def test_blocks_whose_parts_run_outside_them_are_found() -> None:
    """A DiT runs block 0's timestep embedding after the last block (ZeRO-3 then keeps that block with the root);
    the reference model calls nothing of a block from outside."""
    from lightning_par.parallel.outside_calls import blocks_used_outside

    cpu = torch.device("cpu")
    reference = Transformer(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16))
    assert blocks_used_outside(reference, derive_model_map(reference), torch.randint(0, 64, (1, 8)), cpu) == {}
    require("diffusers")
    from lightning_par.models import DiTDenoiser

    dit = DiTDenoiser(image_size=8, channels=4, classes=4, patch_size=2, heads=2, head_dim=8, depth=2)
    found = blocks_used_outside(dit, derive_model_map(dit), torch.zeros(1, 5, 8, 8), cpu)
    assert found == {"model.transformer_blocks.0": ["model.transformer_blocks.0.norm1.emb"]}


class _Cut(nn.Module):
    """A fused projection and the way a model cuts its output."""

    def __init__(self, cut: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.qkv(x)
        if self.cut == "split":  # litgpt: q of 4 heads, k and v of 2 groups, head size 3
            q, k, v = out.split((12, 6, 6), dim=-1)
        elif self.cut == "chunk":  # a gate/up pair
            q, k = out.chunk(2, dim=-1)
            v = q
        elif self.cut == "slices":  # Phi-3: slices by offsets
            q, k, v = out[..., :12], out[..., 12:18], out[..., 18:]
        else:  # timm: (3, heads, head size)
            q, k, v = out.reshape(*x.shape[:-1], 3, 2, 4).unbind(-3)
        return q.sum() + k.sum() + v.sum()


@pytest.mark.parametrize("cut, sections", [("split", (12, 6, 6)), ("chunk", (12, 12)), ("slices", (12, 6, 6)),
                                           ("reshape", (8, 8, 8))])
def test_the_sections_a_model_cuts_a_fused_projection_into_are_read_off_its_forward(cut: str, sections: tuple) -> None:
    from lightning_par.parallel.model_map_structure import fused_sections

    model = _Cut(cut)
    assert fused_sections(model, ["qkv"], lambda: model(torch.randn(2, 5, 8))) == {"qkv": sections}


def test_regrouped_rows_give_each_rank_its_part_of_every_section_and_convert_back() -> None:
    """[q0 q1 q2 q3 | k0 k1 | v0 v1] over 2 ranks -> [q0 q1 k0 v0 | q2 q3 k1 v1]; the layer's state_dict() and
    load_state_dict() speak the stored order, and so do the optimizer states' conversions."""
    from lightning_par.parallel.regroup import regroup_rows, section_order, to_stored_order, to_training_order

    assert section_order((4, 2, 2), 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    with pytest.raises(ValueError, match=r"tp=4 does not divide the sections \[4, 2, 2\].*fit: \[1, 2\]"):
        section_order((4, 2, 2), 4)
    layer = nn.Linear(3, 8)
    stored = {name: value.detach().clone() for name, value in layer.state_dict().items()}
    regroup_rows(layer, (4, 2, 2), 2, {"weight": 0, "bias": 0})
    assert torch.equal(layer.weight[2], stored["weight"][4]) and torch.equal(layer.bias[3], stored["bias"][6])
    model = nn.Sequential(layer)
    assert all(torch.equal(model.state_dict()[f"0.{k}"], v) for k, v in stored.items())
    assert model.state_dict(keep_vars=True)["0.weight"] is layer.weight  # the parameters themselves: training order
    trained = {k: v.detach().clone() for k, v in layer.named_parameters()}
    model.load_state_dict({f"0.{k}": v for k, v in stored.items()})
    assert all(torch.equal(getattr(layer, k), v) for k, v in trained.items())
    out = to_stored_order(model, {f"0.{k}": v for k, v in trained.items()})  # an optimizer state's conversion
    assert all(torch.equal(out[f"0.{k}"], v) for k, v in stored.items())
    back = to_training_order(model, out)
    assert torch.equal(back["0.weight"], layer.weight) and torch.equal(back["0.bias"], layer.bias)
    with pytest.raises(ValueError, match="add up to 8, but its weight has 6 output features"):
        regroup_rows(nn.Linear(3, 6), (4, 2, 2), 2, {"weight": 0})


def test_head_counts_per_rank_copy_a_shared_config_and_name_what_does_not_divide() -> None:
    from types import SimpleNamespace

    from lightning_par.parallel.local_heads import head_counts, localize_head_counts

    config = SimpleNamespace(n_head=4, n_query_groups=2, n_embd=32, head_size=8)
    blocks = [nn.Module() for _ in range(2)]
    for block in blocks:
        block.attn = nn.Module()
        block.attn.config = config
        block.attn.num_heads = 4
    assert head_counts(blocks[0], 2) == {"attn.num_heads": (4, 2), "attn.config.n_head": (4, 2),
                                         "attn.config.n_query_groups": (2, 1)}
    assert head_counts(blocks[0], 4) is None  # 2 query groups do not split 4 ways
    localize_head_counts(blocks, 2)
    assert (config.n_head, config.n_query_groups) == (4, 2)  # the model's own config is untouched
    local = blocks[0].attn.config
    assert local is blocks[1].attn.config and (local.n_head, local.n_query_groups, local.n_embd) == (2, 1, 32)
    assert blocks[1].attn.num_heads == 2
    attention = nn.Module()
    attention.config = config
    with pytest.raises(ValueError, match=r"tp=4 does not divide Module.config.n_query_groups=2.*fit: \[1, 2\]"):
        localize_head_counts([attention], 4)
    assert attention.config is config and config.n_head == 4  # nothing changed
