"""compile=True: every block compiled in place after sharding. Parity with the uncompiled single
process, and checkpoint names that do not change."""

from __future__ import annotations

import functools

import pytest
import torch
from parity import assert_layout_matches
from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule

# inductor's fused C++ kernels add in another order than eager ATen: a few ulps per step, well inside this.
COMPILE_RTOL = 1e-5


def test_compiled_blocks_keep_their_names_and_compute_alike() -> None:
    from lightning_par.parallel.compile import apply_compile
    from lightning_par.parallel.model_map import derive_model_map

    torch.manual_seed(0)
    eager = SGDLlamaLM(**MODEL)
    compiled = SGDLlamaLM(**MODEL)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled, derive_model_map(compiled))
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no `_orig_mod.`: checkpoints interchange
    tokens = torch.randint(0, MODEL["vocab_size"], (2, 16))
    torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="compile=True compiles each transformer block, and no model map"):
        apply_compile(torch.nn.Linear(2, 2), None)


def _strategy(name: str):
    from lightning_par import DataParallelStrategy, Hybrid3DStrategy

    if name == "data_parallel":
        return DataParallelStrategy(compile=True)
    if name == "pp2xtp2":
        return Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2, compile=True)
    if name == "pp2xtp2-sp":
        return Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                                microbatches=2, compile=True)
    if name == "ep2xdp2":
        return Hybrid3DStrategy(expert_parallel_size=2, compile=True)
    return Hybrid3DStrategy(data_parallel_size=2, zero_stage=3, activation_checkpointing="full", compile=True)


# The MoE model is test_experts.py's: routed layers whose experts expert parallel turns into DTensors.
_MODULES = {"dense": SGDLlamaLM, "moe": functools.partial(SGDLlamaLM, **{**MODEL, "moe_experts": 4, "moe_top_k": 2})}


@pytest.mark.parametrize(("name", "world_size", "dp", "model"),
                         [("data_parallel", 2, 2, "dense"), ("zero3-full-recompute", 2, 2, "dense")])
def test_compiled_layout_matches_the_eager_single_process(name: str, world_size: int, dp: int, model: str) -> None:
    """DDP over compiled blocks; FSDP2 units around compiled, checkpointed blocks. Compiled blocks with every other
    technique (tensor parallel with SP inside pipeline stages, where a stage's received slices meet the blocks'
    DTensors on the same tp mesh object, which inductor needs; MoE blocks under expert parallel, whose routed part
    runs eagerly, so the expert DTensors can still be moved when Lightning tears the run down): the pair layouts
    E1-E4 and F4 of docs/composition_matrix.py, tests/test_compositions.py."""
    assert_layout_matches(_MODULES[model], make_datamodule, functools.partial(_strategy, name), world_size=world_size,
                          dp=dp, steps=STEPS, rtol=COMPILE_RTOL, label=f"compile {name}")
