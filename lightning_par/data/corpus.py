"""Token datasets that need no download.

Two sources of tokens, both plain ``torch.utils.data.Dataset`` objects (no lightning import here):

- a real text corpus: the Python standard library's own ``*.py`` sources, read as bytes
  (vocabulary 256). Every Python install carries it, so tests and examples train on real text
  with nothing fetched from the network;
- a synthetic corpus of arithmetic progressions, random-access and fully deterministic, with
  enough structure that a model's loss visibly drops within a few hundred steps.

Both yield int64 samples of ``seq_len + 1`` tokens; the model splits inputs (``[:-1]``) and
targets (``[1:]``) itself.
"""

from __future__ import annotations

import os
import random
import sysconfig
import zlib
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch.utils.data import Dataset

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_VAL_FRACTION",
    "DOCUMENT_SEPARATOR",
    "SyntheticTokenDataset",
    "TokenWindowDataset",
    "is_validation_document",
    "list_stdlib_documents",
    "load_stdlib_tokens",
    "stdlib_dir",
]

DEFAULT_MAX_BYTES = 8_000_000
DEFAULT_VAL_FRACTION = 0.05
# A blank line between files: byte-level models learn "end of module" from it cheaply.
DOCUMENT_SEPARATOR = b"\n\n"

# Subtrees left out of the corpus: third-party code (site-packages) is not part of the stdlib and
# varies between machines; the test suites, IDLE and lib2to3 are large, repetitive or full of
# deliberately broken fixtures, which adds noise without adding useful text.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})

_SPLITS = {"train": "train", "val": "val", "validation": "val"}


def stdlib_dir() -> Path:
    """The directory holding the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_documents(root: Optional[Path] = None) -> List[Tuple[str, Path]]:
    """All corpus documents as ``(relative POSIX path, absolute path)``, sorted by relative path.

    Sorting by the relative path (not by ``os.walk`` order, which follows the file system) makes
    the corpus identical on every machine with the same Python version.
    """
    root = stdlib_dir() if root is None else Path(root)
    docs: List[Tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into excluded subtrees (saves most of the walk).
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                docs.append((path.relative_to(root).as_posix(), path))
    docs.sort(key=lambda doc: doc[0])
    return docs


def is_validation_document(relative_path: str, val_fraction: float) -> bool:
    """Whether a document belongs to the validation split.

    The decision hashes the document's own path, so adding, removing or reordering other files
    never moves a document from one split to the other.
    """
    return zlib.crc32(relative_path.encode("utf-8")) % 1000 < val_fraction * 1000


def _split_budget(split: str, max_bytes: int, val_fraction: float) -> int:
    """Bytes allotted to ``split``: the validation share of ``max_bytes``, the rest to training."""
    val_bytes = int(max_bytes * val_fraction)
    return val_bytes if split == "val" else max_bytes - val_bytes


def load_stdlib_tokens(
    split: str = "train",
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> torch.Tensor:
    """Byte tokens of the standard-library corpus for one split, as a 1-D ``torch.uint8`` tensor.

    Documents are assigned to a split by :func:`is_validation_document`, taken in sorted path
    order and joined with :data:`DOCUMENT_SEPARATOR`. The two splits share ``max_bytes`` in
    proportion: validation gets ``int(max_bytes * val_fraction)`` bytes, training the rest; the
    last document of each split is cut at its budget. Only the files needed are read, so the
    cost is proportional to the bytes returned.

    Args:
        split: ``"train"`` or ``"val"`` (``"validation"`` is accepted too).
        max_bytes: total byte budget of both splits together (> 0).
        val_fraction: share of documents (and of ``max_bytes``) for validation, in ``[0, 1)``.

    Raises:
        ValueError: on an unknown split or out-of-range sizes.
        FileNotFoundError: when the interpreter ships no ``.py`` sources (e.g. a zipped stdlib).
    """
    if split not in _SPLITS:
        raise ValueError(f"split={split!r} is not one of {sorted(_SPLITS)}")
    split = _SPLITS[split]
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive integer")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1)")

    root = stdlib_dir()
    docs = list_stdlib_documents(root)
    if not docs:
        raise FileNotFoundError(
            f"no Python sources (*.py) found under the standard library directory {str(root)!r}; "
            "this interpreter ships its stdlib compiled or zipped only. Use the synthetic data "
            "source instead (TokenDataModule(source='synthetic'))."
        )

    budget = _split_budget(split, max_bytes, val_fraction)
    want_val = split == "val"
    buf = bytearray()
    for rel, path in docs:
        if len(buf) >= budget:
            break
        if is_validation_document(rel, val_fraction) != want_val:
            continue
        if buf:
            buf += DOCUMENT_SEPARATOR
        buf += path.read_bytes()
    del buf[budget:]

    if not buf:
        # torch.frombuffer refuses empty buffers; an empty split (val_fraction=0) is legitimate.
        return torch.empty(0, dtype=torch.uint8)
    # frombuffer shares memory with the bytearray (no copy) and keeps it alive.
    return torch.frombuffer(buf, dtype=torch.uint8)


class TokenWindowDataset(Dataset):
    """Contiguous, non-overlapping windows over a 1-D token tensor.

    Sample ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` as int64: consecutive samples
    share one boundary token, so over the whole dataset every token after the first is a
    prediction target exactly once. Trailing tokens that do not fill a window are left out.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len!r} must be positive")
        self.tokens = tokens  # kept in its compact dtype (uint8 for bytes); widened per sample
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_len)

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].to(torch.int64)  # (seq_len + 1,)


class SyntheticTokenDataset(Dataset):
    """Deterministic synthetic sequences: arithmetic progressions modulo ``vocab_size``.

    Sample ``i`` starts at a random token and advances by a random step from ``steps``; both are
    drawn from a generator seeded by ``(seed, i)`` alone, so any sample can be read in any order
    on any rank and is the same every time. A model can predict every token after the second
    one exactly, which makes the loss drop fast: a quick end-to-end check that training works.
    """

    def __init__(
        self,
        num_samples: int,
        seq_len: int,
        vocab_size: int = 256,
        seed: int = 0,
        steps: Tuple[int, ...] = (1, 2, 3, 5),
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples!r} must be positive")
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len!r} must be positive")
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size!r} must be at least 2")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed={seed!r} must be in [0, 2**32)")
        if num_samples > 2**32:
            raise ValueError(f"num_samples={num_samples!r} must be at most 2**32")
        if not steps:
            raise ValueError("steps must not be empty")
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.steps = tuple(int(step) for step in steps)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        # Seed and index packed into disjoint bit ranges, so distinct (seed, index) pairs never
        # share a stream and a sample does not depend on which samples were read before. Python's
        # Random uses every bit of a big seed; torch.Generator keeps only the low 32 bits, which
        # would make every seed produce the same data.
        rng = random.Random((self.seed << 32) | index)
        start = rng.randrange(self.vocab_size)
        step = self.steps[rng.randrange(len(self.steps))]
        positions = torch.arange(self.seq_len + 1, dtype=torch.int64)
        return (start + step * positions) % self.vocab_size  # (seq_len + 1,)
