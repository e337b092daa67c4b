"""Grouped experts against the per-expert loop, side by side in one process (issue 20, item 4).

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
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = moe.MoEFeedForward(args.dim, args.hidden, args.experts, args.top_k)
    layer.init_weights(0.02, 0.02)
    x = torch.randn(1, args.tokens, args.dim)
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.steps + 2):
        for grouped in (True, False):
            moe.GROUPED_MM = grouped
            start = time.perf_counter()
            layer(x).square().mean().backward()
            if step >= 2:  # two warm-up rounds
                times[grouped].append(time.perf_counter() - start)
    grouped, loop = statistics.median(times[True]), statistics.median(times[False])
    print(f"MoE layer, {args.tokens} tokens x top-{args.top_k} of {args.experts} experts, dim {args.dim}, hidden "
          f"{args.hidden}, forward + backward on {torch.get_num_threads()} threads:")
    print(f"  grouped GEMM {grouped * 1e3:.1f} ms, per-expert loop {loop * 1e3:.1f} ms: grouped is "
          f"{loop / grouped:.2f}x the loop's speed")


if __name__ == "__main__":
    main()
