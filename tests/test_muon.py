"""Muon with AdamW (lightning_par.optim.muon): torch's own Muon and AdamW step for step in one process, and the same
training in every layout as in one process."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_par.optim import MuonWithAdamW, muon_parameter_groups

STEPS = 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 16))


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int = 5) -> list[torch.Tensor]:
    tokens = torch.randint(0, 16, (steps, 4, 6), generator=torch.Generator().manual_seed(1))
    for batch in tokens:
        loss = nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_each_kind_of_group_steps_as_torchs_own_optimizer() -> None:
    """The Muon groups as ``torch.optim.Muon`` with the same settings, the AdamW groups as ``torch.optim.AdamW``: bit
    for bit over 5 steps."""
    ours = _model()
    matrices = [ours[1].weight, ours[3].weight]
    others = [p for p in ours.parameters() if all(p is not m for m in matrices)]
    expected_model = _model()
    by_torch = [torch.optim.Muon([expected_model[1].weight, expected_model[3].weight], lr=0.01, weight_decay=0.1,
                                 adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW([{"params": [expected_model[0].weight], "weight_decay": 0.1},
                                   {"params": [expected_model[1].bias, expected_model[2].weight, expected_model[2].bias,
                                               expected_model[3].bias], "weight_decay": 0.0}],
                                  lr=0.01, betas=(0.9, 0.95), foreach=False)]
    mine = MuonWithAdamW(muon_parameter_groups(matrices, others, weight_decay=0.1), lr=0.01)
    for got, expected in zip(_train(ours, [mine]), _train(expected_model, by_torch)):
        assert torch.equal(got, expected)
    assert {len(mine.state[p]) for p in matrices} == {1}  # Muon keeps one momentum buffer a matrix: 4 bytes


def test_a_stack_of_expert_matrices_is_orthogonalized_matrix_by_matrix() -> None:
    stack = nn.Parameter(torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0)))
    apart = [nn.Parameter(matrix.detach().clone()) for matrix in stack]
    stack.grad = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1))
    for matrix, grad in zip(apart, stack.grad):
        matrix.grad = grad.clone()
    MuonWithAdamW([{"params": [stack], "use_muon": True}], lr=0.01).step()
    MuonWithAdamW([{"params": apart, "use_muon": True}], lr=0.01).step()
    assert torch.equal(stack.detach(), torch.stack([matrix.detach() for matrix in apart]))


def test_muon_refuses_a_vector_and_a_bad_setting() -> None:
    with pytest.raises(ValueError, match=r"a parameter of shape \(4,\) belongs in a group with use_muon=False"):
        MuonWithAdamW([{"params": [nn.Parameter(torch.zeros(4))], "use_muon": True}])
    with pytest.raises(ValueError, match="momentum=1.5 must be in"):
        MuonWithAdamW([nn.Parameter(torch.zeros(4, 4))], momentum=1.5)
    from lightning_par.models import LlamaLM

    with pytest.raises(ValueError, match=r"optimizer='lion' is not one of \('adamw', 'adamw_bf16', 'adamw_8bit', "
                                         r"'adamw_4bit', 'muon'\)"):
        LlamaLM(optimizer="lion")


MUON_MODEL = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=4, max_seq_len=16, warmup_steps=1,
                  max_steps=STEPS, optimizer="muon", muon_ns_dtype="fp32", learning_rate=1e-2)
LAYOUTS = {
    "zero3": (2, dict(data_parallel_size=2, zero_stage=3), {}),
    "zero1": (2, dict(data_parallel_size=2, zero_stage=1), {}),
    "dp2xtp2xpp2-sp": (8, dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2,
                               sequence_parallel=True, microbatches=2), {}),
    "dp2xep2-zero2-moe": (2, dict(data_parallel_size=2, expert_parallel_size=2, zero_stage=2),
                          {"moe_experts": 4, "moe_top_k": 2, "n_layers": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_trains_in_every_layout_as_in_one_process(layout: str) -> None:
    """20 steps of ``optimizer: muon`` against one process: ZeRO-3 and tensor parallel gather each matrix's update,
    ZeRO-1/2 step whole matrices on their owners, expert parallel orthogonalises its own experts."""
    from parity import assert_parity, layout_run, reference_run
    from test_data_parallel import make_datamodule
    from test_hybrid3d import make_strategy

    from lightning_par.models import LlamaLM

    world_size, strategy, extra = LAYOUTS[layout]
    make_module = functools.partial(LlamaLM, **{**MUON_MODEL, **extra})
    expected = reference_run(make_module, make_datamodule, dp=strategy["data_parallel_size"], steps=STEPS)
    actual = layout_run(make_module, make_datamodule, functools.partial(make_strategy, **strategy),
                        world_size=world_size, steps=STEPS)
    loss_error, weight_error = assert_parity(actual, expected, rtol=1e-5)
    print(f"muon {layout}: loss rel err {loss_error:.1e}, weights {weight_error:.1e}")


def test_the_dry_run_and_the_planner_count_muons_states_and_gathers(tmp_path) -> None:
    """configs/zero3.yaml on 2 ranks with AdamW and with Muon: Muon's optimizer states are what the planner says (one
    fp32 buffer per block-matrix parameter, AdamW's two for the rest); its step all-gathers each of the 28 block
    matrices (7 a block) once, the whole matrix's bytes, of which the planner counts the (d - 1)/d a ring moves."""
    from test_dry_run import zero3_dry_runs

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.planner import ClusterSpec, ModelSpec, estimate_step_time

    reports = zero3_dry_runs(tmp_path, "model.init_args.optimizer", ("adamw", "muon"))
    adamw, muon = reports["adamw"], reports["muon"]
    model = ModelSpec(vocab_size=256, hidden=128, layers=4, heads=4, kv_heads=2, ffn_hidden=352)
    matrices = model.layers * (model.attention_params + model.mlp_params)
    for report in (adamw, muon):
        assert report["states"]["optimizer_states"] == pytest.approx(report["planned"]["optimizer_states"], rel=1e-3)
    assert adamw["states"]["optimizer_states"] - muon["states"]["optimizer_states"] == pytest.approx(
        4 * matrices / 2, rel=1e-3)
    gathers = {key: muon["collectives"]["dp"][key] - adamw["collectives"]["dp"][key] for key in ("calls", "bytes")}
    assert gathers == {"calls": 7 * model.layers, "bytes": 4 * matrices}
    planned = estimate_step_time(model, ParallelConfig(dp_shard=2, zero_stage=3), ClusterSpec.from_preset("cpu"),
                                 seq_len=128, microbatch_size=4, microbatches=1, optimizer="muon")
    assert planned.comm_bytes["muon"] == pytest.approx(4 * matrices / 2)


def _hugging_face_model(optimizer: str, directory: str):
    """The tiny Llama with a tied head of ``directory`` (transformers' code, ``save_pretrained``'s files) with
    ``optimizer``, fp32 Newton-Schulz."""
    from lightning_par.models import HFCausalLM

    return HFCausalLM(pretrained=directory, learning_rate=1e-2, warmup_steps=1, max_steps=STEPS, optimizer=optimizer,
                      muon_ns_dtype="fp32")


@pytest.mark.parametrize(("world_size", "strategy"), [(2, dict(data_parallel_size=2, zero_stage=3)),
                                                      (4, dict(data_parallel_size=1, tensor_parallel_size=2,
                                                               pipeline_parallel_size=2, microbatches=2))],
                         ids=["zero3", "tp2xpp2"])
def test_muon_and_bf16_moments_train_a_hugging_face_model_as_in_one_process(world_size: int, strategy: dict,
                                                                            tmp_path) -> None:
    """Beyond the reference model: a Hugging Face Llama whose head is tied to its embedding, 20 steps against one
    process. Muon finds its matrices through the model map (``model.model.layers``; the tied embedding stays with
    AdamW): under ZeRO-3 and under tensor x pipeline parallel; bf16 AdamW moments under ZeRO-3 against a one-process
    run with bf16 moments."""
    from hf_directories import make_model_directory
    from parity import assert_parity, layout_runs, reference_run
    from test_data_parallel import make_datamodule
    from test_hybrid3d import make_strategy

    directory = str(make_model_directory(tmp_path / "llama-tied", "llama-tied", tokenizer=False))
    optimizers = ["muon", "adamw_bf16"] if strategy.get("zero_stage") == 3 else ["muon"]
    runs = {name: (functools.partial(_hugging_face_model, name, directory), make_datamodule,
                   functools.partial(make_strategy, **strategy)) for name in optimizers}
    actual = layout_runs(runs, world_size=world_size, steps=STEPS)
    for name in optimizers:
        # bf16 moments round a last-bit difference of a gradient to another bf16 value: the one process adds each
        # batch's gradient in the ranks' pieces and order (parity.reference_run), as the optimizer-state tests do.
        expected = reference_run(functools.partial(_hugging_face_model, name, directory), make_datamodule,
                                 dp=strategy["data_parallel_size"], steps=STEPS, pieces_like_ranks=name != "muon")
        loss_error, weight_error = assert_parity(actual[name], expected, rtol=1e-5)
        print(f"{name} llama-tied {'x'.join(map(str, strategy.values()))}: loss rel err {loss_error:.1e}, "
              f"weights {weight_error:.1e}")
