"""Train the reference Llama model with a hand-written Lightning Fabric loop, in any lightning_par layout.

    python examples/fabric_loop.py                                   # hybrid3d: dp2 x tp2 on 4 CPU processes
    python examples/fabric_loop.py --strategy zero3 --devices 2
    python examples/fabric_loop.py --strategy pipeline_parallel --devices 2

Fabric starts the other processes itself (it re-runs this script). The loop is the one a Fabric user writes; under
pipeline parallel the step is one call, ``fabric.strategy.pipeline_step``, which runs the schedule (docs/fabric.md).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_par  # noqa: F401 - importing registers the strategy names with Fabric and the Trainer
from lightning_par.data.corpus import TokenWindowDataset, load_stdlib_tokens
from lightning_par.models import LlamaLM
from lightning_par.strategies.fabric import Hybrid3DStrategy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default=None, help="a strategy name (default: hybrid3d dp2 x tp2)")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    strategy = args.strategy or Hybrid3DStrategy(data_parallel_size=2, tensor_parallel_size=2)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)

    seq_len = 128
    model = LlamaLM(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=seq_len, learning_rate=2e-3)
    tokens = load_stdlib_tokens("train", max_bytes=1_000_000)
    data = TokenWindowDataset(tokens, seq_len)
    model.example_input_array = data[0][None, :-1]  # tensor and pipeline parallel check their split on it
    optimizer = model.configure_optimizers()["optimizer"]
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))  # sharded over the dp ranks
    pipelined = fabric.strategy.parallel_config.pp > 1

    batches = iter(loader)
    for step in range(args.steps):
        loss = torch.zeros(())
        for index in range(args.accumulate):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=index < args.accumulate - 1):
                if pipelined:  # forward, loss and backward of every micro-batch, in the schedule
                    part = fabric.strategy.pipeline_step(model, batch, accumulate=args.accumulate)
                else:
                    inputs, targets = model.split_batch(batch)
                    part = model.loss_fn(model(inputs), targets)
                    fabric.backward(part / args.accumulate)
            loss += part.detach() / args.accumulate
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the norm of the whole gradient
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step}: loss {float(fabric.all_reduce(loss)):.4f}, gradient norm {float(norm):.3f}")
    fabric.save("fabric_checkpoint", {"model": model, "optimizer": optimizer, "step": args.steps})


if __name__ == "__main__":
    main()
