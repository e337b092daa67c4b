"""``lightning-par prepare``'s throughput beside the two ways of tokenizing a corpus it is built from, on the same
JSON-lines file in the same run: a plain ``tokenizers`` ``encode_batch`` loop (the tokenizer's Rust core alone, one
process) and litdata's ``optimize`` with a tokenizing function (what litgpt's data preparation does); then the peak
memory of a prepare's worker on inputs of every shape.

    python benchmarks/prepare_throughput.py [--size-mb 40] [--repeats 3] [--workers 2] [--memory-mb 20 100 1000]

Each is measured in MB of text per CPU-second (every process's and thread's CPU time: the driver's, the workers',
the tokenizer's threads) and in MB per wall-clock second; ``prepare`` with 1 worker and with ``--workers`` gives
its scaling. The tokenizer is the tiny BPE of ``examples/make_tiny_pretrained.py``. Memory: for each of
``--memory-mb``, a text file of one line and a JSON-lines file of that size are prepared in a fresh process, which
reports the largest peak resident memory of its worker processes (torch and the libraries included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its children that ended."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def measure(run: Callable[[], Any], megabytes: float) -> dict[str, float]:
    wall, cpu = time.perf_counter(), _cpu_seconds()
    run()
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    return {"mb_per_cpu_s": megabytes / cpu, "mb_per_s": megabytes / wall, "cpu_s": cpu, "wall_s": wall}


def encode_batch(corpus: Path, tokenizer: Path) -> None:
    """Every record's tokens and EOS with ``tokenizers`` alone, 1,024 records a call."""
    import numpy as np
    from tokenizers import Tokenizer

    core = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    eos = core.token_to_id("</s>")
    with open(corpus) as file:
        texts = [json.loads(line)["text"] for line in file]
    for start in range(0, len(texts), 1024):
        np.concatenate([np.asarray(encoding.ids + [eos], dtype=np.uint16)
                        for encoding in core.encode_batch(texts[start:start + 1024])])


class _LitdataTokenize:
    """litdata's ``fn`` for one byte range of the JSON lines: its records' tokens and EOS, as one tensor."""

    def __init__(self, corpus: str, tokenizer: str) -> None:
        self.corpus, self.tokenizer_dir, self.tokenizer = corpus, tokenizer, None

    def __call__(self, piece: tuple[int, int]) -> Any:
        import numpy as np
        import torch
        from transformers import AutoTokenizer

        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        with open(self.corpus, "rb") as file:
            file.seek(piece[0])
            lines = file.read(piece[1] - piece[0]).splitlines()
        texts = [json.loads(line)["text"] for line in lines if line.strip()]
        eos = self.tokenizer.eos_token_id
        ids = [np.asarray(tokens + [eos], dtype=np.uint16) for tokens in self.tokenizer(texts)["input_ids"]]
        return torch.from_numpy(np.concatenate(ids))


def litdata_optimize(corpus: Path, tokenizer: Path, output: Path, workers: int) -> None:
    """litdata's ``optimize`` over 4 MB pieces of the file cut at line ends, into 64 MB token shards."""
    from litdata import TokensLoader, optimize

    pieces, start, size = [], 0, corpus.stat().st_size
    with open(corpus, "rb") as file:
        while start < size:
            file.seek(min(start + (4 << 20), size))
            end = min(size, file.tell() + len(file.readline()))
            pieces.append((start, end))
            start = end
    shutil.rmtree(output, ignore_errors=True)
    optimize(fn=_LitdataTokenize(str(corpus), str(tokenizer)), inputs=pieces, output_dir=str(output),
             chunk_bytes="64MB", item_loader=TokensLoader(), num_workers=workers, start_method="fork", verbose=False)


def lightning_par_prepare(corpus: Path, tokenizer: Path, output: Path, workers: int) -> None:
    from lightning_par.data.prepare import prepare

    shutil.rmtree(output, ignore_errors=True)
    prepare(str(corpus), str(output), str(tokenizer), num_workers=workers, verbose=False)


def throughput_table(corpus: Path, tokenizer: Path, workdir: Path, workers: int, repeats: int) -> str:
    """The markdown table of the four runs on ``corpus``, each the median of ``repeats``, taken in turn (a shared
    machine's CPU-seconds vary by 20% from minute to minute)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import litdata  # noqa: F401 - imported before any run is timed: each is measured at work, not starting
    import transformers  # noqa: F401

    import lightning_par.data.prepare  # noqa: F401

    megabytes = corpus.stat().st_size / 1e6
    runs = {"tokenizers encode_batch (1 process)": lambda: encode_batch(corpus, tokenizer),
            f"litdata optimize ({workers} workers)": lambda: litdata_optimize(corpus, tokenizer,
                                                                              workdir / "litdata-out", workers),
            "lightning-par prepare (1 worker)": lambda: lightning_par_prepare(corpus, tokenizer,
                                                                             workdir / "prepare-out", 1),
            f"lightning-par prepare ({workers} workers)": lambda: lightning_par_prepare(corpus, tokenizer,
                                                                                       workdir / "prepare-out",
                                                                                       workers)}
    measured = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            measured[name].append(measure(run, megabytes))
    results = {name: {key: statistics.median(result[key] for result in results_) for key in results_[0]}
               for name, results_ in measured.items()}
    base = results["tokenizers encode_batch (1 process)"]
    one = results["lightning-par prepare (1 worker)"]
    lines = [f"{megabytes:.0f} MB of JSON lines, medians of {repeats}; ratios to encode_batch's MB per CPU-second, "
             "and to prepare with 1 worker's wall time", "",
             "| run | MB per CPU-s | ratio | MB/s (wall) | speed-up over 1 worker |", "|---|--:|--:|--:|--:|"]
    for name, result in results.items():
        speedup = f"{one['wall_s'] / result['wall_s']:.2f}" if name.startswith("lightning-par") else ""
        lines.append(f"| {name} | {result['mb_per_cpu_s']:.2f} | {result['mb_per_cpu_s'] / base['mb_per_cpu_s']:.2f} "
                     f"| {result['mb_per_s']:.2f} | {speedup} |")
    return "\n".join(lines)


# A prepare in a fresh process, printing the peak RSS of its largest worker (MB) and the tokens it made.
PREPARE = r"""
import json, resource, sys
from lightning_par.data.prepare import prepare
prepared = prepare(sys.argv[1], sys.argv[2], sys.argv[3], num_workers=int(sys.argv[4]), verbose=False)
print(json.dumps({"worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                  "tokens": prepared.tokens["train"]}))
"""


def make_one_line(path: Path, megabytes: int) -> None:
    """A text file of ``megabytes`` MB of words and spaces, without a line end: one document, one line."""
    import random

    from make_tiny_pretrained import LINES

    if path.exists():
        return
    words, rng = [word for line in LINES for word in line.split()], random.Random(0)
    staging = path.with_suffix(".writing")
    with staging.open("w") as file:
        for _ in range(megabytes * 1_000_000 // 60_000):
            file.write(" ".join(rng.choice(words) for _ in range(10_000)) + " ")
    staging.rename(path)


def memory_table(sizes: list[int], tokenizer: Path, workdir: Path, workers: int) -> str:
    from data_scale import make_corpus

    lines = ["| input | tokens | peak RSS per worker (MB) |", "|---|--:|--:|"]
    for size in sizes:
        for kind, path, make in (("text file, one line", workdir / f"one-line-{size}mb.txt", make_one_line),
                                 ("JSON lines", workdir / f"corpus-{size}mb.jsonl", make_corpus)):
            make(path, size)
            output = workdir / "memory-out"
            shutil.rmtree(output, ignore_errors=True)
            result = subprocess.run([sys.executable, "-c", PREPARE, str(path), str(output), str(tokenizer),
                                     str(workers)], capture_output=True, text=True, check=True)
            measured = json.loads(result.stdout.strip().splitlines()[-1])
            lines.append(f"| {path.stat().st_size / 1e6:,.0f} MB {kind} | {measured['tokens']:,} | "
                         f"{measured['worker_rss_mb']:.0f} |")
            shutil.rmtree(output, ignore_errors=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-mb", type=int, nargs="*", default=[20, 100, 1000])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lightning-par-data-scale"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from data_scale import make_corpus, tiny_tokenizer

    tokenizer = tiny_tokenizer(args.workdir)
    corpus = args.workdir / f"corpus-{args.size_mb}mb.jsonl"
    make_corpus(corpus, args.size_mb)
    print(throughput_table(corpus, tokenizer, args.workdir, args.workers, args.repeats))
    if args.memory_mb:
        print(f"\n{args.workers} workers\n")
        print(memory_table(args.memory_mb, tokenizer, args.workdir, args.workers))


if __name__ == "__main__":
    main()
