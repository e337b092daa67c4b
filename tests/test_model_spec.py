"""The planner's ModelSpec read off a module without a configuration
(lightning_par.planner.module_spec), checked against the configuration-read spec where there is one."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from cli_callbacks import TinyCausalTransformer
from harness import run_distributed
from torch import nn
from zoo import ARCHITECTURES, NanoGPT, make_model

from lightning_par.models import LlamaLM
from lightning_par.planner import ModelSpec
from lightning_par.planner.module_spec import CannotDescribe, derive_model_spec, module_spec


def _meta(build):
    with torch.device("meta"):  # shapes only: nothing is allocated or initialised
        return build()


def _same(derived: ModelSpec, read: ModelSpec) -> None:
    assert dataclasses.replace(derived, name="x") == dataclasses.replace(read, name="x")


# Hugging Face architectures from the zoo that ModelSpec describes (the others are refused below, as by the config).
DESCRIBED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2")


@pytest.mark.parametrize("name", DESCRIBED)
def test_derived_spec_matches_the_configuration_of_hugging_face_models(name: str) -> None:
    """q/k/v or fused qkv (Phi-3), gate/up or fused gate_up, q/k norms, tied heads: the same spec as the config."""
    module = _meta(functools.partial(make_model, name))
    _same(derive_model_spec(module), ModelSpec.from_module(module))


def test_derived_spec_of_a_gpt2_wide_enough_for_its_positions_matches_its_config() -> None:
    """GPT-2: Conv1D projections, fused c_attn, plain MLP, tied head (its positions and biases under 2%)."""
    import transformers
    from zoo import HuggingFaceLM

    config = dict(ARCHITECTURES["gpt2"], n_embd=256, n_inner=1024, vocab_size=2048)
    module = _meta(functools.partial(HuggingFaceLM, config))
    derived = derive_model_spec(module)
    assert (derived.heads, derived.kv_heads, derived.ffn_hidden, derived.ffn_matrices, derived.tie_embeddings) == (
        4, 4, 1024, 2, True)
    _same(derived, ModelSpec.from_hf_config(transformers.AutoConfig.for_model(**config)))


def test_derived_spec_of_the_reference_model_dense_and_moe_matches_its_config() -> None:
    for kwargs in ({"n_kv_heads": 2}, {"n_kv_heads": 2, "moe_experts": 4, "moe_top_k": 2},
                   {"tie_embeddings": True, "n_kv_heads": 1}):
        module = _meta(functools.partial(LlamaLM, vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=128,
                                         **kwargs))
        _same(derive_model_spec(module), ModelSpec.from_module(module))


def test_a_nanogpt_is_described_from_its_parameters() -> None:
    """Karpathy's nanoGPT: no config object; n_head on its attention, fused c_attn, GELU MLP, tied head."""
    module = _meta(functools.partial(NanoGPT, vocab_size=1024, n_embd=256, n_head=8, n_layer=3))
    spec = module_spec(module)
    assert spec == ModelSpec(vocab_size=1024, hidden=256, layers=3, heads=8, kv_heads=8, ffn_hidden=1024,
                             tie_embeddings=True, ffn_matrices=2, name="NanoGPT")


def test_a_stack_of_torch_transformer_encoder_layers_is_described() -> None:
    """nn.TransformerEncoderLayer: nn.MultiheadAttention (in_proj_weight, num_heads), linear1/linear2."""
    module = _meta(functools.partial(TinyCausalTransformer, vocab_size=1024, dim=256, n_layers=3, n_heads=4))
    assert module_spec(module) == ModelSpec(vocab_size=1024, hidden=256, layers=3, heads=4, kv_heads=4,
                                            ffn_hidden=512, ffn_matrices=2, name="TinyCausalTransformer")


def test_projections_directly_in_the_block_take_heads_from_the_block() -> None:
    """tests/zoo.py's FlatBlock: q, k, v, o, fc_a, fc_b in the block, `heads` on the block."""
    spec = derive_model_spec(_meta(functools.partial(make_model, "flat_block")))
    assert (spec.heads, spec.kv_heads, spec.ffn_hidden, spec.ffn_matrices, spec.layers) == (4, 4, 64, 2, 2)


# --------------------------------------------------------------------------------------------- refusals
class _NoHeads(nn.Module):
    """q/k/v/o projections and nothing that says how they split into heads."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            self.attn.add_module(name, nn.Linear(256, 256, bias=False))
        self.mlp = nn.Module()
        self.mlp.up_proj, self.mlp.down_proj = nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False)


class _Model(nn.Module):
    def __init__(self, block: type) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 256)
        self.layers = nn.ModuleList(block() for _ in range(2))
        self.norm = nn.RMSNorm(256)
        self.lm_head = nn.Linear(256, 512, bias=False)


def test_a_module_whose_heads_cannot_be_told_is_refused_with_the_reason() -> None:
    with pytest.raises(CannotDescribe, match=r"layers\.0\.attn says neither its number of heads nor its head width"):
        derive_model_spec(_meta(functools.partial(_Model, _NoHeads)))


def test_parts_the_planner_does_not_model_are_refused_naming_both_counts() -> None:
    """The zoo's tiny nanoGPT: learned positions and biases are 4.6% of its 28,032 parameters."""
    with pytest.raises(CannotDescribe, match=r"NanoGPT has 28,032 parameters, .* 26,784"):
        derive_model_spec(_meta(NanoGPT))


def test_latent_attention_and_non_transformers_are_refused() -> None:
    with pytest.raises(CannotDescribe, match="multi-head latent attention"):
        derive_model_spec(_meta(functools.partial(make_model, "deepseek_v3")))
    with pytest.raises(CannotDescribe, match="no list of transformer blocks"):
        derive_model_spec(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8)))


def test_without_a_config_and_without_a_description_the_advice_stays() -> None:
    """What the strategy raises: no configuration read, the derivation's reason, and what to give instead."""
    with pytest.raises(ValueError, match=r"give the strategy's model_spec instead.*could not: TinyCausalTransformer "
                                         r"has 33,728 parameters"):
        module_spec(_meta(TinyCausalTransformer))


def test_a_configuration_read_and_refused_keeps_its_own_reason() -> None:
    with pytest.raises(ValueError, match="the planner cannot describe 'GPT2LMHeadModel'"):
        module_spec(_meta(functools.partial(make_model, "gpt2")))


# --------------------------------------------------------------------------------------------- the strategy
def _plan_without_a_config(rank: int, world_size: int) -> dict:
    import lightning

    import lightning_par
    from lightning_par.data import TokenDataModule

    strategy = lightning_par.AutoParallelStrategy(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                  context_parallel_size=1, expert_parallel_size=1)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0)
    datamodule = TokenDataModule(source="synthetic", vocab_size=256, seq_len=16, batch_size=2, num_samples=64)
    trainer.fit(TinyCausalTransformer(dim=128), datamodule=datamodule)
    return {"model": strategy.planned_layouts[0].time.model_flops, "loss": float(trainer.callback_metrics["train_loss"])}


def test_auto_parallel_plans_a_module_without_a_config_from_its_parameters() -> None:
    expected = ModelSpec(vocab_size=256, hidden=128, layers=2, heads=2, kv_heads=2, ffn_hidden=256, ffn_matrices=2)
    for result in run_distributed(_plan_without_a_config, 2):
        # model FLOPs per step = the derived spec's per token x 2 ranks x 2 sequences x 16 tokens
        assert result["model"] == expected.flops_per_token(16) * 2 * 2 * 16
        assert 0.0 < result["loss"] < 10.0
