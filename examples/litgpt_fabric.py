"""Train litgpt's GPT (Lightning's own LLM library) with a Lightning Fabric loop, in any lightning_par layout.

    python examples/litgpt_fabric.py                                    # tensor parallel over 2 CPU processes
    python examples/litgpt_fabric.py --strategy pipeline_parallel
    python examples/litgpt_fabric.py --strategy zero3 --config pythia-14m

The model is one of litgpt's own configurations (``litgpt.Config.from_name``: no download), with the embedded
corpus's byte vocabulary and --layers blocks. Nothing here names litgpt's layers: tensor parallel pairs them by
what the blocks compute, pipeline parallel cuts the stages from a traced forward (docs/beyond_decoders.md).
Needs litgpt (``pip install --no-deps litgpt``).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightning_par  # noqa: F401 - importing registers the strategy names with Fabric and the Trainer
from lightning_par.data.corpus import TokenWindowDataset, load_stdlib_tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="tensor_parallel", help="a strategy name")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--config", default="pythia-14m", help="a litgpt configuration name")
    parser.add_argument("--layers", type=int, default=4, help="blocks of the model (its configuration's by default)")
    parser.add_argument("--steps", type=int, default=30)
    return parser


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def main() -> None:
    from litgpt import Config
    from litgpt.model import GPT

    args = build_parser().parse_args()
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy)
    fabric.launch()
    fabric.seed_everything(0)

    seq_len = 128
    config = Config.from_name(args.config, n_layer=args.layers, block_size=seq_len, vocab_size=256,
                              padded_vocab_size=256)
    model = GPT(config)
    data = TokenWindowDataset(load_stdlib_tokens("train", max_bytes=1_000_000), seq_len)
    model.example_input_array = data[0][None, :-1]  # tensor and pipeline parallel check their split on it
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))  # sharded over the dp ranks
    pipelined = fabric.strategy.parallel_config.pp > 1

    batches = iter(loader)
    for step in range(args.steps):
        batch = next(batches)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if pipelined:  # forward, loss and backward of every micro-batch, in the schedule
            loss = fabric.strategy.pipeline_step(model, (inputs, targets), loss_fn)
        else:
            loss = loss_fn(model(inputs), targets)
            fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step}: loss {float(fabric.all_reduce(loss.detach())):.4f}, gradient norm {float(norm):.3f}")


if __name__ == "__main__":
    main()
