"""``lightning-par check`` at the scale of published runs, on this machine: wall time and host memory of each dry
run, and each rank's peak beside the planner's.

    python benchmarks/dry_run_scale.py [--only NAME] [--json results.json]

The layouts (``benchmarks/dry_run/*.yaml``, 8K context, bf16-mixed, full recomputation):

- ``405b-zero1``: Llama 3 405B on 512 ranks, pp8 x dp8 x tp8 (sequence parallel), ZeRO-1, 8 micro-batches;
- ``405b-zero3``: the same model on 512 ranks, dp64 x tp8, ZeRO-3, one sequence per rank;
- ``70b-zero1``: Llama 3 70B on 256 ranks, pp4 x dp8 x tp8, ZeRO-1, 4 micro-batches;
- ``8b-zero3``: Llama 3 8B on 8 ranks, FSDP2 over 8 gathering bf16 weights, one sequence per rank.

Each runs rank 0's pipeline (one process per stage, at once) and reports, per rank, the model states it keeps and
its peak, with the planner's figures for the same rank (``lightning_par.planner.memory.rank_memory``). The wall
time is the whole command's (reading the config, every rank's process); the host memory is the largest resident
set of any of its processes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_par.cli.check import held_model_states

HERE = Path(__file__).resolve().parent
RUNS = {
    "405b-zero1": ("llama3_405b.yaml", 512, []),
    "405b-zero3": ("llama3_405b.yaml", 512, ["--trainer.strategy.init_args.pipeline_parallel_size=1",
                                             "--trainer.strategy.init_args.zero_stage=3",
                                             "--data.init_args.batch_size=1"]),
    "70b-zero1": ("llama3_70b.yaml", 256, []),
    "8b-zero3": ("llama3_8b.yaml", 8, []),
}
GIB = 1024 ** 3


def run(name: str) -> dict:
    config, world_size, options = RUNS[name]
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        started = time.perf_counter()
        completed = subprocess.run(
            ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "lightning_par.cli", "check", "--config",
             str(HERE / "dry_run" / config), "--world-size", str(world_size), "--json", str(report), *options],
            capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if completed.returncode != 0:
            raise SystemExit(f"{name}: {completed.stderr.strip().splitlines()[-2:]}")
        ranks = json.loads(report.read_text())
    parent = int(completed.stderr.strip().splitlines()[-1]) * 1024  # /usr/bin/time: kilobytes
    return {"name": name, "world_size": world_size, "layout": ranks[0]["layout"], "seconds": seconds,
            "host_peak_gib": max([parent, *(r["host_peak_bytes"] for r in ranks)]) / GIB,
            "ranks": [{"rank": r["rank"], "stages": r["stages"],
                       "states_gib": held_model_states(r) / GIB,
                       "planned_states_gib": r["planned"]["model_states"] / GIB,
                       "peak_gib": r["memory"]["peak"] / GIB, "planned_peak_gib": r["planned"]["total"] / GIB}
                      for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(RUNS))
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    results = [run(name) for name in ([options.only] if options.only else RUNS)]
    for result in results:
        print(f"{result['name']}: {result['layout']} on {result['world_size']} ranks, {result['seconds']:.0f} s, "
              f"host peak {result['host_peak_gib']:.2f} GiB")
        print(f"  {'rank':>5} {'stage':>5} {'states':>8} {'planned':>8} {'peak':>8} {'planned':>8}  GiB")
        for rank in result["ranks"]:
            print(f"  {rank['rank']:>5} {','.join(map(str, rank['stages'])):>5} {rank['states_gib']:>8.2f} "
                  f"{rank['planned_states_gib']:>8.2f} {rank['peak_gib']:>8.2f} {rank['planned_peak_gib']:>8.2f}")
    if options.json is not None:
        options.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
