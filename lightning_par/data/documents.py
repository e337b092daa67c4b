"""The documents a pretraining corpus is prepared from (``lightning_par.data.prepare``): the tokenizers that turn
each into ids closed by an end-of-sequence token, and the inputs cut into pieces of work, each piece's documents with
where they are (file and offset), which decides their split.

Inputs: ``stdlib`` (the Python standard library's sources, the corpus ``TokenDataModule`` reads), text files (one
document each: ``.txt``, ``.text``, ``.md``), JSON lines (a record's ``text_field`` per document: ``.json``,
``.jsonl``), parquet files (a row's ``text_field``), a directory written by ``datasets``' ``save_to_disk`` (its
``train`` split when it holds several), or a directory of such files. Pure Python plus the tokenizer's and the
formats' libraries: no lightning import.

Memory stays that of a piece whatever the shape of the input: a text file larger than a piece is read in parts cut
by :func:`part_end` (still one document: the tokenizer's leading special tokens before the first part, the
end-of-sequence token after the last), and so is any document longer than the tokenizer is given at once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["BYTES", "ByteTokenizer", "DocumentPart", "DocumentTokenizer", "decoded", "documents_of", "is_validation",
           "load_document_tokenizer", "part_end", "piece_bytes", "work_items"]

BYTES = "bytes"  # the byte tokenizer's name (the reference model's vocabulary of 256)
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".json", ".jsonl")
PARQUET_SUFFIXES = (".parquet",)
_PIECE_ROWS = 20_000  # a datasets piece
# Pieces per worker a corpus is cut into at least (pieces no smaller than _SMALLEST_PIECE): enough for litdata to
# even out the workers' loads.
_PIECES_PER_WORKER = 4
_SMALLEST_PIECE = 1 << 20


class DocumentPart(NamedTuple):
    """A document, or a part of one cut by :func:`part_end`: ``opens`` when it is the document's start (the
    tokenizer's leading special tokens go before it), ``closes`` when it is its end (the end-of-sequence token goes
    after it). ``where`` (file and offset of the document) decides its split."""

    where: str
    text: str
    opens: bool = True
    closes: bool = True


def part_end(text: str | bytes, limit: int) -> int:
    """Where the first part of ``text`` ends when it is longer than ``limit``: at the start of the last run of
    whitespace that begins inside the first ``limit`` characters (bytes), so that the run goes whole with the word
    after it and tokenizers that split text at whitespace give the same ids as to the whole text; without
    whitespace, at ``limit`` (for bytes, moved back to the start of a UTF-8 character). ``len(text)`` when it fits."""
    if len(text) <= limit:
        return len(text)
    window = text[:limit + 1]
    blank = " \t\n\r\f\v"
    spaces = [window.rfind(mark) for mark in (blank if isinstance(text, str) else [c.encode() for c in blank])]
    end = max(spaces)
    if end > 0:
        while end > 0 and text[end - 1:end].isspace():
            end -= 1
        if end > 0:
            return end
    end = limit
    if isinstance(text, bytes):
        while end > 0 and text[end] & 0xC0 == 0x80:  # a UTF-8 continuation byte
            end -= 1
    return end or limit


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

    def encode_parts(self, parts: Sequence[DocumentPart]) -> list[list[int]]:
        """The ids of each part: a whole document's as :meth:`encode` gives them; a part that does not open its
        document without the leading special tokens, one that does not close it without the trailing ones and EOS."""
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

    def encode_parts(self, parts: Sequence[DocumentPart]) -> list[list[int]]:
        whole = self.encode([part.text for part in parts])
        return [ids if part.closes else ids[:-1] for ids, part in zip(whole, parts)]


class _HuggingFaceTokenizer(DocumentTokenizer):
    """A tokenizer saved with ``save_pretrained`` (a model directory), as ``TextDataModule`` packs documents."""

    def __init__(self, directory: str) -> None:
        from lightning_par.data.text import load_tokenizer

        self.tokenizer = load_tokenizer(directory)
        self.name = str(directory)
        self.vocab_size = len(self.tokenizer)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.fingerprint = _fingerprint(self.tokenizer)
        # A fast tokenizer's Rust core, called directly: the ids transformers' call gives (it calls the same
        # encode_batch with truncation and padding off), without its per-document conversions (~15% of the time).
        self.core = getattr(self.tokenizer, "backend_tokenizer", None)
        if self.core is not None:
            from tokenizers import Tokenizer

            self.core = Tokenizer.from_str(self.core.to_str())
            self.core.no_truncation()
            self.core.no_padding()

    def _ids(self, texts: list[str], *, special_tokens: bool) -> list[list[int]]:
        if self.core is None:
            return self.tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]
        return [encoding.ids for encoding in self.core.encode_batch(texts, add_special_tokens=special_tokens)]

    def encode(self, documents: Sequence[str | bytes]) -> list[list[int]]:
        texts = [d.decode("utf-8") if isinstance(d, bytes) else d for d in documents]
        return [self._closed(ids) for ids in self._ids(texts, special_tokens=True)]

    def _closed(self, ids: list[int]) -> list[int]:
        return ids if ids and ids[-1] == self.eos_token_id else [*ids, self.eos_token_id]

    def encode_parts(self, parts: Sequence[DocumentPart]) -> list[list[int]]:
        if all(part.opens and part.closes for part in parts):
            return self.encode([part.text for part in parts])
        prefix, suffix = self._special_tokens_around()
        bodies = self._ids([part.text for part in parts], special_tokens=False)
        return [(prefix if part.opens else []) + ids + (self._closed(suffix) if part.closes else [])
                for ids, part in zip(bodies, parts)]

    def _special_tokens_around(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's template puts before and after a text's own (a BOS for Llama's)."""
        if not hasattr(self, "_around"):
            probe = "probe"
            plain, special = (self._ids([probe], special_tokens=flag)[0] for flag in (False, True))
            start = next((i for i in range(len(special) - len(plain) + 1) if special[i:i + len(plain)] == plain), None)
            if not plain or start is None:
                raise ValueError(f"the tokenizer {self.name!r} adds special tokens inside a text "
                                 f"({special} for {probe!r}, {plain} without): prepare cannot cut a long document "
                                 "into parts for it")
            self._around = (special[:start], special[start + len(plain):])
        return self._around


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
def piece_bytes(inputs: Sequence[str] | str, *, workers: int, largest: int) -> int:
    """The bytes of text a piece of work holds: the corpus's text and JSON-lines bytes shared into
    ``_PIECES_PER_WORKER`` pieces per worker, so that every worker has work, but no more than ``largest`` (what a
    shard holds: litdata starts a shard file between two pieces only) and no less than 1 MiB."""
    total = 0
    for entry in [inputs] if isinstance(inputs, str) else inputs:
        path = Path(entry)
        files = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        total += sum(file.stat().st_size for file in files
                     if file.is_file() and file.suffix in TEXT_SUFFIXES + JSON_SUFFIXES)
    return max(1, min(largest, max(_SMALLEST_PIECE, total // (workers * _PIECES_PER_WORKER))))


def work_items(inputs: Sequence[str], *, text_field: str = "text", piece_bytes: int = 16 << 20,
               encoding: str = "utf-8") -> list[list[Any]]:
    """The pieces of work the inputs make, each ``[kind, path, start, stop]``: ``stdlib`` documents, a byte range of
    a text file (cut by :func:`part_end` where the file is larger than ``piece_bytes`` and ``encoding`` writes
    whitespace as ASCII does), a byte range of a JSON-lines file, a parquet row group, a row range of a
    ``save_to_disk`` dataset. Plain lists, as litdata keeps them in its checkpoint to resume an interrupted run.
    Raises ``ValueError`` naming a missing or unreadable input."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [str(inputs)]
    if not inputs:
        raise ValueError("inputs is empty: give 'stdlib', files (.txt, .jsonl, .parquet), a directory of them or a "
                         "directory written by datasets' save_to_disk")
    cut_text = all(character.encode(encoding) == character.encode("ascii") for character in " \t\n\r")
    items: list[list[Any]] = []
    for entry in inputs:
        items.extend(_items_of(str(entry), text_field, piece_bytes, cut_text))
    if not items:
        raise ValueError(f"inputs {list(inputs)} hold no documents")
    return items


def _text_items(path: Path, piece_bytes: int, cut: bool) -> list[list[Any]]:
    """A text file's byte ranges of at most ``piece_bytes``, each ending where :func:`part_end` cuts (the whole file
    where it fits, or ``cut`` is off)."""
    size = path.stat().st_size
    if not cut or size <= piece_bytes:
        return [["text", str(path), 0, size]]
    items, start = [], 0
    with open(path, "rb") as file:
        while start < size:
            file.seek(start)
            end = start + part_end(file.read(piece_bytes + 1), piece_bytes)
            items.append(["text", str(path), start, end])
            start = end
    return items


def _items_of(entry: str, text_field: str, piece_bytes: int, cut_text: bool) -> list[list[Any]]:
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
        return [item for file in files for item in _items_of(str(file), text_field, piece_bytes, cut_text)]
    if path.suffix in TEXT_SUFFIXES:
        return _text_items(path, piece_bytes, cut_text)
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


def documents_of(item: Sequence[Any], text_field: str, *, encoding: str = "utf-8",
                 decode_errors: str = "strict") -> Iterator[DocumentPart]:
    """Every document of a work item (a part of one, for a piece of a large text file), with where it is (file and
    offset), which decides its split. Text files and JSON lines are decoded from ``encoding`` with ``decode_errors``
    (:func:`decoded`)."""
    kind, path, start, stop = item
    if kind == "stdlib":
        from lightning_par.data.corpus import stdlib_dir

        yield DocumentPart(Path(path).relative_to(stdlib_dir()).as_posix(), decoded(Path(path).read_bytes(), path))
    elif kind == "text":
        with open(path, "rb") as file:
            file.seek(start)
            data = file.read(stop - start)
        yield DocumentPart(path, decoded(data, path, offset=start, encoding=encoding, errors=decode_errors),
                           opens=start == 0, closes=stop >= os.path.getsize(path))
    elif kind == "jsonl":
        yield from _json_lines(path, start, stop, text_field, encoding, decode_errors)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        column = pq.ParquetFile(path).read_row_group(start, columns=[text_field]).column(0).to_pylist()
        for row, text in enumerate(column):
            yield DocumentPart(f"{path}:{start}:{row}", _text(text, text_field, f"{path} row group {start} row {row}"))
    else:
        rows = _load_dataset(Path(path)).select(range(start, stop))[text_field]
        for row, text in enumerate(rows, start):
            yield DocumentPart(f"{path}:{row}", _text(text, text_field, f"{path} row {row}"))


def _json_lines(path: str, start: int, stop: int, text_field: str, encoding: str,
                decode_errors: str) -> Iterator[DocumentPart]:
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
                record = json.loads(decoded(line, path, offset=where, encoding=encoding, errors=decode_errors))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: the line at byte {where} is not JSON: {error}") from error
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{path}: the record at byte {where} has no field text_field={text_field!r}")
            yield DocumentPart(f"{path}:{where}", _text(record[text_field], text_field, f"{path} byte {where}"))


def decoded(data: bytes, path: str, *, offset: int = 0, encoding: str = "utf-8", errors: str = "strict") -> str:
    """``data`` (read at byte ``offset`` of ``path``) decoded from ``encoding``. With ``errors="strict"``, a byte that
    does not decode raises ``ValueError`` naming the file and its offset: text in another encoding, or a binary file,
    would be tokenized as other text. Another policy of Python's (``replace``, ``ignore``) is the user's choice."""
    try:
        return data.decode(encoding, errors=errors)
    except UnicodeDecodeError as error:
        at = offset + error.start
        raise ValueError(f"{path}: the byte at offset {at} ({data[error.start]:#04x}) is not {error.encoding} "
                         f"({error.reason}): name the file's encoding (--encoding latin-1) or what to do with such "
                         "bytes (--decode-errors replace)") from None


def _text(value: Any, text_field: str, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {text_field}={value!r} ({type(value).__name__}) is not text")
    return value


def is_validation(where: str, val_fraction: float) -> bool:
    from lightning_par.data.corpus import is_validation_document

    return is_validation_document(where, val_fraction)
