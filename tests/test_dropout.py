"""Dropout under model parallelism (lightning_par/parallel/rng.py): the same mask on every rank that holds the same
activations, independent masks where ranks hold different ones; recomputation replays them; a model without
dropout trains as before.

A tiny decoder with a dropout at every kind of place: after the embedding, on an MLP's hidden units (between a
column-wise layer and its row-wise partner), on each residual branch (after the row-wise layer), and
``scaled_dot_product_attention``'s own ``dropout_p``. Each rank records the masks it drew: forward hooks on the
``nn.Dropout`` modules, and for attention a probe inside the split region, an attention with zero queries and keys
and the identity as values, whose output is its dropout mask (scaled). Every rank is seeded alike, as Lightning's
``seed_everything`` seeds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import run_distributed
from test_parallelized import _lightning_par_state_on
from torch import Tensor, nn

VOCAB, DIM, HEADS, SEQ, BATCH, P = 32, 16, 4, 8, 2, 0.5


class Attention(nn.Module):
    def __init__(self, probe: bool, p: float) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.head_dim, self.p, self.probe = DIM // HEADS, p, probe
        self.probes: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # this rank's heads under tensor parallel
        batch, seq, width = q.shape
        heads = width // self.head_dim
        q, k, v = (t.view(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        p = self.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        if self.probe and self.training:
            zeros = torch.zeros(batch, heads, seq, seq)
            values = torch.eye(seq).expand(batch, heads, seq, seq)
            self.probes.append(F.scaled_dot_product_attention(zeros, zeros, values, dropout_p=p) == 0)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(p)  # on this rank's hidden units

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.drop(F.gelu(self.up_proj(x))))


class Block(nn.Module):
    def __init__(self, probe: bool, p: float) -> None:
        from lightning_par.models.llama import RMSNorm

        super().__init__()
        self.attention_norm, self.attention, self.attention_drop = RMSNorm(DIM), Attention(probe, p), nn.Dropout(p)
        self.mlp_norm, self.mlp, self.mlp_drop = RMSNorm(DIM), MLP(p), nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention_drop(self.attention(self.attention_norm(x)))  # residual dropout: the whole branch
        return x + self.mlp_drop(self.mlp(self.mlp_norm(x)))


class DropoutLM(nn.Module):
    def __init__(self, probe: bool = True, layers: int = 2, p: float = P) -> None:
        from lightning_par.models.llama import RMSNorm

        super().__init__()
        self.embed_tokens, self.drop = nn.Embedding(VOCAB, DIM), nn.Dropout(p)
        self.layers = nn.ModuleDict({str(i): Block(probe, p) for i in range(layers)})
        self.norm, self.lm_head = RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.drop(self.embed_tokens(tokens))
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x))

    @staticmethod
    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODEL_MAP = {"blocks": "layers", "embedding": "embed_tokens", "final_norm": "norm", "head": "lm_head",
             "styles": {"layers.*.attention_norm": "sequence", "layers.*.mlp_norm": "sequence",
                        "layers.*.attention.[qkv]_proj": "colwise", "layers.*.attention.o_proj": "rowwise",
                        "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
                        "embed_tokens": "vocab", "lm_head": "colwise", "norm": "sequence"}}


def _record_masks(model: nn.Module) -> dict[str, list[Tensor]]:
    """Forward hooks on every ``nn.Dropout``: the mask each forward drew (this rank's part), by module name."""
    masks: dict[str, list[Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            def hook(module: nn.Module, args: tuple, output: Tensor, name: str = name) -> None:
                if module.training:
                    local = output.to_local() if hasattr(output, "to_local") else output
                    masks.setdefault(name, []).append((local == 0).detach().clone())
            module.register_forward_hook(hook)
    return masks


def _tokens(steps: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(steps)]


def _laid_out(sizes: dict, *, probe: bool = True, p: float = P, **config: object):
    import torch.distributed as dist

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.parallel import parallelize
    from lightning_par.parallel.mesh import build_mesh
    from lightning_par.parallel.model_map import ModelMap

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    config = ParallelConfig(**sizes, **config).validate(dist.get_world_size())
    mesh = build_mesh(config, "cpu")
    torch.manual_seed(0)  # every rank alike, as Lightning's seed_everything seeds them
    model = DropoutLM(probe=probe, p=p)
    masks = _record_masks(model)
    batch = _tokens(1)[0]
    handle = parallelize(model, mesh, config, ModelMap.from_dict(MODEL_MAP), sample_batch=(batch[:, :-1], batch[:, 1:]),
                         loss_fn=DropoutLM.loss_fn)
    masks.clear()  # what set-up ran (the pipeline's trace of the whole model) is not training
    return model, handle, mesh, masks


def _train(model: nn.Module, handle, steps: int = 1) -> list[float]:
    model.train()
    losses = []
    for batch in _tokens(steps):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if handle.pipeline is not None:
            losses.append(float(handle.pipeline.train_step(inputs, targets, list(handle.inner.parameters()))))
        else:
            with handle.loss_context():
                loss = DropoutLM.loss_fn(handle.module(inputs), targets)
                loss.backward()
            losses.append(float(loss.detach()))
    return losses


def _attention_probes(model: nn.Module) -> dict[str, list[Tensor]]:
    return {f"{name}.sdpa": module.probes for name, module in model.named_modules()
            if isinstance(module, Attention) and module.probes}


def _tensor_parallel_masks(rank: int, world_size: int, sequence_parallel: bool) -> dict:
    model, handle, _, masks = _laid_out({"tp": 2}, sequence_parallel=sequence_parallel)
    _train(model, handle)
    first = {**masks, **_attention_probes(model)}
    # Again with dropout only in the split regions (between the column- and row-wise layers): their draws alone must
    # move the default stream on, or every step would repeat the same masks there.
    _turn_dropout_off(model, keep="mlp.drop")
    masks.clear()
    _train(model, handle, steps=2)
    return {"first": first, "split_only": masks, "on_module": _lightning_par_state_on(model)}


def _assert_alike(results: list[dict], name: str, alike: bool) -> None:
    ours, theirs = results[0][name], results[1][name]
    assert len(ours) == len(theirs) > 0, name
    for mine, other in zip(ours, theirs):
        assert mine.shape == other.shape, name
        assert torch.equal(mine, other) == alike, f"{name}: masks {'differ' if alike else 'are equal'} across ranks"


# Where each rank holds its own part of the activations under tensor parallel: split heads and hidden units.
SPLIT = ["layers.0.mlp.drop", "layers.1.mlp.drop", "layers.0.attention.sdpa", "layers.1.attention.sdpa"]
# The activations between the regions: whole on every rank without sequence parallel, its tokens with it.
BETWEEN = ["drop", "layers.0.attention_drop", "layers.0.mlp_drop", "layers.1.attention_drop", "layers.1.mlp_drop"]


def test_tensor_parallel_ranks_draw_alike_where_they_hold_the_same_activations() -> None:
    """tp=2 without sequence parallel: the masks of whole activations (the embedding's, a residual branch's after the
    row-wise layer's all-reduce, also after a split region drew) are the same on both ranks; those of each rank's
    heads (attention's ``dropout_p``) and hidden units are independent. The split regions' draws move the stream on:
    two steps with dropout there alone draw two different masks."""
    results = run_distributed(_tensor_parallel_masks, 2, False)
    firsts = [r["first"] for r in results]
    for name in SPLIT:
        _assert_alike(firsts, name, alike=False)
    for name in BETWEEN:
        _assert_alike(firsts, name, alike=True)
    for result in results:
        step_one, step_two = result["split_only"]["layers.0.mlp.drop"]
        assert not torch.equal(step_one, step_two)
        assert result["on_module"] == []  # the regions are hooks: the user's modules keep their own attributes
    _assert_alike([r["split_only"] for r in results], "layers.1.mlp.drop", alike=False)


def test_sequence_parallel_ranks_draw_their_own_masks_for_their_own_tokens() -> None:
    """tp=2 + sequence parallel: between the regions each rank holds its own tokens (the embedding's output and the
    residual branches, DTensors split along the sequence), so every mask is independent across the ranks, as are
    those of the split regions."""
    firsts = [r["first"] for r in run_distributed(_tensor_parallel_masks, 2, True)]
    for name in SPLIT + BETWEEN:
        _assert_alike(firsts, name, alike=False)


def _context_parallel_masks(rank: int, world_size: int) -> dict:
    model, handle, _, masks = _laid_out({"cp": 2}, probe=False, cp_method="ulysses")
    losses = _train(model, handle)
    return {"masks": masks, "loss": losses[0]}


def test_context_parallel_ranks_draw_alike_before_the_cut_and_their_own_masks_after() -> None:
    """cp=2 (Ulysses, with attention dropout: each rank draws for its heads): the embedding's output is the whole
    sequence on both ranks and draws the same mask; in the blocks each rank holds its own tokens and draws its own."""
    results = run_distributed(_context_parallel_masks, 2)
    masks = [r["masks"] for r in results]
    _assert_alike(masks, "drop", alike=True)
    for name in BETWEEN[1:] + ["layers.0.mlp.drop", "layers.1.mlp.drop"]:
        _assert_alike(masks, name, alike=False)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in results)


def _pipeline_masks(rank: int, world_size: int) -> dict:
    model, handle, _, masks = _laid_out({"pp": 2}, probe=False, microbatches=2, pp_schedule="1f1b")
    _train(model, handle)
    return {name: tensors for name, tensors in masks.items() if name.startswith("layers.")}


def test_pipeline_stages_do_not_repeat_each_others_masks() -> None:
    """pp=2, one block per stage, every rank seeded alike: stage 1 runs the code before its block on stand-ins (the
    same draws as stage 0's embedding) and then its block, whose masks would be those of stage 0's block for the
    same micro-batch if both drew from the seeded stream. Each stage draws from its own."""
    first, second = run_distributed(_pipeline_masks, 2)
    assert set(first) == {"layers.0.attention_drop", "layers.0.mlp.drop", "layers.0.mlp_drop"}
    assert set(second) == {"layers.1.attention_drop", "layers.1.mlp.drop", "layers.1.mlp_drop"}
    for part in ("attention_drop", "mlp.drop", "mlp_drop"):
        _assert_alike([{part: first[f"layers.0.{part}"]}, {part: second[f"layers.1.{part}"]}], part, alike=False)


def _gradients_with_recomputation(rank: int, world_size: int, mode: str) -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_par.parallel.modules import clean_name

    model, handle, _, _ = _laid_out({"tp": 2}, sequence_parallel=True, activation_checkpointing=mode)
    torch.manual_seed(7)
    _train(model, handle)
    return {clean_name(name): (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in model.named_parameters() if p.grad is not None}


def test_recomputation_replays_the_masks() -> None:
    """tp=2 + sequence parallel with every dropout on: the gradients are the same with full and selective activation
    checkpointing as without, which they are only if the recomputed forward draws the masks the forward drew (in the
    split regions, per shard, and from the default stream)."""
    plain = run_distributed(_gradients_with_recomputation, 2, "none")
    for mode in ("full", "selective"):
        recomputed = run_distributed(_gradients_with_recomputation, 2, mode)
        for rank, (expected, got) in enumerate(zip(plain, recomputed)):
            assert set(got) == set(expected)
            for name in expected:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7,
                                           msg=f"{mode}, rank {rank}: {name}")


def _turn_dropout_off(model: nn.Module, keep: str | None = None) -> None:
    """Every dropout of ``model`` off (but the ``nn.Dropout`` modules whose names end with ``keep``)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and not (keep and name.endswith(keep)):
            module.p = 0.0
        if isinstance(module, Attention):
            module.p, module.probe = 0.0, False


def _default_stream_after_training(rank: int, world_size: int) -> dict:
    from lightning_par.models.llama import LlamaConfig, Transformer
    from lightning_par.parallel.layout_check import draws_in_training
    from lightning_par.parallel.model_map import derive_model_map
    from lightning_par.parallel.record import layout_record

    results = {}
    for label, p in (("without dropout", 0.0), ("dropout turned off after set-up", P)):
        model, handle, mesh, _ = _laid_out({"tp": 2}, sequence_parallel=True, p=p)
        _turn_dropout_off(model)
        before = torch.get_rng_state()
        _train(model, handle, steps=2)
        results[label] = {"unchanged": torch.equal(before, torch.get_rng_state()),
                          "streams": layout_record(model).random_streams}
    # The set-up's question itself draws nothing, also for a model built on the meta device, whose small copy is
    # initialised by drawing (the reference model's initialisers).
    with torch.device("meta"):
        on_meta = Transformer(LlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=2, n_heads=HEADS, max_seq_len=SEQ))
    before = torch.get_rng_state()
    draws = draws_in_training(on_meta, mesh, derive_model_map(on_meta), _tokens(1)[0][:, :-1])
    results["asking"] = {"unchanged": torch.equal(before, torch.get_rng_state()), "draws": draws}
    return results


def test_a_model_that_draws_nothing_leaves_the_default_stream_alone() -> None:
    """A model without dropout gets no dropout streams at all (one training-mode forward of a small copy at set-up
    finds that it draws nothing, and asking draws nothing either), and a model whose dropout is off by the time it
    trains draws nothing through its streams: the default generator's state after two steps is the state before, so
    such a model trains as before."""
    for result in run_distributed(_default_stream_after_training, 2):
        assert result["without dropout"] == {"unchanged": True, "streams": False}
        assert result["dropout turned off after set-up"] == {"unchanged": True, "streams": True}
        assert result["asking"] == {"unchanged": True, "draws": False}
