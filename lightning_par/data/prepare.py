"""Pretraining data prepared once: text tokenized into token shards that every run then streams
(``lightning_par.data.streaming``), instead of every rank reading and tokenizing the whole corpus at every start.

    lightning-par prepare --input corpus/ --output data/corpus --tokenizer path/to/model --val-fraction 0.01

The shards are litdata's (``litdata.optimize`` with its ``TokensLoader``: chunk files of tokens and an
``index.json``), written by many worker processes in parts that are appended whole, so that a run that stopped is
resumed at the first part it did not finish (``prepare.progress.json``), to a local directory or to any
object-store URL litdata writes (``s3://``, ``gs://``, ...).
Pretokenized shards streamed by rank are how Megatron-LM (its indexed datasets), nanotron/datatrove and litgpt feed
pretraining at scale; docs/data.md says how to use them.

What one ``prepare`` writes::

    OUTPUT/train/   index.json, chunk-*.bin   the training documents
    OUTPUT/val/     index.json, chunk-*.bin   the held-out documents (with val_fraction > 0)
    OUTPUT/prepared.json                 the tokenizer's fingerprint, vocabulary and EOS, the token dtype, counts

``prepared.json`` is written last: a directory without it was not prepared to the end, and is refused by the
data module and resumed by the next ``prepare``. Each document is its tokens (with the tokenizer's special tokens, a
beginning-of-sequence token for Llama's) followed by the end-of-sequence token, which is where packed documents are
kept apart (``lightning_par.models.packing``). Tokens are stored as uint16 when the vocabulary has at most 65,536
entries, else int32.

Inputs: ``stdlib`` (the Python standard library's sources, the corpus ``TokenDataModule`` reads), text files (one
document each: ``.txt``, ``.text``, ``.md``), JSON lines (a record's ``text_field`` per document: ``.json``,
``.jsonl``), parquet files (a row's ``text_field``), a directory written by ``datasets``' ``save_to_disk`` (its
``train`` split when it holds several), or a directory of such files. Large JSON-lines files, parquet row groups and
datasets are cut into pieces, so that the work spreads over the workers and memory stays that of one piece. A
document goes to the validation split by a hash of where it is (file and offset), so the split never depends on how
the work was cut or on the number of workers. Pure Python plus litdata and the tokenizer's library: no lightning
import.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["BYTES", "METADATA", "SPLITS", "ByteTokenizer", "DocumentTokenizer", "PreparedData", "is_prepared",
           "load_document_tokenizer", "main", "prepare", "read_prepared", "work_items"]

METADATA = "prepared.json"
SPLITS = ("train", "val")
BYTES = "bytes"  # the byte tokenizer's name (the reference model's vocabulary of 256)
FORMAT = 1  # of prepared.json
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".json", ".jsonl")
PARQUET_SUFFIXES = (".parquet",)
_PIECE_ROWS = 20_000  # a datasets piece
# A JSON-lines piece is a quarter of a shard's bytes of text: litdata starts a shard file only between two items (a
# piece's tokens), so shards stay near their size and a big file spreads over the workers and over many shards.
_TEXT_PER_SHARD = 4
# A part of the work is this many pieces per worker, appended whole: what a stopped prepare may do again.
_ITEMS_PER_WORKER_PART = 16
_ENCODE_BATCH = 1024  # documents per tokenizer call
_UINT16_VOCAB = 1 << 16


# ----------------------------------------------------------------------------------------------- tokenizers
class DocumentTokenizer:
    """What prepare asks of a tokenizer: each document's ids closed by the end-of-sequence token, the vocabulary
    size, and a fingerprint that changes whenever the ids a text gets could change."""

    name: str
    vocab_size: int
    eos_token_id: int
    fingerprint: str

    def encode(self, documents: Sequence[str | bytes]) -> list[list[int]]:
        raise NotImplementedError


class ByteTokenizer(DocumentTokenizer):
    """UTF-8 bytes as tokens (vocabulary 256, the reference model's), each document closed by byte 0 (NUL), which no
    text file holds; a document that does is refused, since its NUL would read as a document boundary."""

    name = BYTES
    vocab_size = 256
    eos_token_id = 0
    fingerprint = "bytes:utf-8:eos=0"

    def encode(self, documents: Sequence[str | bytes]) -> list[list[int]]:
        encoded = []
        for document in documents:
            data = document.encode("utf-8") if isinstance(document, str) else document
            if b"\0" in data:
                raise ValueError(f"a document holds byte 0, which the bytes tokenizer keeps for the end of a document: "
                                 f"{data[:60]!r}...")
            encoded.append([*data, 0])
        return encoded


class _HuggingFaceTokenizer(DocumentTokenizer):
    """A tokenizer saved with ``save_pretrained`` (a model directory), as ``TextDataModule`` packs documents."""

    def __init__(self, directory: str) -> None:
        from lightning_par.data.text import load_tokenizer

        self.tokenizer = load_tokenizer(directory)
        self.name = str(directory)
        self.vocab_size = len(self.tokenizer)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.fingerprint = _fingerprint(self.tokenizer)

    def encode(self, documents: Sequence[str | bytes]) -> list[list[int]]:
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in documents]
        eos = self.eos_token_id
        return [ids if ids and ids[-1] == eos else [*ids, eos]
                for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]


def _fingerprint(tokenizer: Any) -> str:
    """A hash of everything that decides the ids: a fast tokenizer's whole definition (normalizer, pre-tokenizer,
    model with its merges, post-processor, added tokens), else the vocabulary and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.all_special_ids, type(tokenizer).__name__])
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def load_document_tokenizer(tokenizer: str) -> DocumentTokenizer:
    """``"bytes"`` (:class:`ByteTokenizer`), or the directory of a tokenizer saved with ``save_pretrained``."""
    return ByteTokenizer() if tokenizer == BYTES else _HuggingFaceTokenizer(tokenizer)


# ----------------------------------------------------------------------------------------------- inputs
def work_items(inputs: Sequence[str], *, text_field: str = "text", piece_bytes: int = 16 << 20) -> list[list[Any]]:
    """The pieces of work the inputs make, each ``[kind, path, start, stop]``: ``stdlib`` documents, a text file, a
    byte range of a JSON-lines file, a parquet row group, a row range of a ``save_to_disk`` dataset. Plain lists, as
    litdata keeps them in its checkpoint to resume an interrupted run. Raises ``ValueError`` naming a missing or
    unreadable input."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [str(inputs)]
    if not inputs:
        raise ValueError("inputs is empty: give 'stdlib', files (.txt, .jsonl, .parquet), a directory of them or a "
                         "directory written by datasets' save_to_disk")
    items: list[list[Any]] = []
    for entry in inputs:
        items.extend(_items_of(str(entry), text_field, piece_bytes))
    if not items:
        raise ValueError(f"inputs {list(inputs)} hold no documents")
    return items


def _items_of(entry: str, text_field: str, piece_bytes: int) -> list[list[Any]]:
    if entry == "stdlib":
        from lightning_par.data.corpus import list_stdlib_documents

        return [["stdlib", str(path), 0, 0] for _, path in list_stdlib_documents()]
    path = Path(entry)
    if not path.exists():
        raise ValueError(f"input {entry!r} does not exist")
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _dataset_items(path, text_field)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in
                       TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)
        if not files:
            raise ValueError(f"input directory {entry!r} holds no {', '.join(TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)} "
                             "file and was not written by datasets' save_to_disk")
        return [item for file in files for item in _items_of(str(file), text_field, piece_bytes)]
    if path.suffix in TEXT_SUFFIXES:
        return [["text", str(path), 0, 0]]
    if path.suffix in JSON_SUFFIXES:
        size = path.stat().st_size
        return [["jsonl", str(path), start, min(start + piece_bytes, size)] for start in range(0, size, piece_bytes)]
    if path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as error:  # noqa: BLE001 - pyarrow raises several kinds for a file that is not parquet
            raise ValueError(f"input {entry!r} is not a parquet file: {error}") from error
        if text_field not in parquet.schema_arrow.names:
            raise ValueError(f"text_field={text_field!r} is not a column of {entry!r}: its columns are "
                             f"{parquet.schema_arrow.names}")
        return [["parquet", str(path), group, group + 1] for group in range(parquet.num_row_groups)]
    raise ValueError(f"input {entry!r} is neither text ({', '.join(TEXT_SUFFIXES)}), JSON lines "
                     f"({', '.join(JSON_SUFFIXES)}), parquet nor a directory")


def _dataset_items(path: Path, text_field: str) -> list[list[Any]]:
    dataset = _load_dataset(path)
    if text_field not in dataset.column_names:
        raise ValueError(f"text_field={text_field!r} is not a column of the dataset {str(path)!r}: its columns are "
                         f"{dataset.column_names}")
    return [["dataset", str(path), start, min(start + _PIECE_ROWS, len(dataset))]
            for start in range(0, len(dataset), _PIECE_ROWS)]


def _load_dataset(path: Path) -> Any:
    import datasets

    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ValueError(f"the dataset {str(path)!r} has the splits {sorted(dataset)}: prepare reads 'train'; "
                             "save the split to prepare on its own (dataset[split].save_to_disk)")
        dataset = dataset["train"]
    return dataset


def _documents(item: Sequence[Any], text_field: str) -> Iterator[tuple[str, str | bytes]]:
    """``(where, text)`` of every document of a work item; ``where`` (file and offset) decides its split."""
    kind, path, start, stop = item
    if kind == "stdlib":
        from lightning_par.data.corpus import stdlib_dir

        yield Path(path).relative_to(stdlib_dir()).as_posix(), Path(path).read_bytes()
    elif kind == "text":
        yield path, Path(path).read_bytes()
    elif kind == "jsonl":
        yield from _json_lines(path, start, stop, text_field)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        column = pq.ParquetFile(path).read_row_group(start, columns=[text_field]).column(0).to_pylist()
        for row, text in enumerate(column):
            yield f"{path}:{start}:{row}", _text(text, text_field, f"{path} row group {start} row {row}")
    else:
        rows = _load_dataset(Path(path)).select(range(start, stop))[text_field]
        for row, text in enumerate(rows, start):
            yield f"{path}:{row}", _text(text, text_field, f"{path} row {row}")


def _json_lines(path: str, start: int, stop: int, text_field: str) -> Iterator[tuple[str, str]]:
    """The records whose line begins in ``[start, stop)``: a line that straddles ``start`` is the piece before's."""
    with open(path, "rb") as file:
        position = start
        if start:
            file.seek(start - 1)
            position = start - 1 + len(file.readline())  # to the first line beginning at or after start
        while position < stop:
            line = file.readline()
            if not line:
                break
            where, position = position, position + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: the line at byte {where} is not JSON: {error}") from error
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{path}: the record at byte {where} has no field text_field={text_field!r}")
            yield f"{path}:{where}", _text(record[text_field], text_field, f"{path} byte {where}")


def _text(value: Any, text_field: str, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {text_field}={value!r} ({type(value).__name__}) is not text")
    return value


def _is_validation(where: str, val_fraction: float) -> bool:
    from lightning_par.data.corpus import is_validation_document

    return is_validation_document(where, val_fraction)


class _TokenizeItem:
    """litdata's ``fn``: the tokens of one work item's documents of one split, each closed by EOS, as one tensor
    (litdata's ``TokensLoader`` cares for tokens, not for items). The tokenizer is loaded in each worker. A bad
    input is written to ``errors`` (a folder) instead of raised: litdata leaves worker processes behind when its
    ``fn`` raises; the driver reads the folder once the workers are done."""

    def __init__(self, tokenizer: str, split: str, val_fraction: float, text_field: str, errors: str) -> None:
        self.tokenizer_name, self.split, self.val_fraction, self.text_field = tokenizer, split, val_fraction, text_field
        self.errors = errors
        self._tokenizer: DocumentTokenizer | None = None

    def __call__(self, item: Sequence[Any]) -> torch.Tensor | None:
        try:
            return self._tokens(item)
        except Exception as error:  # noqa: BLE001 - reported by the driver, whatever the input did wrong
            with open(os.path.join(self.errors, f"{os.getpid()}.txt"), "a") as file:
                file.write(f"{type(error).__name__}: {error}\n")
            return None

    def _tokens(self, item: Sequence[Any]) -> torch.Tensor | None:
        if self._tokenizer is None:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
            self._tokenizer = load_document_tokenizer(self.tokenizer_name)
        want_val = self.split == "val"
        documents = [text for where, text in _documents(item, self.text_field)
                     if text and (self.val_fraction > 0 and _is_validation(where, self.val_fraction)) == want_val]
        if not documents:
            return None  # litdata writes nothing for it
        ids = [token for start in range(0, len(documents), _ENCODE_BATCH)
               for document in self._tokenizer.encode(documents[start:start + _ENCODE_BATCH]) for token in document]
        dtype = np.uint16 if self._tokenizer.vocab_size <= _UINT16_VOCAB else np.int32
        return torch.from_numpy(np.asarray(ids, dtype=dtype))


# ----------------------------------------------------------------------------------------------- prepare
def prepare(inputs: Sequence[str] | str, output_dir: str, tokenizer: str, *, val_fraction: float = 0.0,
            text_field: str = "text", num_workers: int | None = None, chunk_bytes: str = "64MB",
            items_per_part: int = _ITEMS_PER_WORKER_PART, verbose: bool = True) -> "PreparedData":
    """Tokenize ``inputs`` into token shards in ``output_dir`` (module docstring), and return what it holds.

    The work is done in parts of ``items_per_part`` pieces per worker, each appended to the shards whole (litdata's
    ``optimize`` with ``mode="append"``) and recorded in ``prepare.progress.json``. A prepare that stopped (killed,
    or refused a bad record) is resumed by running it again: what a part left unfinished is dropped, the parts
    recorded are kept, so every document ends up in the shards once. A complete ``output_dir`` prepared from the
    same inputs with the same tokenizer is returned as it is; one prepared otherwise is refused, and so is a
    directory with other files (nothing a user wrote is overwritten).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1)")
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} must be at least 1")
    from litdata.utilities.format import _convert_bytes_to_int

    document_tokenizer = load_document_tokenizer(tokenizer)
    items = work_items(inputs, text_field=text_field,
                       piece_bytes=max(1, _convert_bytes_to_int(chunk_bytes) // _TEXT_PER_SHARD))
    settings = {"inputs": [str(entry) for entry in ([inputs] if isinstance(inputs, str) else inputs)],
                "val_fraction": val_fraction, "text_field": text_field}
    store = _Store(output_dir)
    if store.exists(METADATA):
        prepared = read_prepared(output_dir)
        if prepared.settings != settings or prepared.tokenizer["fingerprint"] != document_tokenizer.fingerprint:
            raise ValueError(f"{output_dir!r} already holds data prepared from {prepared.settings} with the tokenizer "
                             f"{prepared.tokenizer['name']!r}, not from {settings} with {tokenizer!r}: give another "
                             "output directory, or remove it to prepare it again")
        return prepared
    workers = min(num_workers or os.cpu_count() or 1, len(items))
    splits = ["train", "val"] if val_fraction > 0 else ["train"]
    progress = _Progress.start(store, settings, document_tokenizer.fingerprint, splits, len(items))
    step = workers * items_per_part
    for split in splits:
        for part, first in enumerate(range(0, len(items), step)):
            if part < progress.parts[split]:
                continue
            _keep_chunks(store, split, progress.chunks[split])  # drop what an interrupted part wrote
            _tokenize_part(store, split, items[first:first + step], workers, chunk_bytes, verbose,
                           _TokenizeItem(tokenizer, split, val_fraction, text_field, ""))
            progress.done(split, _chunks_of(store, split))
    counts = {split: _tokens_of(store, split) for split in splits}
    if counts["train"] == 0:
        raise ValueError(f"inputs {settings['inputs']} hold no training text (val_fraction={val_fraction})")
    metadata = {"format": FORMAT, "settings": settings,
                "tokenizer": {"name": document_tokenizer.name, "fingerprint": document_tokenizer.fingerprint,
                              "vocab_size": document_tokenizer.vocab_size,
                              "eos_token_id": document_tokenizer.eos_token_id},
                "dtype": "uint16" if document_tokenizer.vocab_size <= _UINT16_VOCAB else "int32",
                "tokens": counts}
    store.write_text(METADATA, json.dumps(metadata, indent=2))  # last: the mark of a finished prepare
    progress.remove()
    return read_prepared(output_dir)


def _tokenize_part(store: "_Store", split: str, items: list[list[Any]], workers: int, chunk_bytes: str,
                   verbose: bool, fn: _TokenizeItem) -> None:
    """Append the tokens of ``items`` to ``split``'s shards; on a bad input, leave them as they were and raise
    ``ValueError`` with what the input did wrong."""
    from litdata import TokensLoader, optimize

    chunks = _chunks_of(store, split)
    with tempfile.TemporaryDirectory() as errors:
        fn.errors = errors
        optimize(fn=fn, inputs=items, output_dir=store.url(split), chunk_bytes=chunk_bytes, item_loader=TokensLoader(),
                 num_workers=min(workers, len(items)), mode="append" if store.exists(f"{split}/index.json") else None,
                 start_method="fork", weights=[_item_size(item) for item in items], keep_data_ordered=True,
                 verbose=verbose)
        found = sorted(Path(errors).glob("*.txt"))
        if found:
            _keep_chunks(store, split, chunks)
            raise ValueError(found[0].read_text().splitlines()[0])


class _Progress:
    """``prepare.progress.json``: the settings of an unfinished prepare, and per split the parts appended whole and
    the shard files they made."""

    NAME = "prepare.progress.json"

    def __init__(self, store: "_Store", record: dict[str, Any]) -> None:
        self.store, self.record = store, record
        self.parts: dict[str, int] = record["parts"]
        self.chunks: dict[str, int] = record["chunks"]

    @classmethod
    def start(cls, store: "_Store", settings: dict[str, Any], fingerprint: str, splits: list[str],
              items: int) -> "_Progress":
        """The progress of the prepare started earlier with these settings, or a new one in an empty directory."""
        identity = {"settings": settings, "tokenizer": fingerprint, "items": items}
        if store.exists(cls.NAME):
            record = json.loads(store.read_text(cls.NAME))
            if {key: record.get(key) for key in identity} != identity:
                raise ValueError(f"{store.root!r} holds an unfinished prepare of {record.get('settings')} with "
                                 "another tokenizer or other inputs: run that one again to finish it, or give "
                                 "another output directory")
            return cls(store, record)
        if not store.remote and os.path.isdir(store.root) and os.listdir(store.root):
            raise ValueError(f"{store.root!r} is not empty and holds no prepare: give a new or empty output directory")
        progress = cls(store, {**identity, "parts": {split: 0 for split in splits},
                               "chunks": {split: 0 for split in splits}})
        progress.store.write_text(cls.NAME, json.dumps(progress.record))
        return progress

    def done(self, split: str, chunks: int) -> None:
        self.parts[split] += 1
        self.chunks[split] = chunks
        self.store.write_text(self.NAME, json.dumps(self.record))

    def remove(self) -> None:
        self.store.remove(self.NAME)


def _chunks_of(store: "_Store", split: str) -> int:
    if not store.exists(f"{split}/index.json"):
        return 0
    return len(json.loads(store.read_text(f"{split}/index.json"))["chunks"])


def _keep_chunks(store: "_Store", split: str, count: int) -> None:
    """Cut ``split``'s index back to its first ``count`` shard files, and delete the files of a local directory that
    its index does not list (a part that did not finish)."""
    if store.exists(f"{split}/index.json"):
        index = json.loads(store.read_text(f"{split}/index.json"))
        if len(index["chunks"]) > count:
            index["chunks"] = index["chunks"][:count]
            store.write_text(f"{split}/index.json", json.dumps(index))
        listed = {chunk["filename"] for chunk in index["chunks"]}
    else:
        listed = set()
    if not store.remote and os.path.isdir(store.url(split)):
        for path in Path(store.url(split)).glob("chunk-*.bin"):
            if path.name not in listed:
                path.unlink()


def _item_size(item: Sequence[Any]) -> int:
    """How much work an item is, for litdata to balance its workers: bytes of text, or rows."""
    kind, path, start, stop = item
    if kind in ("jsonl", "dataset"):
        return stop - start
    return os.path.getsize(path) if kind != "parquet" else 1


def _tokens_of(store: "_Store", split: str) -> int:
    index = json.loads(store.read_text(f"{split}/index.json"))
    return sum(int(chunk["dim"] or 0) for chunk in index["chunks"])


# ----------------------------------------------------------------------------------------------- reading
class PreparedData:
    """What a finished ``prepare`` wrote in ``directory`` (``prepared.json``): the tokenizer, the token dtype,
    the tokens of each split and the settings it was prepared with."""

    def __init__(self, directory: str, metadata: dict[str, Any]) -> None:
        self.directory = directory
        self.tokenizer: dict[str, Any] = metadata["tokenizer"]
        self.dtype: str = metadata["dtype"]
        self.tokens: dict[str, int] = metadata["tokens"]
        self.settings: dict[str, Any] = metadata["settings"]

    @property
    def splits(self) -> list[str]:
        return [split for split in SPLITS if split in self.tokens]

    def split_url(self, split: str) -> str:
        return _Store(self.directory).url(split)


def is_prepared(directory: str) -> bool:
    """Whether a ``prepare`` of ``directory`` finished (its ``prepared.json`` is there)."""
    return _Store(directory).exists(METADATA)


def read_prepared(directory: str) -> PreparedData:
    """The prepared data in ``directory``, or a ``ValueError`` that says what is missing: no ``prepared.json``
    (never prepared, or a ``prepare`` that did not finish), or the format of another version."""
    store = _Store(directory)
    if not store.exists(METADATA):
        unfinished = store.exists(_Progress.NAME)
        raise ValueError(f"{directory!r} holds no prepared data (no {METADATA}"
                         + ("; a prepare started there did not finish: run it again to resume it"
                            if unfinished else "") + "): prepare it with `lightning-par prepare --input ... "
                         f"--output {directory} --tokenizer ...` (docs/data.md)")
    try:
        metadata = json.loads(store.read_text(METADATA))
    except json.JSONDecodeError as error:
        raise ValueError(f"{directory!r}: {METADATA} is not JSON ({error}): prepare it again") from error
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{directory!r} was prepared in format {metadata.get('format')!r}; this version reads "
                         f"format {FORMAT}: prepare it again")
    return PreparedData(directory, metadata)


class _Store:
    """A local directory or an object-store URL that litdata writes (its file providers move the small files)."""

    def __init__(self, root: str) -> None:
        self.root = str(root).rstrip("/")
        self.remote = "://" in self.root and not self.root.startswith("local:")

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        if not self.remote:
            return os.path.exists(self.url(name))
        return self._provider().exists(self.url(name))

    def read_text(self, name: str) -> str:
        if not self.remote:
            return Path(self.url(name)).read_text()
        with tempfile.TemporaryDirectory() as folder:
            local = os.path.join(folder, os.path.basename(name))
            self._provider().download_file(self.url(name), local)
            return Path(local).read_text()

    def write_text(self, name: str, text: str) -> None:
        """Whole or not at all: a local file is renamed into place; an object store's upload is atomic."""
        if not self.remote:
            target = Path(self.url(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = target.with_name(f".{target.name}.writing")
            staging.write_text(text)
            os.replace(staging, target)
            return
        with tempfile.TemporaryDirectory() as folder:
            local = os.path.join(folder, os.path.basename(name))
            Path(local).write_text(text)
            self._provider().upload_file(local, self.url(name))

    def remove(self, name: str) -> None:
        if not self.remote:
            os.remove(self.url(name))
        else:
            self._provider().delete_file_or_directory(self.url(name))

    def _provider(self) -> Any:
        from litdata.streaming.fs_provider import _get_fs_provider

        return _get_fs_provider(self.root)


# ----------------------------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-par prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="'stdlib', files (.txt .md .json .jsonl .parquet), "
                        "directories of them, or a directory written by datasets' save_to_disk")
    parser.add_argument("--output", required=True, help="a local directory or an object-store URL litdata writes")
    parser.add_argument("--tokenizer", required=True, help="a directory with a tokenizer saved by save_pretrained "
                        "(the model's), or 'bytes'")
    parser.add_argument("--val-fraction", type=float, default=0.0, help="share of documents held out (default 0)")
    parser.add_argument("--text-field", default="text", help="the JSON field or column holding the text")
    parser.add_argument("--workers", type=int, help="worker processes (default: one per CPU)")
    parser.add_argument("--chunk-bytes", default="64MB", help="size of a shard file (default 64MB)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-par prepare``: tokenize once (module docstring), print what was written."""
    args = _parser().parse_args(argv)
    prepared = prepare(args.input, args.output, args.tokenizer, val_fraction=args.val_fraction,
                       text_field=args.text_field, num_workers=args.workers, chunk_bytes=args.chunk_bytes)
    counts = ", ".join(f"{split} {tokens:,} tokens" for split, tokens in prepared.tokens.items())
    print(f"prepared {args.output}: {counts} ({prepared.dtype}, tokenizer {prepared.tokenizer['name']})")


if __name__ == "__main__":
    main(sys.argv[1:])
