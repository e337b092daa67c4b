"""Local text for fine-tuning: documents read with Hugging Face ``datasets``, tokenized with the tokenizer saved in
a model directory, packed into one token stream with EOS between documents.

Packing (concatenating documents, each closed by the end-of-sequence token, and cutting the stream into windows of
the training length) wastes no position on padding; it is how GPT-3 (Brown et al. 2020, section 2.3) and Llama
pre-train and how torchtitan and Megatron-LM feed their data. The windows are ``corpus.TokenWindowDataset``'s.

Sources are read by ``datasets``' own builders (``json`` for ``.json``/``.jsonl``, ``text`` for ``.txt``) or
``datasets.load_from_disk`` for a directory written by ``save_to_disk``; the tokenizer by
``transformers.AutoTokenizer`` from local files only. Every input problem is a ``ValueError`` that names the value,
raised before anything is tokenized. Pure PyTorch plus those libraries: no lightning import.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["TEXT_SUFFIXES", "JSON_SUFFIXES", "SAMPLE_BY", "TOKENIZER_MARKERS", "check_sources", "load_documents", "load_tokenizer",
           "model_vocab_size", "pack_documents", "pretrained_directory", "tokenizer_of"]

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".json", ".jsonl")
SAMPLE_BY = ("document", "paragraph", "line")
# A tokenizer saved by save_pretrained leaves at least one of these in its directory.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_TOKENIZE_CHUNK = 1024  # documents per tokenizer call: bounds the memory of the Python lists it returns


def check_sources(name: str, sources: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The paths of ``sources`` (one path or a list), each an existing non-empty text/JSON file or a ``save_to_disk``
    directory; one kind of file per list. ``name`` is the argument's name for the message."""
    paths = [Path(sources)] if isinstance(sources, (str, os.PathLike)) else [Path(s) for s in sources]
    if not paths:
        raise ValueError(f"{name} is empty: give a .txt, .json or .jsonl file, a list of them, or a directory "
                         "written by datasets' save_to_disk")
    for path in paths:
        if not path.exists():
            raise ValueError(f"{name}: {str(path)!r} does not exist")
        if path.is_dir():
            if len(paths) > 1 or not (path / "dataset_dict.json").is_file() and not (path / "state.json").is_file():
                raise ValueError(f"{name}: {str(path)!r} is a directory but not one written by datasets' "
                                 "save_to_disk (no state.json or dataset_dict.json); give it alone, or give files")
            continue
        if path.suffix not in TEXT_SUFFIXES + JSON_SUFFIXES:
            raise ValueError(f"{name}: {str(path)!r} is neither text ({', '.join(TEXT_SUFFIXES)}) nor JSON lines "
                             f"({', '.join(JSON_SUFFIXES)})")
        if not _has_text(path):  # datasets' json builder raises a bare StopIteration on an empty file
            raise ValueError(f"{name}: {str(path)!r} is empty")
    kinds = {"dir" if p.is_dir() else p.suffix in JSON_SUFFIXES for p in paths}
    if len(kinds) > 1:
        raise ValueError(f"{name} mixes text and JSON files ({[str(p) for p in paths]}): give one kind per list")
    return paths


def _has_text(path: Path, chunk: int = 1 << 20) -> bool:
    """Whether ``path`` holds anything but whitespace (read only as far as the first character that is not)."""
    with path.open("rb") as file:
        while block := file.read(chunk):
            if block.strip():
                return True
    return False


def load_documents(paths: list[Path], *, text_field: str = "text", sample_by: str = "document",
                   split: str = "train", name: str = "data") -> list[str]:
    """The documents of ``paths`` (as :func:`check_sources` returns them): JSON records' ``text_field``, text files
    as a whole (``sample_by='document'``), by blank-line-separated paragraph or by line, or the ``text_field``
    column of a ``save_to_disk`` dataset (its ``split`` when it holds several). Empty documents are left out."""
    import datasets

    if sample_by not in SAMPLE_BY:
        raise ValueError(f"sample_by={sample_by!r} is not one of {list(SAMPLE_BY)}")
    if paths[0].is_dir():
        dataset = datasets.load_from_disk(str(paths[0]))
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise ValueError(f"{name}: the dataset {str(paths[0])!r} has the splits {sorted(dataset)}, not "
                                 f"{split!r}")
            dataset = dataset[split]
    elif paths[0].suffix in JSON_SUFFIXES:
        dataset = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train")
    else:
        dataset = datasets.load_dataset("text", data_files=[str(p) for p in paths], split="train",
                                        sample_by=sample_by)
        text_field = "text"
    if text_field not in dataset.column_names:
        raise ValueError(f"text_field={text_field!r} is not a field of {name} {[str(p) for p in paths]}: its fields "
                         f"are {dataset.column_names}")
    documents = []
    for index, text in enumerate(dataset[text_field]):
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{name}: record {index} has {text_field}={text!r} ({type(text).__name__}), not text")
        if text:
            documents.append(text)
    if not documents:
        raise ValueError(f"{name} {[str(p) for p in paths]} holds no text in the field {text_field!r}")
    return documents


def load_tokenizer(directory: str | os.PathLike) -> Any:
    """The tokenizer saved in ``directory`` (a model directory, usually), read from local files only; it must have
    an end-of-sequence token, which separates packed documents."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"tokenizer={str(directory)!r} is not a directory: give the model directory the tokenizer "
                         "was saved in (tokenizer.save_pretrained)")
    if not any((directory / marker).is_file() for marker in TOKENIZER_MARKERS):
        raise ValueError(f"tokenizer={str(directory)!r} holds no tokenizer (none of {list(TOKENIZER_MARKERS)}): save "
                         "one there with tokenizer.save_pretrained, or point tokenizer at the directory that has it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds for a broken directory
        raise ValueError(f"tokenizer={str(directory)!r} cannot be loaded: {type(error).__name__}: {error}") from error
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {str(directory)!r} has no eos_token, which separates packed documents: "
                         "set eos_token when saving it")
    return tokenizer


def pretrained_directory(module: Any) -> str | None:
    """The pretrained directory of ``module`` (the LightningModule being trained, or None): ``HFCausalLM``'s, where
    the model's tokenizer is saved."""
    pretrained = getattr(module, "hparams", {}).get("pretrained") if module is not None else None
    return None if pretrained is None else str(pretrained)


def model_vocab_size(module: Any) -> int | None:
    """The rows of ``module``'s embedding, where its configuration says (``HFCausalLM``'s ``model_config``, the
    reference model's ``config``), else None."""
    config = getattr(module, "model_config", None) or getattr(module, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    return vocab_size if isinstance(vocab_size, int) else None


def tokenizer_of(module: Any, datamodule: str) -> Any:
    """The tokenizer saved in the pretrained directory of ``module`` (the LightningModule being trained, or None), for
    a ``datamodule`` (its class name, for the message) given no ``tokenizer=``."""
    pretrained = pretrained_directory(module)
    if pretrained is None:
        raise ValueError(f"{datamodule} needs tokenizer= (a directory with a saved tokenizer): "
                         f"{type(module).__name__ if module is not None else 'no model'} has no pretrained directory "
                         "to take it from")
    return load_tokenizer(pretrained)


def pack_documents(documents: Sequence[str], tokenizer: Any) -> torch.Tensor:
    """One 1-D token stream: each document as the tokenizer encodes it (with its special tokens, a beginning-of-
    sequence token for Llama's), followed by the end-of-sequence token unless it already ends with it."""
    eos = tokenizer.eos_token_id
    pieces = []
    for start in range(0, len(documents), _TOKENIZE_CHUNK):
        for ids in tokenizer(list(documents[start:start + _TOKENIZE_CHUNK]), add_special_tokens=True)["input_ids"]:
            pieces.append(torch.tensor(ids if ids and ids[-1] == eos else [*ids, eos], dtype=torch.int64))
    return torch.cat(pieces)

