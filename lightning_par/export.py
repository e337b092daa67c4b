"""The ``lightning-par-export`` command: one file of whole tensors, or a Hugging Face model directory, from a
checkpoint of any layout (docs/checkpoints.md)."""

from __future__ import annotations

import argparse

from lightning_par.checkpoint import export_consolidated


def main(argv: list[str] | None = None) -> None:
    """``lightning-par-export CHECKPOINT OUTPUT [--format hf]``: see
    :func:`lightning_par.checkpoint.export_consolidated` and :func:`lightning_par.huggingface.export_huggingface`."""
    parser = argparse.ArgumentParser(prog="lightning-par-export",
                                     description=export_consolidated.__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint directory or a full checkpoint file")
    parser.add_argument("output", help="where to write: the {name: tensor} file (pt), or the model directory (hf)")
    parser.add_argument("--format", choices=("pt", "hf"), default="pt",
                        help="pt: one torch.save file of whole tensors; hf: a Hugging Face model directory "
                             "(config.json and safetensors) of an HFCausalLM checkpoint, for from_pretrained")
    parser.add_argument("--trust-pickled-code", action="store_true",
                        help="unpickle Python objects in the checkpoint's metadata (only for a file whose source you "
                             "trust: unpickling can run code)")
    args = parser.parse_args(argv)
    trusted = False if args.trust_pickled_code else None
    if args.format == "hf":
        from lightning_par.huggingface import export_huggingface

        export_huggingface(args.checkpoint, args.output, weights_only=trusted)
        print(f"wrote a Hugging Face model directory to {args.output}")
        return
    weights = export_consolidated(args.checkpoint, args.output, weights_only=trusted)
    count = sum(t.numel() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({count:,} parameters) to {args.output}")


__all__ = ["main"]


if __name__ == "__main__":
    main()
