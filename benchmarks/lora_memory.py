"""Model-state bytes per rank of LoRA against full fine-tuning, counted on a meta-device model (nothing allocated).

    python benchmarks/lora_memory.py [--ranks 8] [--r 8] [--targets q_proj k_proj v_proj o_proj]

Builds Llama 3.2 1B's architecture (hidden 2048, 16 layers, 32 heads, 8 key/value heads, SwiGLU 8192, vocabulary
128,256, head tied to the embedding) with transformers on the meta device, puts peft's LoRA adapters on it as
``HFCausalLM(lora=...)`` does, and counts what each of ``--ranks`` ZeRO-3 ranks holds in fp32 with AdamW: every
weight's shard, and gradients and two optimizer states for the trainable parameters' shards only (what
``tests/test_lora_checkpoints.py`` asserts on real ranks). Prints the table of docs/finetuning.md.
"""

from __future__ import annotations

import argparse

import torch

LLAMA_3_2_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
BYTES = 4  # fp32 weights, gradients and AdamW states


def model_states(trainable: int, total: int, ranks: int) -> dict[str, float]:
    """Bytes per ZeRO-3 rank: parameters, gradients and AdamW's two states, each sharded over ``ranks``."""
    return {"parameters": BYTES * total / ranks, "gradients": BYTES * trainable / ranks,
            "optimizer": 2 * BYTES * trainable / ranks}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    return parser


def main() -> None:
    args = build_parser().parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_par.checkpoint.adapters import lora_settings, with_lora

    arguments = dict(LLAMA_3_2_1B)
    config = AutoConfig.for_model(arguments.pop("model_type"), **arguments)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    model = with_lora(model, lora_settings({"r": args.r, "alpha": 2 * args.r, "target_modules": args.targets}))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    full = model_states(total, total, args.ranks)
    lora = model_states(adapters, total + adapters, args.ranks)
    print(f"Llama 3.2 1B ({total / 1e9:.2f} B parameters), ZeRO-3 over {args.ranks} ranks, fp32 + AdamW, bytes per rank")
    print("| | parameters | gradients | AdamW states | total |")
    print("|---|---|---|---|---|")
    for name, states in (("full fine-tuning", full),
                         (f"LoRA r={args.r} on {', '.join(args.targets)} ({adapters / 1e6:.2f} M trainable)", lora)):
        print(f"| {name} | " + " | ".join(_size(v) for v in states.values()) + f" | {_size(sum(states.values()))} |")
    print(f"ratio LoRA / full: {sum(lora.values()) / sum(full.values()):.3f}")


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


if __name__ == "__main__":
    main()
