"""A model built on the meta device (``init_module(empty_init=True)``) starts, under every layout, from the weights one
process draws with the same seed: each rank holds its part of one draw (parallel/initialize.py).

The references are the models' own initialisation on one process, never lightning_par's: the reference model's
``initialize()``, transformers' ``init_weights()``, and for modules that parallelise themselves in
``configure_model`` Lightning's own materialisation (``_materialize_distributed_module``: ``reset_parameters()`` of each
module in order). Before sharded initialisation drew each rank's part itself, the halves of every ZeRO-3 or tensor-
parallel weight matrix started equal; those cases fail against these references (max difference about 0.1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_distributed
from torch import nn

SEED = 7
LLAMA = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, max_steps=1)
HF_LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)


def _llama(moe: bool = False) -> Any:
    from lightning_par.models import LlamaLM

    return LlamaLM(**LLAMA, **(dict(moe_experts=4, moe_top_k=2) if moe else {}))


def _hf() -> Any:
    from lightning_par.models import HFCausalLM

    return HFCausalLM(config=HF_LLAMA)


def _self_parallelized() -> Any:
    from clients import CallsItsModel
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class SplitsItself(CallsItsModel):
        """Lightning's tensor-parallel example in small: ``configure_model`` splits the blocks on the tensor-parallel
        mesh and shards them on the data-parallel one."""

        def configure_model(self) -> None:
            tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            for block in self.model.layers:
                parallelize_module(block, tp, {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                                               "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                                               "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
                block.attn.heads //= tp.size()
                fully_shard(block, mesh=dp)
            fully_shard(self.model, mesh=dp)

    return SplitsItself()


def _hybrid() -> Any:
    """Convolution and attention layers interleaved, one block shared by several layers (tests/zoo.py)."""
    import zoo

    return zoo.HybridLM()


MAKERS = {"llama": _llama, "llama_moe": lambda: _llama(moe=True), "hf_llama": _hf,
          "splits_itself": _self_parallelized, "hybrid": _hybrid}


def _reference(model: str) -> dict[str, torch.Tensor]:
    """The model's own initialisation on one process, seeded as the layouts' ranks are."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    torch.manual_seed(SEED)
    with torch.device("meta"):
        module = MAKERS[model]() if model != "splits_itself" else _splits_itself_whole()
        if model == "hf_llama":
            module.configure_model()
    if model in ("splits_itself", "hybrid"):
        _materialize_distributed_module(module, torch.device("cpu"))  # to_empty, then reset_parameters() in order
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    module.to_empty(device="cpu")  # allocates a tied weight's names apart: the models tie them again
    if model == "hf_llama":
        module.model.tie_weights()  # as built off the meta device: the head's init draws into the embedding's tensor
        module.model.init_weights()
    else:
        module.model.initialize()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _splits_itself_whole() -> Any:
    from clients import CallsItsModel

    return CallsItsModel()  # the same modules in the same order, not split


def _strategy(layout: str) -> Any:
    from lightning_par import (ExpertParallelStrategy, Hybrid3DStrategy, PipelineParallelStrategy,
                               TensorParallelStrategy, ZeroStrategy)

    return {"zero3": lambda: ZeroStrategy(zero_stage=3),
            "tp2": lambda: TensorParallelStrategy(tensor_parallel_size=2),
            "pp2": lambda: PipelineParallelStrategy(microbatches=2),
            "ep2": lambda: ExpertParallelStrategy(expert_parallel_size=2),
            "tp2 x zero3": lambda: Hybrid3DStrategy(tensor_parallel_size=2, zero_stage=3),
            "pp2 x tp2": lambda: Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2),
            "tp2 x dp2": lambda: TensorParallelStrategy(tensor_parallel_size=2),
            }[layout]()


def _initialised(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    import lightning as L

    from lightning_par.data import TokenDataModule

    results: dict[tuple[str, str], Any] = {}
    for model, layout in cases:
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=_strategy(layout), max_steps=0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0)
        torch.manual_seed(SEED)
        with trainer.init_module(empty_init=True):
            module = MAKERS[model]()
        data = TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=4, num_samples=64,
                               num_val_samples=8)
        if model == "splits_itself":
            from clients import client_data

            data = client_data("calls_its_model", 4)
        module.load_pretrained = lambda: None  # HFCausalLM from a config: nothing to read
        trainer.fit(module, data)
        state = trainer.strategy.consolidated_state_dict()
        results[(model, layout)] = state if trainer.global_rank == 0 else None
    return results


TWO_RANKS = [("llama", "zero3"), ("llama", "tp2"), ("llama", "pp2"), ("llama_moe", "ep2"), ("hf_llama", "zero3"),
             ("hf_llama", "tp2"), ("splits_itself", "tp2"), ("hybrid", "zero3"), ("hybrid", "pp2")]
FOUR_RANKS = [("llama", "tp2 x zero3"), ("llama", "pp2 x tp2"), ("splits_itself", "tp2 x dp2")]


@pytest.fixture(scope="module")
def initialised() -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    results = run_distributed(_initialised, 2, TWO_RANKS, timeout=540)[0]
    results.update(run_distributed(_initialised, 4, FOUR_RANKS, timeout=540)[0])
    return results


@pytest.mark.parametrize(("model", "layout"), TWO_RANKS + FOUR_RANKS)
def test_meta_device_initialisation_equals_one_process(initialised: dict, model: str, layout: str) -> None:
    state, expected = initialised[(model, layout)], _reference(model)
    assert state.keys() == expected.keys(), sorted(state.keys() ^ expected.keys())
    for name, value in expected.items():
        assert torch.equal(state[name].to(value.dtype), value), (name, float((state[name] - value).abs().max()))


def _uncovered(rank: int, world_size: int) -> str:
    import lightning as L
    from clients import CallsItsModel, client_data

    class WithABareParameter(CallsItsModel):
        def __init__(self) -> None:
            super().__init__()
            self.model.scale = nn.Parameter(torch.ones(32))  # on a module without reset_parameters()

    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="zero3", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    with trainer.init_module(empty_init=True):
        module = WithABareParameter()
    try:
        trainer.fit(module, client_data("calls_its_model", 4))
    except ValueError as error:
        return str(error)
    return "trained"


def test_a_tensor_no_initialiser_covers_is_refused_naming_its_module() -> None:
    messages = set(run_distributed(_uncovered, 2))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "nothing initialises model (Decoder: scale)" in message and "reset_parameters()" in message, message


def test_the_reference_model_is_initialised_one_part_at_a_time() -> None:
    """Each part initialises its own tensors (rotary tables, embedding, each block, norm, head), so initialising a
    meta-device model never holds more of it whole than its largest part."""
    from lightning_par.parallel.initialize import initializers

    with torch.device("meta"):
        module = _llama()
    block = sum(p.numel() for p in module.model.layers["0"].parameters())
    embedding = module.model.embed_tokens.weight.numel()
    sizes = {initializer.name: sum(t.numel() for _, m in initializer.modules for t in
                                   (*m.parameters(recurse=False), *m.buffers(recurse=False)))
             for initializer in initializers(module)}
    assert max(sizes.values()) == max(block, embedding), sizes
    assert list(sizes) == ["Transformer.reset_parameters()", "TokenEmbedding.init_weights()",
                           "TransformerBlock.init_weights()", "RMSNorm.reset_parameters()", "OutputHead.init_weights()"]


def _unwritten_buffer(rank: int, world_size: int) -> str:
    import lightning as L
    from clients import CallsItsModel, client_data

    class ScaledDecoder(CallsItsModel):
        def __init__(self) -> None:
            super().__init__()
            norm = self.model.norm
            # Computed in __init__ only: its reset_parameters() resets the weights, not this table.
            norm.register_buffer("scale", torch.full((32,), 0.5), persistent=False)

    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="zero3", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    with trainer.init_module(empty_init=True):
        module = ScaledDecoder()
    try:
        trainer.fit(module, client_data("calls_its_model", 4))
    except ValueError as error:
        return str(error)
    return "trained"


def test_a_computed_buffer_its_initialiser_leaves_unset_is_refused() -> None:
    messages = set(run_distributed(_unwritten_buffer, 2))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "LayerNorm.reset_parameters() leaves 'model.norm.scale' unset" in message, message
