"""The ``lightning-par-export`` command: one file of whole tensors, a Hugging Face model directory, or a LoRA run's
peft adapter directory, from a checkpoint of any layout (docs/checkpoints.md)."""

from __future__ import annotations

import argparse

from lightning_par.checkpoint.format import export_consolidated


def main(argv: list[str] | None = None) -> None:
    """``lightning-par-export CHECKPOINT OUTPUT [--format pt|hf|peft] [--merge]``: see
    :func:`lightning_par.checkpoint.format.export_consolidated`, :func:`lightning_par.checkpoint.huggingface.export_huggingface` and
    :func:`lightning_par.checkpoint.adapters.export_lora`."""
    parser = argparse.ArgumentParser(prog="lightning-par-export",
                                     description=export_consolidated.__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint directory or a full checkpoint file")
    parser.add_argument("output", help="where to write: the {name: tensor} file (pt), or the directory (hf, peft)")
    parser.add_argument("--format", choices=("pt", "hf", "peft"), default="pt",
                        help="pt: one torch.save file of whole tensors; hf: a Hugging Face model directory "
                             "(config.json and safetensors) of an HFCausalLM checkpoint, for from_pretrained; peft: "
                             "the adapters of a LoRA run (adapter_config.json, adapter_model.safetensors), for "
                             "PeftModel.from_pretrained")
    parser.add_argument("--merge", action="store_true",
                        help="with --format hf, for a LoRA run: fold the adapters into the base model's weights")
    parser.add_argument("--base", default=None,
                        help="a LoRA run's base model directory, if it moved since training (checked to hold the "
                             "same model files)")
    parser.add_argument("--trust-pickled-code", action="store_true",
                        help="unpickle Python objects in the checkpoint's metadata (only for a file whose source you "
                             "trust: unpickling can run code)")
    args = parser.parse_args(argv)
    if args.merge and args.format != "hf":
        parser.error(f"--merge writes a Hugging Face model directory: use it with --format hf, not --format "
                     f"{args.format}")
    trusted = False if args.trust_pickled_code else None
    if args.format == "peft" or args.merge:
        from lightning_par.checkpoint.adapters import export_lora

        export_lora(args.checkpoint, args.output, merge=args.merge, weights_only=trusted, base=args.base)
        what = "the merged model as a Hugging Face model directory" if args.merge else "a peft adapter directory"
        print(f"wrote {what} to {args.output}")
        return
    if args.format == "hf":
        from lightning_par.checkpoint.huggingface import export_huggingface

        export_huggingface(args.checkpoint, args.output, weights_only=trusted)
        print(f"wrote a Hugging Face model directory to {args.output}")
        return
    weights = export_consolidated(args.checkpoint, args.output, weights_only=trusted)
    count = sum(t.numel() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({count:,} parameters) to {args.output}")


__all__ = ["main"]


if __name__ == "__main__":
    main()
