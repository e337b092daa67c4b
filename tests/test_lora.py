"""LoRA fine-tuning (peft) and frozen parameters in every layout: the same training as one process.

``HFCausalLM(lora=...)`` puts peft's LoRA adapters on a pretrained model (base frozen); a hand-written reference
model freezes its embedding and first block. Each layout trains every model one after the other in one launch, 20
AdamW steps, against one process on the same global batches."""

from __future__ import annotations

import functools

import pytest
from installed import require
import torch
from hf_directories import VOCAB, make_model_directory, write_corpus
from parity import assert_parity, layout_runs, reference_run

require("transformers")
require("peft")

STEPS = 20
LEARNING_RATE = 1e-3
GLOBAL_BATCH = 4
PARITY_RTOL = 1e-5
WEIGHT_ATOL = 1e-3 * LEARNING_RATE * STEPS  # AdamW: see parity.assert_parity

# Pretrained family -> the layers adapted: column-wise (q, v) and row-wise (o, down) projections, so that tensor
# parallel splits both kinds of adapter.
LORA_TARGETS = {
    "llama-tied": ["q_proj", "v_proj", "o_proj", "down_proj"],
    "qwen2": ["q_proj", "v_proj", "o_proj", "down_proj"],  # biases on q/k/v
    "gemma": ["q_proj", "v_proj", "o_proj", "down_proj"],  # head tied to the embedding
}
MOE = "moe-peft"  # the project's MoE model wrapped by the user with get_peft_model, LoRA on attention only
FROZEN = "llama-frozen"  # the project's model with its embedding and first block frozen
MODELS = (*LORA_TARGETS, MOE, FROZEN)

# name -> (world size, data-parallel size, Hybrid3DStrategy arguments)
LAYOUTS = {
    "tp2": (2, 1, dict(tensor_parallel_size=2)),
    "pp2": (2, 1, dict(pipeline_parallel_size=2, microbatches=2)),
    "zero3": (2, 2, dict(data_parallel_size=2, zero_stage=3)),
    "dp2xtp2": (4, 2, dict(data_parallel_size=2, tensor_parallel_size=2)),
    "pp2xtp2": (4, 1, dict(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2)),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    directories = {family: str(make_model_directory(root / family, family)) for family in LORA_TARGETS}
    return {**directories, "corpus": str(write_corpus(root / "corpus", repeats=12)["jsonl"])}


def _module(name: str, workspace: dict[str, str]):
    from lightning_par.models import HFCausalLM, LlamaLM

    if name in (FROZEN, MOE):
        module = LlamaLM(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32,
                         moe_experts=4 if name == MOE else 0, learning_rate=LEARNING_RATE, weight_decay=0.1,
                         max_steps=STEPS)
        if name == MOE:
            from peft import LoraConfig, get_peft_model

            module.model = get_peft_model(module.model, LoraConfig(r=4, lora_alpha=8,
                                                                   target_modules=["q_proj", "v_proj", "o_proj"]))
        else:
            module.model.embed_tokens.requires_grad_(False)
            module.model.layers["0"].requires_grad_(False)
        return module

    return HFCausalLM(pretrained=workspace[name], learning_rate=LEARNING_RATE, weight_decay=0.1, warmup_steps=2,
                      max_steps=STEPS, lora={"r": 4, "alpha": 8, "target_modules": LORA_TARGETS[name]})


def _data(workspace: dict[str, str], batch_size: int):
    from lightning_par.data import TextDataModule

    return TextDataModule(train_files=workspace["corpus"], tokenizer=workspace["llama-tied"], seq_len=16,
                          batch_size=batch_size, val_fraction=0.0)


def _strategy(sizes: dict):
    from lightning_par import Hybrid3DStrategy

    return Hybrid3DStrategy(**sizes)


_REFERENCES: dict[tuple[str, int], object] = {}


def _reference(name: str, workspace: dict[str, str], dp: int):
    """One process on the global batches a layout with ``dp`` data-parallel ranks reads (shared between layouts)."""
    if (name, dp) not in _REFERENCES:
        _REFERENCES[name, dp] = reference_run(functools.partial(_module, name, workspace),
                                              functools.partial(_data, workspace, GLOBAL_BATCH // dp), dp=dp,
                                              steps=STEPS)
    return _REFERENCES[name, dp]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_and_frozen_models_train_like_one_process(workspace: dict[str, str], layout: str) -> None:
    world_size, dp, sizes = LAYOUTS[layout]
    runs = {name: (functools.partial(_module, name, workspace),
                   functools.partial(_data, workspace, GLOBAL_BATCH // dp),
                   functools.partial(_strategy, sizes)) for name in MODELS}
    results = layout_runs(runs, world_size=world_size, steps=STEPS, timeout=540)
    for name in MODELS:
        expected = _reference(name, workspace, dp)
        loss_error, weight_error = assert_parity(results[name], expected, rtol=PARITY_RTOL, weight_atol=WEIGHT_ATOL)
        print(f"{layout} {name}: loss {loss_error:.1e}, weights {weight_error:.1e} absolute")
        if name != FROZEN:  # the adapters trained; the frozen base is exactly as it was, in the layout too
            assert any(float(t.abs().max()) > 0 for key, t in expected.state_dict.items() if "lora_B" in key), name
            for key, tensor in expected.state_dict.items():
                if "lora_" not in key:
                    assert torch.equal(results[name].state_dict[key], tensor), f"{layout} {name}: {key} moved"


# Layouts beyond the five above, on 2 ranks, one launch for all: each with the models that exercise it. Context parallel
# cuts adapted layers' inputs along the sequence; ZeRO-1/2 partition only the adapters' states and gradients; expert
# parallel splits the experts of the MoE model whose attention is adapted.
MORE_LAYOUTS = {
    "cp2-ring": (1, dict(context_parallel_size=2, context_parallel_method="ring"), ("llama-tied", "qwen2")),
    "zero1": (2, dict(data_parallel_size=2, zero_stage=1), ("gemma", FROZEN)),
    "zero2": (2, dict(data_parallel_size=2, zero_stage=2), ("qwen2", MOE)),
    "ep2": (2, dict(expert_parallel_size=2), (MOE,)),
}


def test_lora_and_frozen_models_train_like_one_process_in_more_layouts(workspace: dict[str, str]) -> None:
    runs = {f"{layout} {name}": (functools.partial(_module, name, workspace),
                                 functools.partial(_data, workspace, GLOBAL_BATCH // dp),
                                 functools.partial(_strategy, sizes))
            for layout, (dp, sizes, names) in MORE_LAYOUTS.items() for name in names}
    results = layout_runs(runs, world_size=2, steps=STEPS, timeout=540)
    for label, result in results.items():
        layout, name = label.split()
        expected = _reference(name, workspace, MORE_LAYOUTS[layout][0])
        loss_error, weight_error = assert_parity(result, expected, rtol=PARITY_RTOL, weight_atol=WEIGHT_ATOL)
        print(f"{label}: loss {loss_error:.1e}, weights {weight_error:.1e} absolute")
        for key, tensor in expected.state_dict.items():
            if "lora_" not in key and name != FROZEN:
                assert torch.equal(result.state_dict[key], tensor), f"{label}: {key} moved"


def _adapter_placements(rank: int, world_size: int, workspace: dict[str, str]) -> dict[str, str]:
    import lightning
    from torch.distributed.tensor import DTensor

    module = _module("qwen2", workspace)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=_strategy(dict(tensor_parallel_size=2)),
                                max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=_data(workspace, GLOBAL_BATCH))
    return {name: (str(p.placements) if isinstance(p, DTensor) else "plain", p.requires_grad)
            for name, p in module.named_parameters() if ".layers.0.self_attn." in name or ".layers.0.mlp." in name}


def test_tensor_parallel_splits_adapters_like_their_layer(workspace: dict[str, str]) -> None:
    """Column-wise base (q, v): lora_B split by its outputs, lora_A whole; row-wise base (o, down): lora_A split by its
    inputs, lora_B whole. DTensor would compute any placement correctly (gathering what it must), so the parity above
    cannot tell; the placements say whether each rank holds and computes only its part. Bases stay frozen."""
    from harness import run_distributed

    placements = run_distributed(_adapter_placements, 2, workspace)[0]
    for name, (placement, trainable) in placements.items():
        layer = next(p for p in ("q_proj", "v_proj", "o_proj", "down_proj", "k_proj", "gate_proj", "up_proj")
                     if f".{p}." in name)
        colwise = layer in ("q_proj", "v_proj", "k_proj", "gate_proj", "up_proj")
        if ".lora_A." in name:
            expected = "(Replicate(),)" if colwise else "(Shard(dim=1),)"
        elif ".lora_B." in name:
            expected = "(Shard(dim=0),)" if colwise else "(Replicate(),)"
        else:  # the frozen base, split as without LoRA
            expected = ("(Shard(dim=0),)" if colwise else
                        "(Shard(dim=1),)" if name.endswith("weight") else "(Replicate(),)")
        assert placement == expected, (name, placement, expected)
        assert trainable == ("lora_" in name), name
