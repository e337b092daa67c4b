"""Code that users already have, written for Lightning's own strategies: the modules of ``lightning.pytorch.demos``
as Lightning ships them, a hand-written LightningModule whose ``training_step`` calls ``self.model``, one whose
``forward`` takes two inputs, a Hugging Face model whose step hands it its labels, and litgpt's pretraining flow under
Fabric (``init_module(empty_init=True)``, litgpt's own ``initialize_weights``). Nothing here follows lightning_par's
model contract (``split_batch``, ``loss_fn``); ``tests/test_clients.py`` trains each under lightning_par's strategies
and under Lightning's ``ddp``, changing only the strategy name. Sizes are small and the data is random tokens: the
demos' own data loaders download WikiText-2, so each client is handed a loader of the same shape.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 64
SEQ = 16
SAMPLES = 256  # 20 steps of a global batch of 8 are 160 samples: one epoch


# ------------------------------------------------------------------------------------------ hand-written
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim), \
            FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """A small decoder written by hand: embedding, blocks, norm, head."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        if positions is not None:
            x = x + self.positions(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class CallsItsModel(L.LightningModule):
    """No ``forward`` of its own: the step calls its model, as most LightningModules do."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TwoInputs(L.LightningModule):
    """A ``forward(tokens, positions)``: the step passes positions of its own making (learned position embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder()
        self.model.positions = nn.Embedding(SEQ, 32)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, positions)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        inputs = tokens[:, :-1]
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        return F.cross_entropy(self(inputs, positions).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class PlainPairs(L.LightningModule):
    """A plain module: ``forward(inputs) -> logits``, batches of ``(inputs, targets)`` and the loss written in its
    step, as Lightning's docs write one."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).reshape(-1, VOCAB), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class HuggingFaceByHand(L.LightningModule):
    """A Hugging Face model in a LightningModule written by hand, as its users write one: the step gives the model its
    labels and returns the loss the model computes (the output's first item)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.AutoConfig.for_model(model_type="llama", vocab_size=VOCAB, hidden_size=32,
                                                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   num_key_value_heads=2, max_position_embeddings=32)
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class HuggingFaceDictBatches(HuggingFaceByHand):
    """The same model fed as a Hugging Face collator feeds it: dicts of right-padded ``input_ids``, their
    ``attention_mask``, and ``labels`` that are -100 on the padding; the step hands the model the whole dict."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss


class HuggingFaceCutsItsBatch(HuggingFaceByHand):
    """The model's inputs cut from the batch in the step: what a pipeline's split cannot repeat."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


def _padded_dicts(tokens: torch.Tensor, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Each row cut to a random length (half of it or more) and padded on the right with token 0."""
    samples = []
    for row in tokens:
        length = int(torch.randint(len(row) // 2, len(row) + 1, (), generator=generator))
        mask = (torch.arange(len(row)) < length).long()
        samples.append({"input_ids": row * mask, "attention_mask": mask, "labels": row.masked_fill(mask == 0, -100)})
    return samples


# ------------------------------------------------------------------------------------------ Lightning's demos
def demo_transformer(dropout: float = 0.2) -> L.LightningModule:
    """``lightning.pytorch.demos.LightningTransformer`` (``forward(inputs, target)``, ``nn.Transformer`` inside),
    its network made small."""
    from lightning.pytorch.demos import LightningTransformer, Transformer

    module = LightningTransformer(vocab_size=VOCAB)
    module.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=128, nlayers=1, dropout=dropout)
    module.prepare_data = lambda: None  # it downloads WikiText-2: the clients get random tokens instead
    return module


def demo_lstm() -> L.LightningModule:
    """``lightning.pytorch.demos.lstm.LightningLSTM`` (the step calls ``self.model`` and keeps its hidden state across
    batches; dropout 0.2; SGD at 20), its LSTM made small."""
    from lightning.pytorch.demos.lstm import LightningLSTM, SimpleLSTM

    module = LightningLSTM(vocab_size=VOCAB)
    module.model = SimpleLSTM(vocab_size=VOCAB, ninp=32, nhid=32, nlayers=2)
    module.prepare_data = lambda: None
    return module


def demo_boring() -> L.LightningModule:
    """``lightning.pytorch.demos.BoringModel`` as it is."""
    from lightning.pytorch.demos import BoringModel

    return BoringModel()


TRAINER_CLIENTS = {"demo_transformer": demo_transformer, "demo_transformer_without_dropout":
                   lambda: demo_transformer(dropout=0.0), "demo_lstm": demo_lstm, "demo_boring": demo_boring,
                   "calls_its_model": CallsItsModel, "two_inputs": TwoInputs, "hf_by_hand": HuggingFaceByHand,
                   "hf_dict_batches": HuggingFaceDictBatches, "hf_cuts_its_batch": HuggingFaceCutsItsBatch,
                   "plain_pairs": PlainPairs}


def client_data(name: str, batch_size: int) -> DataLoader:
    """The loader each client reads (random data of the shape its own loader gives)."""
    generator = torch.Generator().manual_seed(0)
    if name == "demo_boring":  # RandomDataset(32, ...): one vector per sample
        return DataLoader(torch.randn(SAMPLES, 32, generator=generator), batch_size=batch_size)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=generator)
    if name.startswith(("demo_", "plain_pairs")):  # WikiText2: (inputs, target) pairs
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)
    if name == "hf_dict_batches":
        return DataLoader(_padded_dicts(tokens, generator), batch_size=batch_size)
    return DataLoader(TensorDataset(tokens), batch_size=batch_size)


# ------------------------------------------------------------------------------------------ litgpt under Fabric
LITGPT_CONFIG = dict(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_query_groups=2,
                     n_embd=32, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                     mlp_class_name="LLaMAMLP", intermediate_size=64)


def litgpt_pretraining(fabric: L.Fabric, steps: int, batch_size: int, *, example_input: bool) -> tuple[list[float],
                                                                                                        Any]:
    """litgpt's pretraining flow (``litgpt/pretrain.py``): the model built with ``empty_init=True`` and initialised by
    litgpt's ``initialize_weights``, set up, then a plain loop; returns each step's loss (the mean over the data-parallel
    ranks) and the model. ``example_input``: the line tensor parallel asks of a Fabric model
    (``model.example_input_array``)."""
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights

    fabric.seed_everything(42)
    config = Config(**LITGPT_CONFIG)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    tokens = client_data("litgpt", batch_size).dataset.tensors[0]
    if example_input:
        model.example_input_array = tokens[:batch_size, :-1]
    model = fabric.setup(model)
    return _train(fabric, model, tokens, steps, batch_size, lambda batch: model(batch))


def two_inputs_loop(fabric: L.Fabric, steps: int, batch_size: int, *, example_input: bool) -> tuple[list[float], Any]:
    """A plain Fabric loop around a model whose ``forward(tokens, positions)`` takes two inputs; ``example_input``: the
    line a layout that runs the model at set-up asks of a Fabric model, here a tuple of both inputs."""
    fabric.seed_everything(42)
    model = Decoder()
    model.positions = nn.Embedding(SEQ, 32)
    tokens = client_data("two_inputs", batch_size).dataset.tensors[0]
    positions = torch.arange(SEQ).expand(batch_size, SEQ)
    if example_input:
        model.example_input_array = (tokens[:batch_size, :-1], positions)
    model = fabric.setup(model)
    return _train(fabric, model, tokens, steps, batch_size,
                  lambda batch: model(batch, positions.to(batch.device)))


def _train(fabric: L.Fabric, model: Any, tokens: torch.Tensor, steps: int, batch_size: int,
           logits_of: Any) -> tuple[list[float], Any]:
    """A plain Fabric loop of ``steps`` SGD steps over ``tokens`` (next-token loss on ``logits_of(inputs)``); each
    step's loss (the mean over the data-parallel ranks) and the model."""
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(tokens), batch_size=batch_size))
    losses = []
    for step, (batch,) in zip(range(steps), loader):
        loss = F.cross_entropy(logits_of(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return losses, model


FABRIC_CLIENTS = {"litgpt": litgpt_pretraining, "two_inputs": two_inputs_loop}
