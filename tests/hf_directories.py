"""Tiny Hugging Face model directories and corpora for the tests: ``examples/make_tiny_pretrained.py``'s, which
the fine-tuning docs use too (``save_pretrained``; nothing is downloaded)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from make_tiny_pretrained import (  # noqa: E402
    FAMILIES,
    LINES,
    VOCAB,
    make_model_directory,
    save_tokenizer,
    write_corpus,
    write_instructions,
)

__all__ = ["FAMILIES", "LINES", "VOCAB", "make_model_directory", "save_tokenizer", "write_corpus", "write_instructions"]
