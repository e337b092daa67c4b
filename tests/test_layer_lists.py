"""Layer lists of several classes, a block several layers share, a tensor tied under several names, and the refusals
of what context parallel cannot split: each trains like one process (20 SGD steps within 1e-5) or is refused before
step 0 naming the module and the reason (docs/models.md: "Where a model map comes from", "Tied weights").

The models: tests/zoo.py's ``HybridLM`` (convolution and attention layers interleaved, the attention layers calling
one shared block that holds a list of two per-position adapters) and, from transformers, Zamba2 (Mamba2 and hybrid
layers whose shared transformer's parameters are tied across the layers), Jamba (Mamba and attention layers of two
classes, with a ``base_model_tp_plan``), LFM2 (gated short convolutions) and the encoder-decoders BART and T5 (one
tensor named ``shared``, encoder and decoder ``embed_tokens`` and ``lm_head``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from installed import require
from torch import nn

import zoo
from parity import assert_fails_on_every_rank, assert_parity, layout_runs, reference_run
from test_zoo import make_datamodule

STEPS = 20
PARITY_RTOL = 1e-5


def make_strategy(layout: str):
    import lightning_par

    if layout == "zero3":  # every layer a unit, so that the shared block must be a unit of its own
        return lightning_par.ZeroStrategy(zero_stage=3, blocks_per_unit=1)
    if layout == "pp2":
        return lightning_par.PipelineParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="1f1b",
                                                      microbatches=2)
    if layout == "tp2":
        return lightning_par.TensorParallelStrategy(tensor_parallel_size=2)
    if layout == "cp2":
        return lightning_par.Hybrid3DStrategy(context_parallel_size=2)
    raise ValueError(layout)


def _model(name: str):
    return zoo.HybridLM() if name == "hybrid" else zoo.make_model(name)


# ------------------------------------------------------------------------------------------ the block finder
def test_the_blocks_are_the_layer_list_whatever_its_classes() -> None:
    """The layer list holds most of the parameters: chosen over a list of two identical entries inside one layer (the
    shared block's adapters, Zamba2's ``gate_up_proj_adapter_list``) and though its layers are of two classes."""
    require("transformers")
    from lightning_par.parallel.model_map import derive_model_map, huggingface_model_map

    assert derive_model_map(zoo.HybridLM()).blocks == "model.layers"
    zamba2 = zoo.make_model("zamba2")
    assert {type(layer).__name__ for layer in zamba2.model.model.layers} == {"Zamba2MambaDecoderLayer",
                                                                             "Zamba2HybridLayer"}
    assert derive_model_map(zamba2).blocks == "model.model.layers"
    # Jamba ships a base_model_tp_plan for its attention layers: translated, the Mamba layers left whole.
    jamba = huggingface_model_map(zoo.make_model("jamba"))
    assert (jamba.blocks, jamba.source) == ("model.model.layers", "huggingface")
    assert jamba.style_of("model.model.layers.1.self_attn.q_proj") == "colwise"
    assert jamba.style_of("model.model.layers.1.self_attn.o_proj") == "rowwise"
    assert jamba.style_of("model.model.layers.0.mamba.in_proj") is None


def test_names_that_mean_different_styles_in_different_layer_classes_get_a_pattern_per_layer() -> None:
    """``mixer.out_proj`` is paired with ``mixer.fc_in`` in one class of layer and alone in the other: one pattern
    for both would split the lone one, whose partner is not split."""
    from lightning_par.parallel.model_map import derive_model_map

    class Paired(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = nn.Module()
            self.mixer.fc_in, self.mixer.out_proj = nn.Linear(8, 16), nn.Linear(16, 8)

    class Lone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = nn.Module()
            self.mixer.in_x, self.mixer.out_proj = nn.Linear(8, 16), nn.Linear(16, 8)

    model = nn.Module()
    model.layers = nn.ModuleList([Paired(), Lone(), Paired(), Lone()])
    styles = derive_model_map(model).styles
    assert styles == {"layers.0.mixer.out_proj": "rowwise", "layers.2.mixer.out_proj": "rowwise",
                      "layers.*.mixer.fc_in": "colwise"}


def test_a_part_several_layers_hold_is_found_by_identity() -> None:
    """One module referenced from two layer positions (HybridLM) and modules of their own whose parameters are tied
    (Zamba2 as transformers builds it): one shared part each, named at every position."""
    require("transformers")
    from lightning_par.parallel.shared_parts import shared_parts

    def parts(model: nn.Module, blocks: str) -> list:
        layers = [(f"{blocks}.{name}", layer) for name, layer in model.get_submodule(blocks).named_children()]
        return [(part.names, len(part.modules)) for part in shared_parts(layers)]

    assert parts(zoo.HybridLM(), "model.layers") == [(("model.layers.1.shared", "model.layers.3.shared"), 1)]
    assert parts(zoo.make_model("zamba2"), "model.model.layers") == [
        (("model.model.layers.1.shared_transformer", "model.model.layers.3.shared_transformer"), 2)]
    assert parts(zoo.make_model("llama"), "model.model.layers") == []


def test_a_shared_block_run_by_another_layer_that_holds_it_runs_inside_its_block() -> None:
    """ZeRO-3 keeps a block whose parts run outside it whole; a shared block that the fourth layer runs is not run
    outside the second, which holds it too."""
    from lightning_par.parallel.outside_calls import watching_block_parts

    model = zoo.HybridLM()
    layers = [(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)]
    with watching_block_parts(layers) as calls, torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))
    assert {call.part for call in calls if call.part.startswith("model.layers.1.shared")}
    assert [call.part for call in calls if not call.inside_its_block] == []


# ---------------------------------------------------------------------------------------- tied tensors
def test_every_name_of_a_tied_tensor_is_split_alike_or_none() -> None:
    """BART and T5 tie ``shared``, the encoder's and decoder's ``embed_tokens`` and ``lm_head``: all four split over
    the vocabulary. A holder with no split of its kind (a module that computes with the tensor itself) leaves them
    all whole."""
    require("transformers")
    from lightning_par.parallel.model_map import derive_model_map

    for name, prefix in (("bart", "model.model."), ("t5", "model.")):
        model_map = derive_model_map(zoo.make_model(name))
        assert {holder: model_map.style_of(holder) for holder in (
            f"{prefix}shared", f"{prefix}encoder.embed_tokens", f"{prefix}decoder.embed_tokens", "model.lm_head")} == {
            f"{prefix}shared": "vocab", f"{prefix}encoder.embed_tokens": "vocab",
            f"{prefix}decoder.embed_tokens": "vocab", "model.lm_head": "colwise"}

    class Scores(nn.Module):  # compares the hidden states with every token's embedding: no split of its own
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.weight = weight

    model = zoo.NanoGPT()  # its embedding is tied to its head
    model.model.scores = Scores(model.model.transformer.wte.weight)
    model_map = derive_model_map(model)
    assert [model_map.style_of(n) for n in ("model.transformer.wte", "model.lm_head")] == ["replicate", "replicate"]
    assert model_map.style_of("model.transformer.h.0.attn.c_attn") == "colwise"


# --------------------------------------------------------------------------------- training like one process
CELLS = {  # (model, layout): data-parallel size
    ("hybrid", "zero3"): 2, ("hybrid", "pp2"): 1, ("hybrid", "tp2"): 1, ("bart", "tp2"): 1, ("t5", "tp2"): 1,
    ("jamba", "tp2"): 1,
}


def test_hybrid_layer_lists_shared_blocks_and_tied_names_train_like_one_process() -> None:
    """In one launch of 2 ranks: the hybrid model under ZeRO-3 (the shared block one unit, gathered each time it runs),
    pp2 (the shared block on both stages, its copies' gradients summed) and tp2 (the shared block split once, by
    heads), BART and T5 under tp2 (the tensor of four names split alike) and Jamba under tp2 (its config's plan for
    the attention layers)."""
    require("transformers")
    runs = {f"{model} {layout}": (functools.partial(_model, model), make_datamodule,
                                  functools.partial(make_strategy, layout))
            for model, layout in CELLS}
    actual = layout_runs(runs, world_size=2, steps=STEPS, timeout=540)
    for (model, layout), dp in CELLS.items():
        expected = reference_run(functools.partial(_model, model), make_datamodule, dp=dp, steps=STEPS)
        loss_error, weight_error = assert_parity(actual[f"{model} {layout}"], expected, rtol=PARITY_RTOL)
        print(f"{model} {layout}: losses {loss_error:.1e}, weights {weight_error:.1e} relative")


def test_zamba2_trains_under_zero3_like_one_process_and_is_refused_by_a_pipeline_naming_the_block() -> None:
    """Zamba2's shared transformer, its parameters tied across the hybrid layers, is one ZeRO-3 unit. Its layers take
    the embedding's output beside the hidden states, which a later pipeline stage cannot compute: refused, naming
    the layer."""
    require("transformers")
    make = functools.partial(zoo.make_model, "zamba2")
    actual = layout_runs({"zero3": (make, make_datamodule, functools.partial(make_strategy, "zero3"))},
                         world_size=2, steps=STEPS, timeout=540)["zero3"]
    loss_error, weight_error = assert_parity(actual, reference_run(make, make_datamodule, dp=2, steps=STEPS),
                                             rtol=PARITY_RTOL)
    print(f"zamba2 zero3: losses {loss_error:.1e}, weights {weight_error:.1e} relative")
    assert_fails_on_every_rank(make, make_datamodule, functools.partial(make_strategy, "pp2"), world_size=2,
                               message="ValueError: pipeline parallel: an argument of block 'model.model.layers.0' "
                                       "besides its hidden states is computed from the hidden states")


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("model", "mixer"), [
    ("hybrid", "Block 'model.layers.0' (ConvLayer) mixes the tokens through 'model.layers.0.conv' (Conv1d), a "
               "convolution or recurrence along the sequence, not attention"),
    ("lfm2", "Block 'model.model.layers.0' (Lfm2DecoderLayer) mixes the tokens through 'model.model.layers.0.conv' "
             "(Lfm2ShortConv), a convolution or recurrence along the sequence, not attention"),
])
def test_context_parallel_names_the_convolution_it_cannot_split(model: str, mixer: str) -> None:
    """A layer that mixes the tokens through a convolution (SDPA already runs the attention layers) is refused naming
    the module and that reason, not told to load the model with SDPA attention."""
    require("transformers")
    assert_fails_on_every_rank(functools.partial(_model, model), make_datamodule,
                               functools.partial(make_strategy, "cp2"), world_size=2,
                               message=f"{mixer}: context parallel splits the sequence over the ranks and routes only "
                                       "F.scaled_dot_product_attention between them")


def test_the_module_that_mixes_tokens_is_found_from_what_it_computes() -> None:
    """Written-out attention (a softmax: the model may load SDPA instead), a convolution padded on both sides, a
    token shift (RWKV's) and a recurrence are found; attention through SDPA and a projection after it are not."""
    from lightning_par.parallel.sequence_mixing import sequence_mixers

    class Eager(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            T = x.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            return (x @ x.transpose(1, 2)).masked_fill(mask, float("-inf")).softmax(-1) @ x

    class Shift(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, 0, 1, -1))

    class Recurrence(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            state, out = torch.zeros_like(x[:, 0]), []
            for t in range(x.shape[1]):
                state = 0.5 * state + x[:, t]
                out.append(state)
            return torch.stack(out, dim=1)

    class Sdpa(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.unsqueeze(1)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)

    class Layer(nn.Module):
        def __init__(self, mixer: nn.Module) -> None:
            super().__init__()
            self.mixer, self.proj = mixer, nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(self.mixer(x))

    conv = zoo.ConvLayer(8)
    model = nn.Module()
    model.layers = nn.ModuleList([Layer(Sdpa()), Layer(Eager()), Layer(Shift()), Layer(Recurrence()), conv])
    x = torch.randn(1, 6, 8, requires_grad=True)

    def run() -> torch.Tensor:
        h = x
        for layer in model.layers:
            h = layer(h)
        return h

    found = sequence_mixers(model, [f"layers.{i}" for i in range(5)], run)
    assert {block: (mixer.module, mixer.softmax) for block, mixer in found.items()} == {
        "layers.1": ("layers.1.mixer", True), "layers.2": ("layers.2.mixer", False),
        "layers.3": ("layers.3.mixer", False), "layers.4": ("layers.4.conv", False)}
