"""Grouped experts against the per-expert loop, side by side in one process.

One mixture-of-experts layer (``lightning_par.models.moe.MoEFeedForward``), forward and backward, with its local
experts run as one grouped GEMM per projection (``torch._grouped_mm``) and as one matmul per expert; the two are
timed alternately, so a change in the machine's load touches both. Prints the median step of each and the ratio.

    python benchmarks/grouped_experts.py [--dim 512] [--hidden 1024] [--experts 8] [--top-k 2] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_par.models import moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast there: the grouped kernels')")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    layer = moe.MoEFeedForward(args.dim, args.hidden, args.experts, args.top_k).to(device)
    layer.init_weights(0.02, 0.02)
    x = torch.randn(1, args.tokens, args.dim, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    outputs = {}
    for grouped in (True, False):  # the two ways compute the same (bf16: within its rounding)
        moe.GROUPED_MM = grouped
        with autocast:
            outputs[grouped] = layer(x).float()
    difference = (outputs[True] - outputs[False]).abs().max().item() / outputs[False].abs().max().item()
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.steps + 2):
        for grouped in (True, False):
            moe.GROUPED_MM = grouped
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with autocast:
                loss = layer(x).float().square().mean()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 2:  # two warm-up rounds
                times[grouped].append(time.perf_counter() - start)
    grouped, loop = statistics.median(times[True]), statistics.median(times[False])
    where = f"{torch.get_num_threads()} CPU threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"MoE layer, {args.tokens} tokens x top-{args.top_k} of {args.experts} experts, dim {args.dim}, hidden "
          f"{args.hidden}, forward + backward on {where}; outputs differ by {difference:.1e} of their largest:")
    print(f"  grouped GEMM {grouped * 1e3:.1f} ms, per-expert loop {loop * 1e3:.1f} ms: grouped is "
          f"{loop / grouped:.2f}x the loop's speed")


if __name__ == "__main__":
    main()
