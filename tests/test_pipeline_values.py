"""Values one block hands to later blocks, under pipeline parallel: carried across the stage boundary with the hidden
states, or refused before step 0 naming the value.

Two channels are held to one process over 20 SGD steps at pp=2:

- a block's output beside the hidden states that the network's loop hands to the next blocks: T5's relative position
  bias (Raffel et al. 2020), computed by block 0 from its own table, reused by every later block (Hugging Face's
  ``T5Stack`` does ``position_bias = layer_outputs[1]``), and a hand-written decoder doing the same;
- a dictionary every block receives, into which earlier layers write their keys and values and from which later
  layers read them (cross-layer key/value sharing, Brandon et al. 2024; Hugging Face's Gemma 3n and a hand-written
  equivalent).

A value that cannot cross is refused at set-up on every rank, naming it; the set-up check runs the split on a small
copy with the stages' real sends, forward and backward, and refuses whatever differs from the whole model.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from parity import assert_fails_on_every_rank, assert_layout_matches

STEPS = 20
RTOL = 1e-5
VOCAB, SEQ_LEN, DIM, HEADS = zoo.VOCAB, zoo.SEQ_LEN, 32, 4


def _data():
    from lightning_par.data import TokenDataModule

    return TokenDataModule(source="synthetic", vocab_size=VOCAB, seq_len=SEQ_LEN, batch_size=4, num_samples=256,
                           num_val_samples=8)


def _pp2(**knobs):
    from lightning_par import PipelineParallelStrategy

    return PipelineParallelStrategy(**{"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b", "microbatches": 2,
                                       **knobs})


# ------------------------------------------------------------------------------------------ hand-written models
class _Attention(nn.Module):
    """Causal attention whose scores take an additive bias (T5's relative positions) and whose keys and values may
    come from an earlier layer."""

    def __init__(self, dim: int, heads: int, own_kv: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.o = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False) if own_kv else None
        self.v = nn.Linear(dim, dim, bias=False) if own_kv else None

    def split(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple]:
        B, T, C = x.shape
        q = self.split(self.q(x))
        k, v = kv if kv is not None else (self.split(self.k(x)), self.split(self.v(x)))
        scores = q @ k.transpose(-1, -2) / (C // self.heads) ** 0.5
        if bias is not None:
            scores = scores + bias
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, C)), (k, v)


class _MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class BiasBlock(nn.Module):
    """A block whose attention adds a relative position bias. The first block holds the table and computes the bias
    (heads x T x T); it returns it beside the hidden states, and the network hands it to the next blocks, which hold
    no table (T5's layout)."""

    def __init__(self, dim: int, heads: int, has_table: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = _Attention(dim, heads), _MLP(dim)
        self.table = nn.Embedding(2 * SEQ_LEN - 1, heads) if has_table else None

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if position_bias is None:
            T = x.shape[1]
            if self.table is None:  # as T5 does where neither a table nor a bias is there: no bias
                position_bias = torch.zeros(1, self.attn.heads, T, T, device=x.device, dtype=x.dtype)
            else:
                positions = torch.arange(T, device=x.device)
                distance = positions[None, :] - positions[:, None] + SEQ_LEN - 1
                position_bias = self.table(distance).permute(2, 0, 1).unsqueeze(0)  # (1, heads, T, T)
        x = x + self.attn(self.norm1(x), bias=position_bias)[0]
        return x + self.mlp(self.norm2(x)), position_bias


class BiasNetwork(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(BiasBlock(DIM, HEADS, has_table=i == 0) for i in range(layers))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, position_bias = self.embed(tokens), None
        for block in self.blocks:
            h, position_bias = block(h, position_bias)  # the first block's bias, handed on
        return self.head(self.norm(h))


class BiasLM(zoo.SGDModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = BiasNetwork()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)


class SharedKVBlock(nn.Module):
    """A block of a network whose later layers reuse the keys and values of the last earlier layer of their kind,
    through a dictionary every block receives (Gemma 3n's ``shared_kv_states``): ``store`` layers write their
    keys and values under their kind, ``reuse`` layers read them and hold no key or value projection."""

    def __init__(self, dim: int, heads: int, kind: str, mode: str) -> None:
        super().__init__()
        self.kind, self.mode = kind, mode
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = _Attention(dim, heads, own_kv=mode != "reuse"), _MLP(dim)

    def forward(self, x: torch.Tensor, shared_kv: dict | list) -> torch.Tensor:
        reused = None
        if self.mode == "reuse":  # a list holds the stores in order: the last one is this kind's
            reused = shared_kv[self.kind] if isinstance(shared_kv, dict) else shared_kv[-1]
        attended, kv = self.attn(self.norm1(x), kv=reused)
        if self.mode == "store" and isinstance(shared_kv, dict):
            shared_kv[self.kind] = kv
        elif self.mode == "store":
            shared_kv.append(kv)
        x = x + attended
        return x + self.mlp(self.norm2(x))


class SharedKVNetwork(nn.Module):
    KINDS = ("local", "global", "local", "global")
    MODES = ("store", "store", "reuse", "reuse")

    def __init__(self, shared: type = dict) -> None:
        super().__init__()
        self.shared = shared  # what the blocks share their keys and values in: a dict, or a list
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(SharedKVBlock(DIM, HEADS, kind, mode) for kind, mode in zip(self.KINDS, self.MODES))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, shared_kv = self.embed(tokens), self.shared()
        for block in self.blocks:
            h = block(h, shared_kv=shared_kv)
        return self.head(self.norm(h))


class SharedKVLM(zoo.SGDModule):
    def __init__(self, shared: type = dict) -> None:
        super().__init__()
        self.model = SharedKVNetwork(shared)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)


# ------------------------------------------------------------------------------------------ Hugging Face models
class T5LM(zoo.SGDModule):
    """Hugging Face's T5 encoder-decoder (its encoder's blocks are the pipeline's; the decoder runs after them on the
    last stage), the tokens fed to both."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.T5Config(vocab_size=VOCAB, d_model=DIM, d_kv=8, d_ff=64, num_layers=4,
                                       num_decoder_layers=2, num_heads=HEADS, relative_attention_num_buckets=8,
                                       relative_attention_max_distance=SEQ_LEN, dropout_rate=0.0, use_cache=False,
                                       feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0)
        self.model = transformers.T5ForConditionalGeneration(config)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs, decoder_input_ids=inputs).logits


GEMMA3N_TEXT = dict(model_type="gemma3n_text", intermediate_size=64, num_key_value_heads=2, head_dim=8,
                    num_hidden_layers=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                    num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                    laurel_rank=4, altup_num_inputs=2, tie_word_embeddings=True)


class Gemma3nLM(zoo.HuggingFaceLM):
    """Gemma 3n (text) at a third of the zoo's learning rate: its tiny config (AltUp, LAuReL, per-layer inputs) is
    less well conditioned at 0.03, where rounding alone (data parallel over 2 ranks, nothing carried) grows to 1.1e-5
    of the weights in 20 steps; at 0.01 it stays at 1.8e-6."""

    def __init__(self) -> None:
        super().__init__({**zoo._COMMON, **GEMMA3N_TEXT})

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("make_model", [BiasLM, SharedKVLM], ids=["position-bias", "shared-kv-dict"])
def test_values_handed_between_hand_written_blocks_cross_the_stages(make_model) -> None:
    """The first block's position bias, and keys and values written into a dictionary by earlier layers, reach the
    blocks of the next stage: 20 SGD steps of pp2 1F1B match one process."""
    assert_layout_matches(make_model, _data, _pp2, world_size=2, dp=1, steps=STEPS, rtol=RTOL,
                          label=f"{make_model.__name__} pp2")


@pytest.mark.parametrize("make_model", [T5LM, Gemma3nLM], ids=["t5", "gemma3n"])
def test_values_handed_between_hugging_face_blocks_cross_the_stages(make_model) -> None:
    """T5's relative position bias (block 0 computes it, T5Stack hands it on) and Gemma 3n's shared keys and values
    (a KVSharingDict every layer receives) under pp2 1F1B: 20 SGD steps match one process."""
    from installed import require

    require("transformers")
    assert_layout_matches(make_model, _data, _pp2, world_size=2, dp=1, steps=STEPS, rtol=RTOL,
                          label=f"{make_model.__name__} pp2")



@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_values_cross_every_boundary_of_multi_stage_schedules(schedule: str) -> None:
    """One block per stage (4 stages on 2 ranks): the values cross three boundaries, between ranks both ways and,
    under ZB-V, from stage 1 to stage 2 on one rank (handed over without a send). 20 SGD steps match one process
    for both channels."""
    for make_model in (BiasLM, SharedKVLM):
        assert_layout_matches(make_model, _data, functools.partial(_pp2, pipeline_schedule=schedule), world_size=2,
                              dp=1, steps=STEPS, rtol=RTOL, label=f"{make_model.__name__} pp2 {schedule}")


def _validate(rank: int, world_size: int, make_model, schedule: str) -> tuple[float, dict | None, torch.Tensor]:
    import lightning

    torch.manual_seed(1234)
    module = make_model()
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, max_steps=2, logger=False,
                                strategy=_pp2(pipeline_schedule=schedule), enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=_data())
    validated = trainer.validate(module, datamodule=_data(), verbose=False)[0]["val_loss"]
    tokens = torch.randint(0, VOCAB, (4, SEQ_LEN), generator=torch.Generator().manual_seed(5))
    tokens = torch.utils.data.DataLoader(tokens, batch_size=4)
    predicted = trainer.predict(module, dataloaders=tokens)[0]
    state = trainer.strategy.consolidated_state_dict()  # a collective: every rank takes part
    return validated, state if rank == 0 else None, predicted


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_values_cross_the_stages_in_evaluation(schedule: str) -> None:
    """Validation and predict run the stages forward only (ZB-V through forward_through_stages, which sends each
    stage's values itself): the loss and the logits are one process's with the trained weights."""
    from harness import run_distributed

    (validated, state, predicted), _ = run_distributed(_validate, 2, SharedKVLM, schedule)
    module = SharedKVLM()
    module.load_state_dict(state)
    datamodule = _data()
    datamodule.setup("validate")
    with torch.no_grad():
        losses = [module.loss_fn(module(inputs), targets).item() for inputs, targets in
                  (module.split_batch(batch) for batch in datamodule.val_dataloader())]
        tokens = torch.randint(0, VOCAB, (4, SEQ_LEN), generator=torch.Generator().manual_seed(5))
        expected = module(tokens)
    assert abs(validated - sum(losses) / len(losses)) <= 1e-5 * abs(validated)
    torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-6)



# ------------------------------------------------------------------------------------------ refused
class ListKVLM(SharedKVLM):
    """Keys and values shared through a list every block receives: ``store`` layers append, ``reuse`` layers read."""

    def __init__(self) -> None:
        super().__init__(shared=list)


class _Holder:
    """A plain object every block holds (not an argument): block 0 leaves its bias there for the others."""

    bias: torch.Tensor | None = None


class HeldBiasBlock(BiasBlock):
    def __init__(self, dim: int, heads: int, has_table: bool, holder: _Holder) -> None:
        super().__init__(dim, heads, has_table)
        self.holder = holder

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, bias = super().forward(x, None if self.table is not None else self.holder.bias)
        if self.table is not None:
            self.holder.bias = bias
        return x


class HeldBiasNetwork(BiasNetwork):
    def __init__(self) -> None:
        super().__init__()
        holder = _Holder()
        self.blocks = nn.ModuleList(HeldBiasBlock(DIM, HEADS, i == 0, holder) for i in range(len(self.blocks)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class HeldBiasLM(zoo.SGDModule):
    """The position bias handed on through an attribute of an object the blocks share: no stage boundary sees it,
    and a later stage's blocks find no bias there (they fall back to none, as T5's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = HeldBiasNetwork()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)


def test_keys_and_values_shared_through_a_list_are_refused_naming_the_value() -> None:
    """A list cannot cross a stage boundary (only the entries of a dict do): refused before step 0 on every rank,
    naming the block that writes into it, the one that reads it and what would cross."""
    assert_fails_on_every_rank(ListKVLM, _data, _pp2, world_size=2, message=(
        "pipeline parallel: block 'model.blocks.0' writes shared_kv[0] into a list the blocks share: a stage boundary "
        "carries the entries of a dict they share, not of a list, and block 'model.blocks.3' receives it; a stage "
        "would start at 'model.blocks.2', between them, and run without it. Hand the value on as a tensor the block "
        "returns or in a dict the blocks share"))


def test_a_value_handed_on_through_an_attribute_is_refused_by_the_set_up_check() -> None:
    """Block 0 leaves its position bias on an object the blocks hold; the trace sees no argument carry it. The set-up
    check runs the stages of a small copy with their real sends and finds the first block of the second stage
    computing other hidden states than the whole model: refused before step 0 on every rank, naming the block."""
    assert_fails_on_every_rank(HeldBiasLM, _data, _pp2, world_size=2, message=(
        "block 'model.blocks.1' (HeldBiasBlock) computes other hidden states than in the whole model"))


# ------------------------------------------------------------------------------------------ beyond the trace
def test_what_crosses_beyond_the_traced_blocks_follows_the_last_traced_block() -> None:
    """A model built on the meta device is traced on a copy of its first blocks. Within them what crosses is exact;
    beyond them the last traced block stands for the rest: the item each block hands the next (T5's bias) crosses
    from the block before the boundary, and the dict's entries as the traced blocks left them."""
    from lightning_par.parallel.pipeline.handoffs import Entry, EntryPart, Handoffs, Item

    bias = Handoffs(traced=3, items={Item(0, 1): frozenset({1}), Item(1, 1): frozenset({2})}, chain=frozenset({1}))
    assert bias.crossing(1, 3) == (Item(0, 1),) and bias.crossing(2, 3) == (Item(1, 1),)  # every block traced
    assert bias.crossing(6, 8) == (Item(5, 1),)
    local, shared = (Entry("shared_kv", kind, 2, f"shared_kv[{kind!r}]") for kind in ("local", "global"))
    kv = Handoffs(traced=3, entries={local: (0, frozenset({1, 2})), shared: (1, frozenset({2}))})
    assert kv.crossing(1, 3) == (EntryPart(local, 0), EntryPart(local, 1))
    assert kv.crossing(6, 8) == tuple(EntryPart(e, i) for e in (local, shared) for i in (0, 1))
    read_once = Handoffs(traced=3, entries={local: (0, frozenset({1}))})
    assert read_once.crossing(2, 3) == ()  # nothing after block 1 reads it: nothing to send


def test_a_stage_refuses_to_send_a_value_it_does_not_have() -> None:
    """Beyond the traced blocks, a stage checks what it sends: an item its block did not return, and an entry the
    trace did not see written, are refused naming them (never sent as something else, never dropped)."""
    from lightning_par.parallel.pipeline.carry import Carrier
    from lightning_par.parallel.pipeline.handoffs import Entry, EntryPart, Item

    names = [f"model.blocks.{i}" for i in range(8)]
    carrier = Carrier((), (Item(5, 1),), names, exact=False)
    with carrier.running(()):
        carrier.block_returned(5, (torch.zeros(2), None))
        with pytest.raises(ValueError, match=r"block 'model.blocks.5' returned NoneType as item 1 of its output"):
            carrier.collect()
    local = Entry("shared_kv", "local", 0, "shared_kv['local']")
    carrier = Carrier((), (EntryPart(local, 0),), names, exact=False)
    with carrier.running(()):
        carrier.block_called((torch.zeros(2),), {"shared_kv": {"local": torch.ones(2), "global": torch.ones(2)}})
        with pytest.raises(ValueError, match=r"the dict the blocks share \(shared_kv\) holds 'global', which the "
                                             r"set-up's trace of the model's first blocks"):
            carrier.collect()


@pytest.mark.parametrize("make_model", [BiasLM, SharedKVLM], ids=["position-bias", "shared-kv-dict"])
def test_a_model_built_on_the_meta_device_carries_what_the_whole_trace_finds(make_model) -> None:
    """Built on the meta device (``Trainer.init_module(empty_init=True)``), a model is traced on a copy of its first
    blocks; at the boundary of pp2 (block 2 of 4) the values that cross are those the trace of every block finds."""
    from lightning_par.parallel.model_map import derive_model_map
    from lightning_par.parallel.pipeline.split import _trace

    sample = torch.randint(0, VOCAB, (1, SEQ_LEN))
    whole = make_model()
    with torch.device("meta"):
        on_meta = make_model()
    model_map = derive_model_map(whole)
    exact, extrapolated = _trace(whole, model_map, sample).handoffs, _trace(on_meta, model_map, sample).handoffs
    assert exact.exact(4) and not extrapolated.exact(4)
    assert extrapolated.crossing(2, 4) == exact.crossing(2, 4) != ()
