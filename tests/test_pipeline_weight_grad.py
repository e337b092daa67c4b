"""Deferred weight gradients (lightning_par/parallel/pipeline/weight_grad.py), in one process: the linear layers' weight
gradients wait for the W action and then equal autograd's; outside a schedule's backward nothing is deferred.
Parity of whole ZB-V and DualPipeV runs, which defer by default, is in tests/test_pipeline_parallel.py."""

from __future__ import annotations

import copy
import importlib.util
import types
from pathlib import Path

import pytest
import torch

from lightning_par.models.llama import LlamaConfig, Transformer
from lightning_par.parallel.pipeline.weight_grad import DeferredLinear, DeferredWeightGradients

REPO = Path(__file__).resolve().parents[1]


def _blocks() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=8)
    network = Transformer(config)
    cos, sin = network.rope(8)

    class Blocks(torch.nn.Module):  # the blocks and a biased head, as a stage would run them
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(network.layers.values())
            self.head = torch.nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.head(x)

    return Blocks(), torch.randn(2, 8, 32), torch.randn(2, 8, 32)


def _stage(module: torch.nn.Module, run_backward) -> types.SimpleNamespace:
    """What DeferredWeightGradients uses of a PipelineStage."""
    return types.SimpleNamespace(submod=module, stage_index=0, backward_one_chunk=run_backward, dw_builder=None)


def _reference_grads(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool = False) -> dict:
    reference = copy.deepcopy(module)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        reference(x).backward(grad)
    return {name: p.grad for name, p in reference.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_linear_weight_gradients_wait_for_w_and_then_equal_autograds(autocast: bool) -> None:
    module, x, grad = _blocks()
    expected = _reference_grads(module, x, grad, autocast)
    output = {}
    stage = _stage(module, lambda: output["y"].backward(grad))
    deferred = DeferredWeightGradients([stage])
    assert deferred.layers == 2 * 7 + 1 and deferred.stages == [0]
    assert stage.dw_builder == deferred.builder and isinstance(module.head, DeferredLinear)

    deferred.stepping = True
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output["y"] = module(x)
    stage.backward_one_chunk()  # the I action: everything but the linear layers' weight gradients
    linear = {name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, p in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        assert (p.grad is None) == (owner in linear and leaf == "weight"), name
    stage.dw_builder()()  # the W action
    deferred.stepping = False
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_nothing_is_deferred_outside_a_schedules_backward() -> None:
    """A backward outside the stage's backward actions (PyTorch's shape inference runs autograd.grad for the
    inputs on a schedule's first step) gets weight gradients at once, and the W of the next micro-batch finds only
    its own; a weight with gradient hooks (ZeRO-2's reduction) gets its gradient through autograd, hooks run."""
    module, x, grad = _blocks()
    expected = _reference_grads(module, x, grad)
    output = {}
    stage = _stage(module, lambda: output["y"].backward(grad))
    deferred = DeferredWeightGradients([stage])
    deferred.stepping = True
    inputs = x.clone().requires_grad_()
    torch.autograd.grad(module(inputs).sum(), inputs)  # shape inference: input gradients only
    assert all(p.grad is None for p in module.parameters())
    fired = []
    module.head.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    output["y"] = module(x)
    stage.backward_one_chunk()
    assert len(fired) == 1 and module.head.weight.grad is not None
    stage.dw_builder()()
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)

    deferred.stepping = False  # evaluation and anything outside a step: plain linear layers
    for p in module.parameters():
        p.grad = None
    module(x).backward(grad)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_compiled_stage_runs_its_whole_backward_at_once() -> None:
    """A stage with compiled blocks defers nothing (compiled code would trace the store) and runs its whole backward
    at the input-gradient action: its weight-gradient action has nothing left (PyTorch's split would rerun the
    compiled backward node; the pair layouts E2 and E4 of tests/test_compositions.py train such stages exactly)."""
    module, _, _ = _blocks()
    module.layers[0].compile()
    stage = _stage(module, lambda: None)
    deferred = DeferredWeightGradients([stage])
    assert deferred.layers == 0 and deferred.stages == [] and stage.dw_builder is not None
    assert stage.dw_builder()() is None


def test_benchmark_workers_parse_their_command_line() -> None:
    """benchmarks/pipeline_schedules.py starts one worker per (pp, schedule): its own parser takes the command."""
    spec = importlib.util.spec_from_file_location("pipeline_schedules", REPO / "benchmarks" / "pipeline_schedules.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    parser = script.build_parser()
    args = parser.parse_args(["--pp", "2", "--steps", "6", "--profile"])
    for schedule in (*script.BENCHMARKED, *script.VARIANTS):
        worker = parser.parse_args(script.worker_command(2, schedule, "out", script.shared_arguments(args))[2:])
        assert (worker.worker_pp, worker.worker_schedule, worker.steps, worker.profile) == (2, schedule, 6, True)
