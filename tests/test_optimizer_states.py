"""AdamW's moments in bf16 or quantised (lightning_par.optim.low_precision, torchao): bytes of model states per
parameter, and the same training in a layout as in one process."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_par.optim import AdamWBF16States, state_bytes

STEPS = 20
MODEL = dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=16, warmup_steps=1,
             max_steps=STEPS, learning_rate=1e-2)


def _optimizer_after_a_step(name: str) -> tuple[torch.optim.Optimizer, int]:
    from lightning_par.models import LlamaLM

    torch.manual_seed(0)
    module = LlamaLM(**MODEL, optimizer=name)
    optimizer = module.configure_optimizers()["optimizer"]
    module._shared_step(torch.randint(0, 256, (2, 17))).backward()
    optimizer.step()
    return optimizer, sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(("name", "bits", "block"), [("adamw", 32, None), ("adamw_bf16", 16, None),
                                                    ("adamw_8bit", 8, 256), ("adamw_4bit", 4, 128)])
def test_model_states_per_parameter(name: str, bits: int, block: int | None) -> None:
    """fp32 weights and gradients (8 bytes a parameter) and the two moments, measured on the optimizer's state: AdamW's
    fp32 and bf16 moments; torchao's quantised ones with a fp32 scale a block and a code book of 2^bits fp32 values a
    tensor, tensors under 4,096 values (the gains) kept in fp32 as bitsandbytes does. 16, 12, 10.1 and 9.1 bytes a
    parameter of model states here; 16, 12, about 10 and 9 for a model of large matrices."""
    optimizer, parameters = _optimizer_after_a_step(name)
    expected = 0.0
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        if block is None:
            expected += 2 * bits / 8 * p.numel()
        elif p.numel() >= 4096 and p.numel() % block == 0:
            expected += 2 * (bits / 8 * p.numel() + 4 * p.numel() / block + 4 * 2 ** bits)
        else:
            expected += 8 * p.numel()
    print(f"{name}: {8 + state_bytes(optimizer) / parameters:.3f} bytes of model states a parameter")
    assert state_bytes(optimizer) == expected
    # The planner counts every tensor at the quantised rate (no code books, no small tensors left in fp32).
    from lightning_par.layout.config import ParallelConfig
    from lightning_par.planner import ModelSpec, estimate_memory

    planned = estimate_memory(ModelSpec(vocab_size=256, hidden=128, layers=2, heads=4, kv_heads=4, ffn_hidden=352),
                              ParallelConfig(dp_shard=1), seq_len=16, microbatch_size=2, precision="32-true",
                              optimizer=name).optimizer_states
    assert planned == pytest.approx(expected, rel=1e-3 if block is None else 0.06)


def test_bf16_moments_step_as_fp32_moments_rounded() -> None:
    """A step of AdamWBF16States is torch's AdamW from the bf16 moments read as fp32, its moments rounded to bf16."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    weight.grad = torch.randn(8, 8)
    reference = torch.nn.Parameter(weight.detach().clone())
    reference.grad = weight.grad.clone()
    ours, torchs = AdamWBF16States([weight], lr=0.1), torch.optim.AdamW([reference], lr=0.1, foreach=False)
    for _ in range(3):
        ours.step()
        torchs.step()
        for name in ("exp_avg", "exp_avg_sq"):  # torch's moments, rounded to bf16 each step, are ours
            torchs.state[reference][name].copy_(torchs.state[reference][name].bfloat16())
            assert torch.equal(ours.state[weight][name].float(), torchs.state[reference][name])
        assert torch.equal(weight, reference)


LAYOUTS = {
    "zero3": (2, dict(data_parallel_size=2, zero_stage=3)),
    "dp2xtp2xpp2-sp": (8, dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2,
                               sequence_parallel=True, microbatches=2)),
    "zero1": (2, dict(data_parallel_size=2, zero_stage=1)),
}


@pytest.mark.parametrize(("layout", "optimizer"), [("zero3", "adamw_bf16"), ("dp2xtp2xpp2-sp", "adamw_bf16"),
                                                   ("zero3", "adamw_8bit"), ("zero1", "adamw_4bit")])
def test_low_precision_moments_train_in_a_layout_as_in_one_process(layout: str, optimizer: str) -> None:
    """20 steps against one process with the same optimizer. Under ZeRO-1/3 the one process sums each global batch's
    gradient from the ranks' pieces, as the ranks do (two addends: in either order), so every moment rounds to the
    same bf16 value, and torchao quantises the same blocks (a ZeRO-3 shard is whole rows, a multiple of 256 values;
    ZeRO-1 steps whole tensors): bit for bit. Under tensor parallel the matmuls' partial sums differ in their last
    bits, and a moment at a bf16 boundary then rounds to the other side (lightning_par.optim.low_precision)."""
    from parity import assert_parity, layout_run, reference_run
    from test_data_parallel import make_datamodule
    from test_hybrid3d import make_strategy

    from lightning_par.models import LlamaLM

    world_size, strategy = LAYOUTS[layout]
    make_module = functools.partial(LlamaLM, **MODEL, optimizer=optimizer)
    expected = reference_run(make_module, make_datamodule, dp=strategy["data_parallel_size"], steps=STEPS,
                             pieces_like_ranks=True, pipeline_microbatches=strategy.get("microbatches", 1))
    actual = layout_run(make_module, make_datamodule, functools.partial(make_strategy, **strategy),
                        world_size=world_size, steps=STEPS)
    if "tensor_parallel_size" not in strategy:
        loss_error, weight_error = assert_parity(actual, expected, rtol=0.0, weight_atol=0.0)
    else:  # a flipped moment moves its weight by a part of one step: 1% of the farthest Adam moves a weight in 20
        loss_error, weight_error = assert_parity(actual, expected, rtol=5e-4,
                                                 weight_atol=0.01 * MODEL["learning_rate"] * STEPS)
    print(f"{optimizer} {layout}: loss rel err {loss_error:.1e}, weights {weight_error:.1e} (absolute under tp)")


def test_quantised_moments_under_tensor_parallel_are_refused_on_every_rank() -> None:
    """A row-parallel shard's blocks of 256 values group other values than the whole matrix's: torchao's quantised
    moments would train something else than one process, so the set-up refuses them, on every rank."""
    from parity import assert_fails_on_every_rank
    from test_data_parallel import make_datamodule
    from test_hybrid3d import make_strategy

    from lightning_par.models import LlamaLM

    assert_fails_on_every_rank(functools.partial(LlamaLM, **MODEL, optimizer="adamw_8bit"), make_datamodule,
                               functools.partial(make_strategy, tensor_parallel_size=2), world_size=2,
                               message="AdamW8bit quantises each rank's shard of a state in blocks of values")
