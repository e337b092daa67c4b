"""Pretraining data at growing corpus sizes: shards prepared once and streamed by each rank
(``StreamingTokenDataModule``) beside the corpus read and tokenized on every rank (``TextDataModule``), in the same
run.

    python benchmarks/data_scale.py [--sizes-mb 4 40 400] [--text-sizes-mb 4 40] [--ranks 2] [--workers 2] [--repeats 3]
                                    [--throughput-mb 40]

First, ``prepare``'s MB per CPU-second beside a plain ``tokenizers`` ``encode_batch`` and litdata's ``optimize`` on
one ``--throughput-mb`` corpus (``benchmarks/prepare_throughput.py``, which also measures memory per worker).

Corpora of JSON lines (the Python standard library's sources, repeated to the size) are tokenized with the tiny BPE
tokenizer of ``examples/make_tiny_pretrained.py``. For each size:

- **prepare**: ``lightning-par prepare`` with ``--workers`` processes, timed: MB of text per second per worker;
- **start**: ``--ranks`` processes at once, each a data-parallel rank of its own, time from building the data module
  to its first training batch and the peak resident memory of the process (fresh interpreters: the figure includes
  torch's and the libraries' own memory, the same for both modules), for the streamed shards and for
  ``TextDataModule`` (which this machine's memory holds at ``--text-sizes-mb`` only: it keeps ~28 bytes per byte of
  text on every rank);
- **loader**: tokens per second one rank's loader hands out over ``--loader-batches`` batches after the first, at
  the reference model's batch (8 x 128) and at a pretraining one (8 x 2048), beside the tokens per second the
  reference model trains at on this machine (one process, same batch), and what one H200 trains the 1B reference
  model at (docs/performance.md: 80,539 tokens/s compiled).

Each start is repeated ``--repeats`` times (median reported); ratios are to the smallest corpus. Files go under ``--workdir`` and are kept for the next run (corpora and
shards are made once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
H200_TOKENS_PER_SECOND = 80_539  # docs/performance.md: lightning-par data_parallel + compile, 1B reference model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[4, 40, 400])
    parser.add_argument("--text-sizes-mb", type=int, nargs="*", default=[4, 40])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--loader-batches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="starts of each module; the median is reported")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lightning-par-data-scale"))
    parser.add_argument("--throughput-mb", type=int, default=40, help="corpus of the throughput table (0: none)")
    return parser


def make_corpus(path: Path, megabytes: int) -> None:
    """JSON lines of standard-library sources, repeated until the file holds ``megabytes`` MB."""
    from lightning_par.data.corpus import list_stdlib_documents

    if path.exists():
        return
    documents = [json.dumps({"text": p.read_text(errors="replace")}) + "\n" for _, p in list_stdlib_documents()]
    written, staging = 0, path.with_suffix(".writing")
    with staging.open("w") as file:
        while written < megabytes * 1_000_000:
            for line in documents:
                file.write(line)
                written += len(line.encode())
                if written >= megabytes * 1_000_000:
                    break
    staging.rename(path)


def tiny_tokenizer(workdir: Path) -> Path:
    """The tiny BPE tokenizer of ``examples/make_tiny_pretrained.py``, saved in ``workdir`` once."""
    sys.path.insert(0, str(REPO / "examples"))
    from make_tiny_pretrained import save_tokenizer

    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = workdir / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        save_tokenizer(tokenizer)
    return tokenizer


# What a rank runs, in a fresh interpreter: the data module to its first batch, then its loader's rate.
RANK = r"""
import json, resource, sys, time
from types import SimpleNamespace
kind, source, tokenizer, replicas, rank, seq_len, batches = sys.argv[1:]
replicas, rank, seq_len, batches = int(replicas), int(rank), int(seq_len), int(batches)
import torch, lightning
from lightning_par.data import StreamingTokenDataModule, TextDataModule
start = time.perf_counter()
if kind == "streamed":
    data = StreamingTokenDataModule(source, seq_len=seq_len, batch_size=8, tokenizer=tokenizer)
else:
    data = TextDataModule(train_files=source, tokenizer=tokenizer, seq_len=seq_len, batch_size=8, val_fraction=0.0)
data.trainer = SimpleNamespace(strategy=SimpleNamespace(
    distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank}), lightning_module=None)
data.setup("fit")
loader = iter(data.train_dataloader())
next(loader)
first = time.perf_counter() - start
start = time.perf_counter()
tokens = sum(next(loader)[:, :-1].numel() for _ in range(batches))
rate = tokens / (time.perf_counter() - start)
print(json.dumps({"first_batch_s": first, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "loader_tokens_per_s": rate}))
"""


def median_start(kind: str, source: str, tokenizer: str, ranks: int, seq_len: int, batches: int,
                 repeats: int) -> dict:
    """Over ``repeats`` starts of ``ranks`` ranks: the median of the slowest rank's time to the first batch, of the
    largest peak RSS and of the slowest loader."""
    starts = [start_ranks(kind, source, tokenizer, ranks, seq_len, batches) for _ in range(repeats)]
    return {"first_batch_s": statistics.median(max(r["first_batch_s"] for r in ranks_) for ranks_ in starts),
            "peak_rss_mb": statistics.median(max(r["peak_rss_mb"] for r in ranks_) for ranks_ in starts),
            "loader_tokens_per_s": statistics.median(min(r["loader_tokens_per_s"] for r in ranks_)
                                                     for ranks_ in starts)}


def start_ranks(kind: str, source: str, tokenizer: str, ranks: int, seq_len: int, batches: int) -> list[dict]:
    """``ranks`` processes at once, each one data-parallel rank; what each measured."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    processes = [subprocess.Popen([sys.executable, "-c", RANK, kind, source, tokenizer, str(ranks), str(rank),
                                   str(seq_len), str(batches)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=environment) for rank in range(ranks)]
    results = []
    for process in processes:
        out, err = process.communicate()
        if process.returncode:
            raise RuntimeError(f"a {kind} rank failed: {err.strip().splitlines()[-1]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def training_rate(seq_len: int = 128, batch: int = 8, steps: int = 20) -> float:
    """Tokens per second the reference model (configs' LlamaLM) trains at in one process on this machine."""
    import torch

    from lightning_par.models import LlamaLM

    module = LlamaLM(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=seq_len)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    batch_tokens = torch.randint(0, 256, (batch, seq_len + 1))
    for step in range(steps + 3):
        if step == 3:
            start = time.perf_counter()
        inputs, targets = module.split_batch(batch_tokens)
        module.loss_fn(module(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return steps * batch * seq_len / (time.perf_counter() - start)


def main() -> None:
    args = build_parser().parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lightning_par.data.prepare import prepare

    tokenizer = tiny_tokenizer(args.workdir)
    if args.throughput_mb:
        from prepare_throughput import throughput_table

        corpus = args.workdir / f"corpus-{args.throughput_mb}mb.jsonl"
        make_corpus(corpus, args.throughput_mb)
        print(throughput_table(corpus, tokenizer, args.workdir, args.workers, args.repeats) + "\n", flush=True)
    rows = []
    for size in args.sizes_mb:
        corpus = args.workdir / f"corpus-{size}mb.jsonl"
        make_corpus(corpus, size)
        shards = args.workdir / f"shards-{size}mb"
        prepared_before = (shards / "prepared.json").exists()
        start = time.perf_counter()
        prepared = prepare(str(corpus), str(shards), str(tokenizer), num_workers=args.workers, verbose=False)
        prepare_s = None if prepared_before else time.perf_counter() - start
        row = {"size_mb": size, "tokens": prepared.tokens["train"], "prepare_s": prepare_s,
               "prepare_mb_per_s_per_worker": None if prepare_s is None else size / prepare_s / args.workers}
        row["streamed"] = median_start("streamed", str(shards), str(tokenizer), args.ranks, 128, args.loader_batches,
                                       args.repeats)
        long = median_start("streamed", str(shards), str(tokenizer), 1, 2048, args.loader_batches // 4, args.repeats)
        row["streamed"]["loader_tokens_per_s_2048"] = long["loader_tokens_per_s"]
        if size in args.text_sizes_mb:
            row["text"] = median_start("text", str(corpus), str(tokenizer), args.ranks, 128, 10, args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
    consumption = training_rate()
    smallest = rows[0]
    print(f"\n{args.ranks} ranks; ratios to the {smallest['size_mb']} MB corpus\n")
    print("| corpus | tokens | prepare (s) | MB/s per worker | streamed: first batch (s) | ratio | peak RSS/rank (MB) "
          "| ratio | TextDataModule: first batch (s) | ratio | peak RSS/rank (MB) | ratio |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for row in rows:
        streamed, text = row["streamed"], row.get("text")
        prepare_cells = ("(prepared earlier)", "") if row["prepare_s"] is None else (
            f"{row['prepare_s']:.1f}", f"{row['prepare_mb_per_s_per_worker']:.2f}")
        text_cells = ("not run",) * 4 if text is None else (
            f"{text['first_batch_s']:.1f}", f"{text['first_batch_s'] / smallest['text']['first_batch_s']:.2f}",
            f"{text['peak_rss_mb']:.0f}", f"{text['peak_rss_mb'] / smallest['text']['peak_rss_mb']:.2f}")
        print(f"| {row['size_mb']} MB | {row['tokens']:,} | {' | '.join(prepare_cells)} | "
              f"{streamed['first_batch_s']:.2f} | "
              f"{streamed['first_batch_s'] / smallest['streamed']['first_batch_s']:.2f} | "
              f"{streamed['peak_rss_mb']:.0f} | {streamed['peak_rss_mb'] / smallest['streamed']['peak_rss_mb']:.2f} | "
              f"{' | '.join(text_cells)} |")
    print(f"\nloader, one rank (tokens/s): 8 x 128: {min(r['streamed']['loader_tokens_per_s'] for r in rows):,.0f}; "
          f"8 x 2048: {min(r['streamed']['loader_tokens_per_s_2048'] for r in rows):,.0f}")
    print(f"the reference model trains at {consumption:,.0f} tokens/s here (8 x 128, one process): the loader hands "
          f"out {min(r['streamed']['loader_tokens_per_s'] for r in rows) / consumption:.0f}x that; one H200 trains "
          f"the 1B reference model at {H200_TOKENS_PER_SECOND:,} tokens/s: "
          f"{min(r['streamed']['loader_tokens_per_s_2048'] for r in rows) / H200_TOKENS_PER_SECOND:.1f}x")


if __name__ == "__main__":
    main()
