"""sequence_parallel (context parallel): attention across sequence slices, and parity with one process."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from parity import assert_fails_on_every_rank, assert_layout_matches
from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule, make_module

from lightning_par.layout.context_methods import CONTEXT_METHODS
from lightning_par.parallel.context import causal_score_blocks, check_sequence_length, local_positions

PARITY_RTOL = 1e-5


def make_strategy(**kwargs):
    from lightning_par import ContextParallelStrategy

    return ContextParallelStrategy(**kwargs)


def test_ring_layout_gives_every_rank_the_same_causal_work() -> None:
    for cp in (2, 4, 8):
        assert {causal_score_blocks(r, cp, "ring") for r in range(cp)} == {2 * cp}
        # Contiguous slices (what Ulysses uses; it attends over the whole sequence anyway) would not be.
        assert [causal_score_blocks(r, cp, "ulysses") for r in range(cp)] == [r + 0.5 for r in range(cp)]


def test_layouts_cover_the_sequence_once() -> None:
    for method in ("ulysses", "ring"):
        positions = torch.cat([local_positions(16, r, 4, method) for r in range(4)])
        assert sorted(positions.tolist()) == list(range(16))
    assert local_positions(16, 1, 4, "ring").tolist() == [2, 3, 12, 13]


def test_sequence_length_that_does_not_split_is_a_clear_error() -> None:
    check_sequence_length(16, 4, "ring")
    check_sequence_length(12, 4, "ulysses")
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 8 .*2 x cp.*\[8, 16\]"):
        check_sequence_length(12, 4, "ring")
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by 4"):
        check_sequence_length(10, 4, "ulysses")


def _attention_against_whole(rank: int, world_size: int, method: str, kv_heads: int, is_causal: bool) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_par.parallel import context

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 16, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, kv_heads, T, D), torch.randn(B, kv_heads, T, D)
    grad = torch.randn(B, H, T, D)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=is_causal, enable_gqa=kv_heads != H)
    expected.backward(grad)

    positions = local_positions(T, rank, world_size, method)
    local = [t[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    attention = getattr(context, CONTEXT_METHODS[method].attention_function)
    sent = []  # bytes sent to other ranks by each kind of collective the methods use (what leaves the rank)
    originals = {name: getattr(dist, name) for name in ("batch_isend_irecv", "all_to_all_single", "all_gather",
                                                         "reduce_scatter")}

    def counted_sends(ops: list) -> list:
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return originals["batch_isend_irecv"](ops)

    def counted_all_to_all(output: torch.Tensor, tensor: torch.Tensor, *args, **kwargs) -> Any:  # also backward's
        sent.append(tensor.numel() * tensor.element_size() * (world_size - 1) / world_size)
        return originals["all_to_all_single"](output, tensor, *args, **kwargs)

    def counted_all_gather(outputs: list, tensor: torch.Tensor, *args, **kwargs) -> Any:  # to the others
        sent.append(tensor.numel() * tensor.element_size() * (world_size - 1))
        return originals["all_gather"](outputs, tensor, *args, **kwargs)

    def counted_reduce_scatter(output: torch.Tensor, inputs: list, *args, **kwargs) -> Any:  # all but its own part
        sent.append(output.numel() * output.element_size() * (world_size - 1))
        return originals["reduce_scatter"](output, inputs, *args, **kwargs)

    counters = {"batch_isend_irecv": counted_sends, "all_to_all_single": counted_all_to_all,
                "all_gather": counted_all_gather, "reduce_scatter": counted_reduce_scatter}
    for name, counter in counters.items():
        setattr(dist, name, counter)
    try:
        out = attention(*local, dist.group.WORLD, is_causal=is_causal, scale=None)
        out.backward(grad[:, :, positions])
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    refusal = None
    if not CONTEXT_METHODS[method].attention_dropout:  # its row says it has none: the router refuses it by name
        try:
            context._RouteAttention(dist.group.WORLD, method).attend(*local, dropout_p=0.1)
        except ValueError as error:
            refusal = str(error)
    errors = {"out": (out - expected[:, :, positions]).abs().max().item()}
    # Gradients of k and v include every rank's queries: the methods send them back to their owner.
    for name, mine, ref in zip("qkv", local, whole):
        errors[name] = (mine.grad - ref.grad[:, :, positions]).abs().max().item()
    dist.destroy_process_group()
    return {"errors": errors, "sent": sum(sent), "refusal": refusal}


@pytest.mark.parametrize("method", list(CONTEXT_METHODS))
@pytest.mark.parametrize(("world_size", "kv_heads", "is_causal"), [(2, 4, True), (4, 2, True), (2, 2, False)])
def test_attention_over_slices_equals_attention_over_the_whole(method, world_size, kv_heads, is_causal) -> None:
    from harness import run_distributed

    B, H, T, D = 2, 4, 16, 8
    for result in run_distributed(_attention_against_whole, world_size, method, kv_heads, is_causal):
        assert max(result["errors"].values()) < 1e-5, result
        # What the method's row says it sends is what it sent: the planner's communication volume of a block.
        local = B * H * (T // world_size) * D * 4
        assert result["sent"] == CONTEXT_METHODS[method].exchange_bytes(local, H, kv_heads, world_size, False), result
        if not CONTEXT_METHODS[method].attention_dropout:
            assert result["refusal"] and "no attention dropout" in result["refusal"] and all(
                f"cp_method={name!r}" in result["refusal"] for name, spec in CONTEXT_METHODS.items()
                if spec.attention_dropout), result["refusal"]
        if method == "ring":
            # Keys and values travel with their own heads, not expanded to the query heads: forward passes them on
            # cp - 1 times, backward as well, and their gradients cp times (home at last). fp32, (B, Hkv, T/cp, D).
            block = 2 * kv_heads * (16 // world_size) * 8 * 4
            assert result["sent"] == (4 * (world_size - 1) + 2 * world_size) * block, result


@pytest.mark.parametrize(
    ("world_size", "kwargs", "accumulate", "clip"),
    [
        (2, dict(context_parallel_size=2, context_parallel_method="ulysses"), 1, None),
        (2, dict(context_parallel_size=2, context_parallel_method="ring"), 1, None),
        (4, dict(context_parallel_size=4, context_parallel_method="ulysses"), 1, 0.05),
        (4, dict(context_parallel_size=4, context_parallel_method="ring"), 1, 0.05),
        (4, dict(context_parallel_size=2, context_parallel_method="ring"), 2, None),  # dp2 x cp2 (DDP), accumulation
        (4, dict(context_parallel_size=2, context_parallel_method="ulysses", zero_stage=3), 1, 0.05),  # FSDP2 over dp x cp
    ],
    ids=["cp2-ulysses", "cp2-ring", "cp4-ulysses-clip", "cp4-ring-clip", "dp2xcp2-ring-acc2", "dp2xcp2-ulysses-zero3"],
)
def test_context_parallel_matches_single_process(world_size: int, kwargs: dict, accumulate: int, clip) -> None:
    dp = world_size // kwargs["context_parallel_size"]
    assert_layout_matches(make_module, make_datamodule, functools.partial(make_strategy, **kwargs),
                          world_size=world_size, dp=dp, steps=STEPS, accumulate=accumulate, clip=clip,
                          rtol=PARITY_RTOL, label=f"sequence_parallel {kwargs} ws={world_size}")


def test_all_gathered_keys_match_single_process_over_20_steps() -> None:
    """Llama 3's context parallel (keys and values all-gathered, the queries of balanced chunks) on cp=4, clipped."""
    kwargs = dict(context_parallel_size=4, context_parallel_method="allgather")
    assert_layout_matches(make_module, make_datamodule, functools.partial(make_strategy, **kwargs), world_size=4, dp=1,
                          steps=20, clip=0.05, rtol=PARITY_RTOL, label=f"context_parallel {kwargs}")


@pytest.mark.parametrize(
    ("strategy_kwargs", "model_kwargs", "seq_len", "message"),
    [
        (dict(context_parallel_size=4, context_parallel_method="ring"), {}, 12,
         "sequence length 12 is not divisible by 8 (2 x context_parallel_size"),
        (dict(context_parallel_size=4, context_parallel_method="ulysses"), dict(n_heads=2, n_kv_heads=2), 16,
         "context parallel 'ulysses' splits attention heads over context_parallel_size=4 ranks, but the layer has 2 query heads"),
    ],
    ids=["sequence", "heads"],
)
def test_layouts_that_do_not_split_fail_on_every_rank(strategy_kwargs, model_kwargs, seq_len, message) -> None:
    assert_fails_on_every_rank(functools.partial(SGDLlamaLM, **{**MODEL, **model_kwargs}),
                               functools.partial(make_datamodule, seq_len=seq_len),
                               functools.partial(make_strategy, **strategy_kwargs), world_size=4, message=message)


def _lengths_seen(rank: int, world_size: int, method: str) -> dict:
    import lightning

    module = SGDLlamaLM(**MODEL)
    seen: dict[str, set] = {"q_proj": set(), "final_norm": set()}

    def record(name):
        def hook(module, args, output) -> None:  # returns None: the output stays as it is
            seen[name].add(output.shape[1])

        return hook

    module.model.layers["0"].attention.q_proj.register_forward_hook(record("q_proj"))
    module.model.norm.register_forward_hook(record("final_norm"))
    seen["loss"] = set()
    loss_fn = module.loss_fn

    def recorded_loss(logits, targets):
        seen["loss"].add(logits.shape[1])
        return loss_fn(logits, targets)

    module.loss_fn = recorded_loss
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                                strategy=make_strategy(context_parallel_size=world_size, context_parallel_method=method),
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=make_datamodule())
    # The same module again: its blocks were set up once and are not split a second time.
    trainer.validate(module, datamodule=make_datamodule())
    return seen


@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_blocks_run_on_a_slice_of_the_sequence(method: str) -> None:
    """Each of 2 ranks projects 8 of the 16 tokens, and normalises them (the head too); the loss sees all 16."""
    from harness import run_distributed

    for seen in run_distributed(_lengths_seen, 2, method):
        assert seen == {"q_proj": {8}, "final_norm": {8}, "loss": {16}}


def test_context_parallel_resolves_and_the_name_sequence_parallel_is_tensor_parallels_option_only() -> None:
    """``context_parallel`` is the strategy's name; ``sequence_parallel`` names no strategy (it is Megatron's
    tensor-parallel option, ``sequence_parallel=True``), and the refusal says which names there are."""
    import lightning
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_par
    from lightning_par.cli.lightning_cli import check_strategy_name

    assert StrategyRegistry["context_parallel"]["strategy"] is lightning_par.ContextParallelStrategy
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="context_parallel", logger=False)
    assert type(trainer.strategy) is lightning_par.ContextParallelStrategy
    assert "sequence_parallel" not in StrategyRegistry and not hasattr(lightning_par, "SequenceParallelStrategy")
    with pytest.raises(ValueError, match="'sequence_parallel' is not a strategy name.* context_parallel"):
        check_strategy_name("sequence_parallel")


class CenteredTransformer:
    """The reference network with code between its final norm and its head that mixes positions (each hidden state
    minus the sequence's mean): the head cannot run on a slice of the sequence there."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1], positions)
        h = self.embed_tokens(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h)
        return self.lm_head(h - h.mean(1, keepdim=True))


def make_centered_module() -> SGDLlamaLM:
    module = SGDLlamaLM(**MODEL)
    network = type(module.model)
    module.model.__class__ = type("Centered" + network.__name__, (CenteredTransformer, network), {})
    return module


def test_the_head_runs_on_a_slice_only_where_it_follows_the_last_block() -> None:
    """Where the head computes each position from the final norm of the last block's output, context parallel runs
    them on each rank's tokens and gathers the logits; code that mixes positions in between sends the gather back to
    the last block's output, so that model trains exactly too."""
    from lightning_par.parallel.context import head_follows_last_block
    from lightning_par.parallel.model_map import resolve_model_map

    sample = torch.randint(0, MODEL["vocab_size"], (2, 16))
    for module, follows in ((make_module(), True), (make_centered_module(), False)):
        assert head_follows_last_block(module, resolve_model_map(None, module), sample) is follows
    assert_layout_matches(make_centered_module, make_datamodule,
                          functools.partial(make_strategy, context_parallel_size=2, context_parallel_method="ring"),
                          world_size=4, dp=2, steps=STEPS, rtol=1e-5, label="centered head, dp2 x cp2")
