"""The mixture-of-experts layer: routing, capacity, auxiliary losses (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_par.parallel.mesh import build_mesh
from lightning_par.models.moe import MoEFeedForward


def _layer(**kwargs) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(dim=8, hidden_size=16, **{"n_experts": 4, "top_k": 2, **kwargs})
    layer.init_weights(0.5, 0.5)
    return layer


def _one_expert(layer: MoEFeedForward, tokens: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert ``expert`` of ``layer`` alone on ``tokens``: every token counted for it, none for the others."""
    counts = [tokens.shape[0] if e == expert else 0 for e in range(layer.n_experts)]
    return layer.experts(tokens, counts)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-gemm", "loop"])
def test_grouped_matmul_is_a_matmul_per_group(monkeypatch: pytest.MonkeyPatch, grouped: bool) -> None:
    """One grouped GEMM (``torch._grouped_mm``) or the per-group loop: each group's rows times its own matrix,
    forward and backward, empty groups included (widths of 16-byte multiples, as its kernels need; others always
    take the loop)."""
    from lightning_par.models import moe

    monkeypatch.setattr(moe, "GROUPED_MM", grouped)
    torch.manual_seed(0)
    counts = [3, 0, 5, 2]
    tokens = torch.randn(sum(counts), 8, requires_grad=True)
    weights = torch.randn(4, 8, 12, requires_grad=True)
    out = moe.grouped_matmul(tokens, weights, counts)
    bounds = [0, 3, 3, 8, 10]
    expected = torch.cat([tokens[a:b] @ weights[g] for g, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (tokens, weights), grad)
    torch.testing.assert_close(got, torch.autograd.grad(expected, (tokens, weights), grad))


def test_dropless_routing_is_the_weighted_sum_of_the_chosen_experts() -> None:
    layer = _layer()
    x = torch.randn(2, 5, 8)
    out = layer(x)
    probs = layer.router(x).float().softmax(-1)
    for b in range(2):
        for t in range(5):
            weights, chosen = probs[b, t].topk(2)
            weights = weights / weights.sum()
            expected = sum(w * _one_expert(layer, x[b, t][None], int(e))[0] for w, e in zip(weights, chosen))
            torch.testing.assert_close(out[b, t], expected, rtol=1e-5, atol=1e-6)
    assert float(layer.stats.dropped_fraction) == 0.0
    assert int(layer.stats.tokens_per_expert.sum()) == 2 * 5 * 2


def test_capacity_drops_in_priority_order_per_sequence() -> None:
    layer = _layer(top_k=1, capacity_factor=1.0)  # capacity ceil(1.0 * 8 * 1 / 4) = 2 per expert and sequence
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0  # every token with a positive first feature picks expert 0
    x = torch.randn(3, 8, 8)
    x[..., 0] = 1.0
    out = layer(x)
    # The first two tokens of each sequence fit; the other six are dropped (output 0: the residual carries them).
    assert torch.count_nonzero(out[:, :2].abs().sum(-1)) == 6
    assert torch.count_nonzero(out[:, 2:].abs().sum(-1)) == 0
    assert float(layer.stats.dropped_fraction) == pytest.approx(6 / 8)
    # Per sequence: the same drops whichever sequences share the batch (i.e. however the batch is sharded).
    alone = torch.cat([layer(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(alone, out)


def test_second_choices_wait_for_every_first_choice() -> None:
    """GShard's priority: token 1's first choice beats token 0's second choice for the same expert."""
    layer = _layer(top_k=2, capacity_factor=1.0)  # capacity ceil(1.0 * 2 * 2 / 4) = 1 per expert
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[1, 0] = 1.0  # expert 1 reads feature 0
        layer.router.weight[0, 1] = 1.0  # expert 0 reads feature 1
    x = torch.zeros(1, 2, 8)
    x[0, 0, :2] = torch.tensor([2.0, 1.0])  # token 0: expert 1 first, expert 0 second
    x[0, 1, :2] = torch.tensor([0.5, 2.0])  # token 1: expert 0 first, expert 1 second
    out = layer(x)
    assert float(layer.stats.dropped_fraction) == pytest.approx(2 / 4)
    assert out[0, 1].abs().sum() > 0  # served by expert 0 (in token order it would have found it full)


def test_auxiliary_losses() -> None:
    layer = _layer()
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform probabilities
    layer(torch.randn(2, 6, 8))
    assert layer.stats.aux_loss.item() == pytest.approx(1.0)  # Switch: 1 when P is uniform
    assert layer.stats.z_loss.item() == pytest.approx(math.log(4) ** 2)
    with torch.no_grad():
        layer.router.weight[0] = 100.0  # everything to expert 0 with probability ~1
    layer(torch.ones(2, 6, 8))
    assert layer.stats.aux_loss.item() == pytest.approx(4 * 0.5, rel=1e-3)  # f_0 = 1/2 (top-2), P_0 = 1
    layer.stats.aux_loss.backward()  # differentiable through the router probabilities
    assert layer.router.weight.grad is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_k=5), r"top_k=5 must be between 1 and the number of experts \(4\)"),
        (dict(n_experts=0), r"n_experts must be a positive integer, got 0"),
        (dict(capacity_factor=0.0), r"capacity_factor must be positive, or None for dropless routing"),
    ],
)
def test_bad_routing_is_a_clear_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoEFeedForward(dim=8, hidden_size=16, **{"n_experts": 4, "top_k": 2, **kwargs})


def test_reference_model_with_experts() -> None:
    from lightning_par.models import LlamaLM
    from lightning_par.parallel.model_map import derive_model_map

    torch.manual_seed(0)
    module = LlamaLM(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16, moe_experts=4, moe_top_k=2,
                     moe_layers=[1, 2])
    assert [type(layer.mlp).__name__ for layer in module.model.layers.values()] == \
        ["FeedForward", "MoEFeedForward", "MoEFeedForward"]
    assert derive_model_map(module).style_of("model.layers.1.mlp.experts") == "experts"
    inputs, targets = module.split_batch(torch.randint(0, 64, (2, 17)))
    logits = module(inputs)
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
    stats = module.model.routing_stats()
    assert set(stats) == {"1", "2"}
    expected = plain + sum(0.01 * s.aux_loss + 0.001 * s.z_loss for s in stats.values())
    torch.testing.assert_close(module.loss_fn(logits, targets), expected)
    # Active parameters per token: top_k of 4 experts and the router in 2 of 3 blocks.
    dense = LlamaLM(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16)
    mlp = 3 * 32 * dense.config.resolved_ffn_hidden_size
    assert module.flops_per_token() - dense.flops_per_token() == 6 * 2 * (mlp + 32 * 4)
    with pytest.raises(ValueError, match=r"moe_layers \[5\] are not blocks of a 3-layer model"):
        LlamaLM(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16, moe_experts=4, moe_layers=[5])


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_moe_model_under_data_parallel_matches_single_process(capacity_factor) -> None:
    """Capacity and the load-balancing loss are per sequence, so sharding the batch changes nothing."""
    import functools

    from parity import assert_layout_matches
    from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule

    from lightning_par import DataParallelStrategy

    make_module = functools.partial(SGDLlamaLM, **{**MODEL, "moe_experts": 4, "moe_top_k": 2,
                                                   "moe_capacity_factor": capacity_factor})
    assert_layout_matches(make_module, make_datamodule, DataParallelStrategy, world_size=2, dp=2, steps=STEPS,
                          rtol=1e-5, label=f"data_parallel MoE capacity={capacity_factor}")


def make_expert_strategy(**kwargs):
    from lightning_par import ExpertParallelStrategy

    return ExpertParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("world_size", "ep", "capacity_factor", "accumulate"),
    [(2, 2, None, 1), (4, 4, None, 1), (4, 2, 1.0, 2)],
    ids=["ep2-dropless", "ep4-dropless", "dp4-ep2-capacity-acc2"],
)
def test_expert_parallel_matches_single_process(world_size: int, ep: int, capacity_factor, accumulate: int) -> None:
    import functools

    from parity import assert_layout_matches
    from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule

    make_module = functools.partial(SGDLlamaLM, **{**MODEL, "moe_experts": 4, "moe_top_k": 2,
                                                   "moe_capacity_factor": capacity_factor})
    assert_layout_matches(make_module, make_datamodule,
                          functools.partial(make_expert_strategy, expert_parallel_size=ep),
                          world_size=world_size, dp=world_size, steps=STEPS, accumulate=accumulate, rtol=1e-5,
                          label=f"expert_parallel ep={ep} ws={world_size}")


def _all_to_all_bytes(rank: int, world_size: int) -> dict:
    """One forward and backward of an expert-parallel MoE layer with evenly spread routing."""
    import torch.distributed as dist

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.parallel.experts import apply_expert_parallel

    dist.init_process_group("gloo")
    mesh = build_mesh(ParallelConfig(ep=world_size), "cpu")
    E, C, tokens = 4, 8, 16
    torch.manual_seed(0)
    layer = MoEFeedForward(dim=C, hidden_size=16, n_experts=E, top_k=2)
    layer.init_weights(0.5, 0.5)
    with torch.no_grad():  # a token with feature e set picks expert e, then e + 1: every expert equally loaded
        layer.router.weight.zero_()
        for e in range(E):
            layer.router.weight[e, e], layer.router.weight[e, (e - 1) % E] = 2.0, 1.0
    apply_expert_parallel(layer, mesh, world_size)
    x = torch.zeros(1, tokens, C)
    x[0, torch.arange(tokens), (torch.arange(tokens) + rank) % E] = 1.0
    sent = []
    original = dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if input.is_floating_point():  # token activations (not the counts and expert ids exchanged first)
            splits = input_split_sizes or [input.shape[0] // world_size] * world_size
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            sent.append(sum(n for r, n in enumerate(splits) if r != dist.get_rank(group)) * row)
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = recording
    try:
        layer(x.requires_grad_()).sum().backward()
    finally:
        dist.all_to_all_single = original
    dist.destroy_process_group()
    return {"sent": sent, "tokens": tokens, "C": C}


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_per_moe_layer(ep: int) -> None:
    """Dispatch and combine, forward and backward, each move tokens x top_k x hidden x (ep-1)/ep
    activations off every rank when the experts are evenly loaded (GShard)."""
    from harness import run_distributed

    for result in run_distributed(_all_to_all_bytes, ep):
        expected = result["tokens"] * 2 * result["C"] * 4 * (ep - 1) // ep  # fp32 bytes
        assert result["sent"] == [expected] * 4  # dispatch, combine; their backwards


def test_experts_that_do_not_split_fail_on_every_rank() -> None:
    import functools

    from parity import assert_fails_on_every_rank
    from test_data_parallel import MODEL, SGDLlamaLM, make_datamodule

    assert_fails_on_every_rank(functools.partial(SGDLlamaLM, **{**MODEL, "moe_experts": 3, "moe_top_k": 1}),
                               make_datamodule, functools.partial(make_expert_strategy, expert_parallel_size=2),
                               world_size=2, message="expert_parallel_size=2 does not divide the 3 experts of an MoE layer")
