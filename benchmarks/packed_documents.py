"""What keeping packed documents apart costs: forward and backward of packed windows with and without
``HFCausalLM(packed_documents=True)``, in one process, side by side in the same run.

    python benchmarks/packed_documents.py [--seq-len 1024] [--batch 4] [--mean-document 128] [--steps 5] [--rounds 2]

A Llama of 4 blocks (hidden 256, 8 heads) from transformers with random weights; each window holds documents of
random lengths (exponential, mean ``--mean-document`` tokens) closed by the separator. Masked, transformers builds
the block-diagonal mask from the restarting positions and SDPA runs with it; unmasked, SDPA runs causal
(``is_causal``), which lets it pick its fused kernels. Rounds alternate the order so that drift on a shared machine
hits both alike; reported: median step time of each and the ratio masked / unmasked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SEPARATOR = 2


def windows(batch: int, seq_len: int, mean_document: int, generator: torch.Generator) -> torch.Tensor:
    """Packed windows of ``seq_len + 1`` tokens: documents of exponential lengths, each closed by the separator."""
    tokens = torch.randint(4, 1024, (batch, seq_len + 1), generator=generator)
    for row in tokens:
        position = 0
        while position < seq_len:
            length = max(2, int(torch.empty(1).exponential_(1 / mean_document, generator=generator)))
            position = min(position + length, seq_len)
            row[position] = SEPARATOR
    return tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--mean-document", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    return parser


def main() -> None:
    args = build_parser().parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_par.models.packing import cross_document_targets, document_positions

    config = AutoConfig.for_model("llama", vocab_size=1024, hidden_size=256, intermediate_size=688,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    batch = windows(args.batch, args.seq_len, args.mean_document, torch.Generator().manual_seed(0))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    documents = int((inputs == SEPARATOR).sum()) + args.batch

    def step(masked: bool) -> float:
        start = time.perf_counter()
        if masked:
            logits = model(input_ids=inputs, position_ids=document_positions(inputs, SEPARATOR), use_cache=False).logits
            wanted = cross_document_targets(inputs, targets, SEPARATOR)
        else:
            logits, wanted = model(input_ids=inputs, use_cache=False).logits, targets
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), wanted.flatten(), ignore_index=-100).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for masked in ((False, True) if round_ % 2 == 0 else (True, False)):
            step(masked)  # warm-up
            times[masked] += [step(masked) for _ in range(args.steps)]
    unmasked, masked = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.batch} windows of {args.seq_len} tokens, {documents} documents (mean {args.seq_len * args.batch / documents:.0f} "
          f"tokens), {torch.get_num_threads()} threads")
    print(f"unmasked packing: {unmasked * 1e3:.1f} ms per step")
    print(f"documents masked: {masked * 1e3:.1f} ms per step")
    print(f"ratio masked / unmasked: {masked / unmasked:.2f}")


if __name__ == "__main__":
    main()
