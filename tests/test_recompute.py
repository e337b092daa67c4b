"""Activation checkpointing: same gradients, fewer saved activations (full < op < selective < none), and the same
training in every layout."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_par.models import LlamaConfig, Transformer
from lightning_par.parallel.model_map import derive_model_map
from lightning_par.parallel.recompute import apply_activation_checkpointing

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16)


def _model(mode: str, every: int = 1) -> nn.Module:
    torch.manual_seed(0)
    root = nn.Module()
    root.model = Transformer(CONFIG)
    return apply_activation_checkpointing(root, derive_model_map(root), mode=mode, every=every)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def _measure(mode: str, every: int = 1) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(bytes autograd keeps from forward, matmuls run in backward, gradients)."""
    root = _model(mode, every)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = root.model(tokens).float().logsumexp(-1).mean()
    with _CountMatmuls() as backward_matmuls:
        loss.backward()
    grads = {name.replace(_CHECKPOINT_PREFIX, ""): p.grad.clone() for name, p in root.named_parameters()}
    return sum(saved.values()), backward_matmuls.calls, grads


def test_recomputation_keeps_gradients_and_trades_memory_for_compute() -> None:
    none_bytes, none_mm, reference = _measure("none")
    full_bytes, full_mm, full = _measure("full")
    half_bytes, half_mm, half = _measure("full", every=2)
    _, selective_mm, selective = _measure("selective")
    _, op_mm, op = _measure("op")
    print(f"saved activation bytes: none {none_bytes}, full {full_bytes}, full every 2nd block {half_bytes}; "
          f"backward matmuls: none {none_mm}, selective {selective_mm}, op {op_mm}, full {full_mm}")
    assert full_bytes < half_bytes < none_bytes
    # Full recomputation re-runs a block's projections in backward: 6 of its 7, because backward never
    # needs down_proj's output and PyTorch stops recomputing once it has what it needs. Selective keeps
    # the matmul outputs (only element-wise work is recomputed): exactly the matmuls of no recomputation.
    assert full_mm == none_mm + 6 * CONFIG.n_layers
    assert half_mm == none_mm + 6 * CONFIG.n_layers // 2
    assert selective_mm == none_mm
    # Per-op keeps the 1st, 3rd, 5th and 7th matmul outputs (q, v, gate, down): k, o_proj and up are recomputed.
    assert op_mm == none_mm + 3 * CONFIG.n_layers
    for grads in (selective, op, full, half):
        assert grads.keys() == reference.keys()
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)  # the same kernels on the same inputs


def test_wrapping_keeps_parameter_names() -> None:
    assert _model("full").state_dict().keys() == _model("none").state_dict().keys()


def test_every_other_block() -> None:
    wrapped = [name for name, m in _model("selective", every=2).model.layers.named_children()
               if type(m).__name__ == "CheckpointWrapper"]
    assert wrapped == ["0", "2"]


@pytest.mark.parametrize(("mode", "every", "message"), [
    ("some", 1, "activation_checkpointing='some' is not one of"),
    ("full", 0, "activation_checkpointing_every must be a positive integer, got 0"),
])
def test_bad_arguments(mode: str, every: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _model(mode, every)


def test_no_model_map_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs to know where the transformer blocks are"):
        apply_activation_checkpointing(nn.Linear(2, 2), None, mode="full")


STEPS = 20


@pytest.mark.parametrize(("world_size", "layout", "model"), [
    (8, dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True,
             microbatches=2), "dense"),
    (2, dict(data_parallel_size=2, zero_stage=3), "moe"),
], ids=["dp2xtp2xpp2-sp", "zero3-moe"])
def test_per_op_recomputation_trains_bit_for_bit_like_none(world_size: int, layout: dict, model: str) -> None:
    """``op`` in a layout: 20 steps, the losses and weights bit for bit those of the same layout without recomputation
    (recomputed tensors come from the same kernels on the same inputs, collectives included), and both within the
    parity tolerance of one process."""
    from parity import assert_parity, layout_runs, reference_run
    from test_data_parallel import MODEL, SGDLlamaLM, make_datamodule
    from test_hybrid3d import PARITY_RTOL, make_strategy

    extra = {"moe_experts": 4, "moe_top_k": 2} if model == "moe" else {"n_layers": 4, "n_kv_heads": 4}
    make_module = functools.partial(SGDLlamaLM, **{**MODEL, **extra, "max_steps": STEPS})
    runs = {mode: (make_module, make_datamodule, functools.partial(make_strategy, **layout,
                                                                    activation_checkpointing=mode))
            for mode in ("none", "op")}
    actual = layout_runs(runs, world_size=world_size, steps=STEPS)
    assert actual["op"].losses == actual["none"].losses
    for name, tensor in actual["none"].state_dict.items():
        assert torch.equal(actual["op"].state_dict[name], tensor), name
    expected = reference_run(make_module, make_datamodule, dp=layout["data_parallel_size"], steps=STEPS)
    loss_error, weight_error = assert_parity(actual["op"], expected, rtol=PARITY_RTOL)
    print(f"op recomputation {layout}: bitwise with none; against one process loss {loss_error:.1e}, "
          f"weights {weight_error:.1e}")
