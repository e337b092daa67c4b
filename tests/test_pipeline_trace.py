"""What runs outside the blocks, read from one traced forward: the roles pipeline stages are cut by, and the
networks a pipeline cannot reproduce, refused with the reason (single process, no ranks)."""

from __future__ import annotations

import pytest
from installed import require
import torch
import zoo
from torch import nn

from lightning_par.parallel.pipeline.trace import trace_network
from lightning_par.parallel.model_map import derive_model_map


def test_roles_of_nanogpt() -> None:
    """Learned positions and the tied embedding run before the first block (stage 0); the final norm and the
    head, which is the embedding again, after the last (the last stage): the tie spans both."""
    module = zoo.make_model("nanogpt")
    model_map = derive_model_map(module)
    trace = trace_network(module.model, model_map.block_names(module), torch.zeros(1, 8, dtype=torch.long), root=module)
    assert {"model.transformer.wte.weight", "model.transformer.wpe.weight"} <= trace.prelude
    assert {"model.transformer.ln_f.weight", "model.lm_head.weight", "model.transformer.wte.weight"} <= trace.postlude
    assert not trace.shared
    assert trace.outside["model.transformer.wte"].kind == "zeros"  # later stages stand in with zeros
    assert trace.outside["model.lm_head"].kind == "unused"  # called after the blocks only
    assert trace.block_call.argument == 0 and trace.block_call.output_index is None


def test_block_arguments_of_a_hugging_face_model_are_computed_on_every_stage() -> None:
    """Gemma 2 scales the embedding before the first block and soft-caps the logits after the head; the rotary
    tables and masks every block receives come from the tokens' shape, not from the hidden states."""
    require("transformers")
    module = zoo.make_model("gemma2")
    model_map = derive_model_map(module)
    trace = trace_network(module.model, model_map.block_names(module), torch.zeros(1, 8, dtype=torch.long), root=module)
    assert "model.model.embed_tokens.weight" in trace.prelude and "model.model.norm.weight" in trace.postlude
    assert trace.block_call.argument in (0, "hidden_states")


class _Network(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        first = h = self.embed(tokens)
        for index, block in enumerate(self.blocks):
            if self.variant == "between" and index == 1:
                h = h * 2.0  # code between two blocks
            h = block(h, scale=h.mean() if self.variant == "argument" else None)
        if self.variant == "skip":
            h = h + first  # the output uses the embedding's activations too
        return self.head(h)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(x) * (1.0 if scale is None else scale)


def test_code_between_blocks_keeps_stages_from_starting_there() -> None:
    """Code between two blocks runs inside a stage, but no stage may start right after it: the split that would
    is refused, naming the split points that avoid it."""
    from lightning_par.parallel.pipeline.split import _check_boundaries

    trace = trace_network(_Network("between"), ["blocks.0", "blocks.1"], torch.zeros(1, 4, dtype=torch.long))
    assert trace.changed == {1}
    blocks = [f"blocks.{i}" for i in range(4)]
    _check_boundaries(blocks, [2, 2], frozenset({1}))  # stages start at blocks 0 and 2: fine
    with pytest.raises(ValueError, match=r"between 'blocks.0' and 'blocks.1' the network changes the hidden states.*"
                                         r"split_points \(any of \['blocks.2', 'blocks.3'\]"):
        _check_boundaries(blocks, [1, 3], frozenset({1}))


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("skip", "the network's output uses more than the last block's output"),
        ("argument", "an argument of block 'blocks.0' besides its hidden states is computed from the hidden states"),
    ],
)
def test_networks_a_pipeline_cannot_reproduce_are_refused(variant: str, message: str) -> None:
    network = _Network(variant)
    with pytest.raises(ValueError, match=message):
        trace_network(network, ["blocks.0", "blocks.1"], torch.zeros(1, 4, dtype=torch.long))
    trace_network(_Network("plain"), ["blocks.0", "blocks.1"], torch.zeros(1, 4, dtype=torch.long))  # fine


def test_the_trace_runs_on_the_meta_device() -> None:
    """A model built with Trainer.init_module(empty_init=True) is traced without allocating it."""
    with torch.device("meta"):
        module = zoo.make_model("nanogpt")
    model_map = derive_model_map(module)
    trace = trace_network(module.model, model_map.block_names(module), torch.zeros(1, 8, dtype=torch.long, device="meta"),
                          root=module)
    assert "model.transformer.wpe.weight" in trace.prelude


class _Temperature(nn.Module):
    """A model whose forward scales the network's logits: the stages, which run the network, would skip it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Network("plain")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens) / 2.0


def test_work_the_model_adds_after_the_network_is_refused() -> None:
    module = _Temperature()
    with pytest.raises(ValueError, match=r"the stages run _Network and hand its output to loss_fn, but "
                                         r"_Temperature.forward returns something else"):
        trace_network(module.model, ["model.blocks.0", "model.blocks.1"], torch.zeros(1, 4, dtype=torch.long),
                      root=module)
