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
    OUTPUT/prepared.json                      the tokenizer's fingerprint, vocabulary and EOS, the token dtype, counts

``prepared.json`` is written last: a directory without it was not prepared to the end, and is refused by the
data module and resumed by the next ``prepare``. Each document is its tokens (with the tokenizer's special tokens, a
beginning-of-sequence token for Llama's) followed by the end-of-sequence token, which is where packed documents are
kept apart (``lightning_par.models.packing``). Tokens are stored as uint16 when the vocabulary has at most 65,536
entries, else int32.

The inputs, their pieces of work and the tokenizers are ``lightning_par.data.documents``'. Large JSON-lines files,
parquet row groups and datasets are cut into pieces, so that the work spreads over the workers and memory stays that
of one piece. A document goes to the validation split by a hash of where it is (file and offset), so the split never
depends on how the work was cut or on the number of workers. Pure Python plus litdata and the tokenizer's library:
no lightning import.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_par.data.documents import (DocumentPart, DocumentTokenizer, documents_of, is_validation,
                                          load_document_tokenizer, part_end, piece_bytes, work_items)

__all__ = ["METADATA", "SPLITS", "PreparedData", "decoding_arguments", "is_prepared", "main", "prepare",
           "read_prepared", "token_dtype", "verify_prepared"]

METADATA = "prepared.json"
SPLITS = ("train", "val")
FORMAT = 2  # of prepared.json: 2 records every shard file (1, without, is still read)
# A JSON-lines piece is a quarter of a shard's bytes of text: litdata starts a shard file only between two items (a
# piece's tokens), so shards stay near their size and a big file spreads over the workers and over many shards.
_TEXT_PER_SHARD = 4
# A part of the work is this many pieces per worker, appended whole: what a stopped prepare may do again.
_ITEMS_PER_WORKER_PART = 16
# Characters the tokenizer is given at once (documents batched up to it, longer ones cut into parts): a fast
# tokenizer holds about 100 bytes per character while it works.
_ENCODE_CHARACTERS = 1 << 20


def token_dtype(vocab_size: int) -> str:
    """How the shards keep a token: uint16 when the vocabulary has at most 65,536 entries, else int32 (litdata has
    no uint32)."""
    return "uint16" if vocab_size <= 1 << 16 else "int32"


class _TokenizeItem:
    """litdata's ``fn``: the tokens of one work item's documents of one split, each closed by EOS, as one tensor
    (litdata's ``TokensLoader`` cares for tokens, not for items). The tokenizer is loaded in each worker. A bad
    input is written to ``errors`` (a folder) instead of raised: litdata leaves worker processes behind when its
    ``fn`` raises; the driver reads the folder once the workers are done."""

    def __init__(self, tokenizer: str, split: str, val_fraction: float, text_field: str, decoding: dict[str, str], *,
                 errors: str) -> None:
        self.tokenizer_name, self.split, self.val_fraction, self.text_field = tokenizer, split, val_fraction, text_field
        self.decoding = decoding  # documents_of's encoding and decode_errors
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
        parts = [part for document in documents_of(item, self.text_field, **self.decoding)
                 if document.text and (self.val_fraction > 0 and is_validation(document.where,
                                                                               self.val_fraction)) == want_val
                 for part in _parts(document, _ENCODE_CHARACTERS)]
        if not parts:
            return None  # litdata writes nothing for it
        dtype = token_dtype(self._tokenizer.vocab_size)
        tokens = [np.asarray(ids, dtype=dtype) for batch in _batches(parts, _ENCODE_CHARACTERS)
                  for ids in self._tokenizer.encode_parts(batch)]
        return torch.from_numpy(np.concatenate(tokens))


def _parts(document: DocumentPart, limit: int) -> Iterator[DocumentPart]:
    """``document`` cut into parts of at most ``limit`` characters where ``part_end`` cuts (itself when it fits)."""
    text, start = document.text, 0
    while start < len(text):
        end = start + part_end(text[start:start + limit + 1], limit)
        yield document._replace(text=text[start:end], opens=document.opens and start == 0,
                                closes=document.closes and end == len(text))
        start = end


def _batches(parts: list[DocumentPart], characters: int) -> Iterator[list[DocumentPart]]:
    """``parts`` in runs of about ``characters`` characters: one tokenizer call each."""
    batch: list[DocumentPart] = []
    size = 0
    for part in parts:
        if batch and size + len(part.text) > characters:
            yield batch
            batch, size = [], 0
        batch.append(part)
        size += len(part.text)
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------- prepare
_DEFAULT_DECODING = {"encoding": "utf-8", "decode_errors": "strict"}


def decoding_arguments(encoding: str, decode_errors: str) -> dict[str, str]:
    """``documents_of``'s decoding arguments, each checked to be one Python knows."""
    import codecs

    try:
        encoding = codecs.lookup(encoding).name
    except LookupError:
        raise ValueError(f"encoding={encoding!r} is not an encoding Python knows (e.g. utf-8, latin-1, "
                         "utf-16)") from None
    try:
        codecs.lookup_error(decode_errors)
    except LookupError:
        raise ValueError(f"decode_errors={decode_errors!r} is not a policy Python knows: strict (refuse), replace or "
                         "ignore") from None
    return {"encoding": encoding, "decode_errors": decode_errors}


def prepare(inputs: Sequence[str] | str, output_dir: str, tokenizer: str, *, val_fraction: float = 0.0,
            text_field: str = "text", num_workers: int | None = None, chunk_bytes: str = "64MB",
            encoding: str = "utf-8", decode_errors: str = "strict", items_per_part: int = _ITEMS_PER_WORKER_PART,
            verbose: bool = True) -> "PreparedData":
    """Tokenize ``inputs`` into token shards in ``output_dir`` (module docstring), and return what it holds.

    Text files and JSON lines are read in ``encoding``; a byte that does not decode is refused with its file and
    offset, unless ``decode_errors`` names another of Python's policies (``replace``, ``ignore``).

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
    decoding = decoding_arguments(encoding, decode_errors)
    from litdata.utilities.format import _convert_bytes_to_int

    document_tokenizer = load_document_tokenizer(tokenizer)
    settings = {"inputs": [str(entry) for entry in ([inputs] if isinstance(inputs, str) else inputs)],
                "val_fraction": val_fraction, "text_field": text_field}
    if decoding != _DEFAULT_DECODING:  # recorded where it changes the tokens (shards of before hold the default)
        settings.update(decoding)
    store = _Store(output_dir)
    if store.exists(METADATA):
        prepared = read_prepared(output_dir)
        if prepared.settings != settings or prepared.tokenizer["fingerprint"] != document_tokenizer.fingerprint:
            raise ValueError(f"{output_dir!r} already holds data prepared from {prepared.settings} with the tokenizer "
                             f"{prepared.tokenizer['name']!r}, not from {settings} with {tokenizer!r}: give another "
                             "output directory, or remove it to prepare it again")
        return prepared
    requested_workers = num_workers or os.cpu_count() or 1
    # A resumed prepare cuts the inputs as the stopped one did, whatever its workers now.
    piece = _Progress.recorded_piece_bytes(store) or piece_bytes(
        inputs, workers=requested_workers, largest=max(1, _convert_bytes_to_int(chunk_bytes) // _TEXT_PER_SHARD))
    items = work_items(inputs, text_field=text_field, piece_bytes=piece, encoding=decoding["encoding"])
    workers = min(requested_workers, len(items))
    splits = ["train", "val"] if val_fraction > 0 else ["train"]
    progress = _Progress.start(store, settings, document_tokenizer.fingerprint, splits, len(items), piece)
    step = workers * items_per_part
    bar, text_bytes = _progress_bar(items, splits, output_dir, enabled=verbose), 0
    for split in splits:
        for part, first in enumerate(range(0, len(items), step)):
            if part >= progress.parts[split]:
                _keep_chunks(store, split, progress.chunks[split])  # drop what an interrupted part wrote
                tokenize = functools.partial(_TokenizeItem, tokenizer, split, val_fraction, text_field, decoding)
                _tokenize_part(store, split, items[first:first + step], workers, chunk_bytes, tokenize,
                               kept=progress.chunks[split])
                progress.done(split, _part_shards(store, split, progress.chunks[split]))
            done = items[first:first + step]
            bar.update(len(done))
            text_bytes += sum(_item_size(item) for item in done if item[0] in ("text", "jsonl", "stdlib"))
            bar.set_postfix_str(f"{text_bytes / 1e6:,.0f} MB of text", refresh=False)
    bar.close()
    counts = {split: sum(shard["tokens"] for shard in progress.shards[split]) for split in splits}
    if counts["train"] == 0:
        # Nothing here is worth keeping, and every part is recorded as done: without this, a run with the inputs mended
        # would find the same empty shards and refuse again.
        for split in splits:
            if store.exists(split):
                store.remove(split)
        progress.remove()
        raise ValueError(f"inputs {settings['inputs']} hold no training text (val_fraction={val_fraction})")
    metadata = {"format": FORMAT, "settings": settings,
                "tokenizer": {"name": document_tokenizer.name, "fingerprint": document_tokenizer.fingerprint,
                              "vocab_size": document_tokenizer.vocab_size,
                              "eos_token_id": document_tokenizer.eos_token_id},
                "dtype": token_dtype(document_tokenizer.vocab_size),
                "tokens": counts, "shards": progress.shards}
    store.write_text(METADATA, json.dumps(metadata, indent=2))  # last: the mark of a finished prepare
    progress.remove()
    return read_prepared(output_dir)


def _progress_bar(items: list[list[Any]], splits: list[str], output_dir: str, *, enabled: bool) -> Any:
    """A bar of the pieces of work done (each split reads every piece), the MB of text read, the time so far and
    what is left: on a terminal, when ``enabled``."""
    from tqdm import tqdm

    files = len({item[1] for item in items})
    return tqdm(total=len(items) * len(splits), unit="piece",
                desc=f"prepare {output_dir} from {files} file{'s' if files != 1 else ''}",
                file=sys.stderr, disable=None if enabled else True, leave=False)


def _tokenize_part(store: "_Store", split: str, items: list[list[Any]], workers: int, chunk_bytes: str,
                   tokenize: Callable[..., _TokenizeItem], *, kept: int) -> None:
    """Append the tokens of ``items`` to ``split``'s shards, which hold ``kept`` shard files; on a bad input, leave
    them as they were and raise ``ValueError`` with what the input did wrong."""
    from litdata import TokensLoader, optimize

    with tempfile.TemporaryDirectory() as errors:
        optimize(fn=tokenize(errors=errors), inputs=items, output_dir=store.url(split), chunk_bytes=chunk_bytes,
                 item_loader=TokensLoader(),
                 num_workers=min(workers, len(items)), mode="append" if store.exists(f"{split}/index.json") else None,
                 start_method="fork", weights=[_item_size(item) for item in items], keep_data_ordered=True,
                 verbose=False)
        found = sorted(Path(errors).glob("*.txt"))
        if found:
            _keep_chunks(store, split, kept)
            raise ValueError(found[0].read_text().splitlines()[0])


def _part_shards(store: "_Store", split: str, kept: int) -> list[dict[str, Any]]:
    """The records of the shard files a part just added to ``split`` (those after the first ``kept``), once each is
    found whole: listed by the index, on disk at the size the index records. A part whose files are not all there
    (a worker killed, a disk full) raises here and is not recorded as done; the next run does it again."""
    from lightning_par.data.shard_record import check_shard_files, shard_checksum, shard_record

    if not store.exists(f"{split}/index.json"):
        return []  # no part held a document of this split yet
    chunks = json.loads(store.read_text(f"{split}/index.json"))["chunks"][kept:]
    if store.remote:  # no checksum: it would mean downloading every shard again
        return [shard_record(chunk, None) for chunk in chunks]
    check_shard_files(store.url(split))
    return [shard_record(chunk, shard_checksum(os.path.join(store.url(split), chunk["filename"])))
            for chunk in chunks]


class _Progress:
    """``prepare.progress.json``: the settings of an unfinished prepare, and per split the parts appended whole and
    the records of the shard files they made."""

    NAME = "prepare.progress.json"

    def __init__(self, store: "_Store", record: dict[str, Any]) -> None:
        self.store, self.record = store, record
        self.parts: dict[str, int] = record["parts"]
        self.shards: dict[str, list[dict[str, Any]]] = record["shards"]

    @property
    def chunks(self) -> dict[str, int]:
        """Per split, the shard files the recorded parts made."""
        return {split: len(shards) for split, shards in self.shards.items()}

    @classmethod
    def recorded_piece_bytes(cls, store: "_Store") -> int | None:
        """The bytes of a piece of work an unfinished prepare in ``store`` cut its inputs into."""
        return json.loads(store.read_text(cls.NAME)).get("piece_bytes") if store.exists(cls.NAME) else None

    @classmethod
    def start(cls, store: "_Store", settings: dict[str, Any], fingerprint: str, splits: list[str],
              items: int, piece: int) -> "_Progress":
        """The progress of the prepare started earlier with these settings, or a new one in an empty directory."""
        identity = {"settings": settings, "tokenizer": fingerprint, "items": items}
        if store.exists(cls.NAME):
            record = json.loads(store.read_text(cls.NAME))
            if {key: record.get(key) for key in identity} != identity:
                raise ValueError(f"{store.root!r} holds an unfinished prepare of {record.get('settings')} with "
                                 "another tokenizer or other inputs: run that one again to finish it, or give "
                                 "another output directory")
            if "shards" not in record:  # written by a version that counted the shard files only
                for split, count in record.pop("chunks").items():
                    _keep_chunks(store, split, count)
                record["shards"] = {split: _part_shards(store, split, 0) for split in record["parts"]}
            return cls(store, record)
        if not store.remote and os.path.isdir(store.root) and os.listdir(store.root):
            raise ValueError(f"{store.root!r} is not empty and holds no prepare: give a new or empty output directory")
        progress = cls(store, {**identity, "piece_bytes": piece, "parts": {split: 0 for split in splits},
                               "shards": {split: [] for split in splits}})
        progress.store.write_text(cls.NAME, json.dumps(progress.record))
        return progress

    def done(self, split: str, shards: list[dict[str, Any]]) -> None:
        self.parts[split] += 1
        self.shards[split].extend(shards)
        self.store.write_text(self.NAME, json.dumps(self.record))

    def remove(self) -> None:
        self.store.remove(self.NAME)


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
    if kind in ("jsonl", "dataset", "text"):
        return stop - start
    return os.path.getsize(path) if kind != "parquet" else 1


# ----------------------------------------------------------------------------------------------- reading
class PreparedData:
    """What a finished ``prepare`` wrote in ``directory`` (``prepared.json``): the tokenizer, the token dtype,
    the tokens of each split, the settings it was prepared with, and the record of each split's shard files
    (``lightning_par.data.shard_record``; ``None`` for data prepared before shards were recorded)."""

    def __init__(self, directory: str, metadata: dict[str, Any]) -> None:
        self.directory = directory
        self.tokenizer: dict[str, Any] = metadata["tokenizer"]
        self.dtype: str = metadata["dtype"]
        self.tokens: dict[str, int] = metadata["tokens"]
        self.settings: dict[str, Any] = metadata["settings"]
        self.shards: dict[str, list[dict[str, Any]]] | None = metadata.get("shards")

    @property
    def identity(self) -> str:
        """A hash of what the training split holds: its tokenizer's fingerprint, its token dtype and its shard
        files (names, sizes, tokens, checksums). The same data copied or moved elsewhere keeps it; the same
        directory prepared again from other text or with another tokenizer does not."""
        what = {"tokenizer": self.tokenizer["fingerprint"], "dtype": self.dtype,
                "train": (self.shards or {}).get("train", self.tokens["train"])}
        return "sha256:" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]

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
    if metadata.get("format") not in (1, FORMAT):
        raise ValueError(f"{directory!r} was prepared in format {metadata.get('format')!r}; this version reads "
                         f"formats 1 to {FORMAT}: prepare it again")
    return PreparedData(directory, metadata)


def verify_prepared(directory: str) -> list[str]:
    """``lightning-par prepare --verify``: every problem of a local prepared directory against its ``prepared.json``
    (an index entry removed or edited, a shard missing, truncated or corrupted at the same size: each names the
    file). Empty when every byte is the one the prepare wrote."""
    from lightning_par.data.shard_record import verify_split

    prepared = read_prepared(directory)
    if _Store(directory).remote:
        raise ValueError(f"{directory!r} is in an object store: verify a local copy (its checksums are local)")
    if prepared.shards is None:
        raise ValueError(f"{directory!r} was prepared in format 1, which records no shard files: prepare it again "
                         "to verify it")
    return [problem for split in prepared.splits
            for problem in verify_split(prepared.split_url(split), prepared.shards[split])]


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
        """A file, or a directory with what it holds."""
        if not self.remote:
            path = self.url(name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        else:
            self._provider().delete_file_or_directory(self.url(name))

    def _provider(self) -> Any:
        from litdata.streaming.fs_provider import _get_fs_provider

        return _get_fs_provider(self.root)


# ----------------------------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-par prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", metavar="DIR", help="check every shard file of a prepared directory against "
                        "prepared.json (index entries, sizes, sha256 checksums) and exit; nothing else is needed")
    parser.add_argument("--input", nargs="+", help="'stdlib', files (.txt .md .json .jsonl .parquet), "
                        "directories of them, or a directory written by datasets' save_to_disk")
    parser.add_argument("--output", help="a local directory or an object-store URL litdata writes")
    parser.add_argument("--tokenizer", help="a directory with a tokenizer saved by save_pretrained "
                        "(the model's), or 'bytes'")
    parser.add_argument("--val-fraction", type=float, default=0.0, help="share of documents held out (default 0)")
    parser.add_argument("--text-field", default="text", help="the JSON field or column holding the text")
    parser.add_argument("--workers", type=int, help="worker processes (default: one per CPU)")
    parser.add_argument("--chunk-bytes", default="64MB", help="size of a shard file (default 64MB)")
    parser.add_argument("--encoding", default="utf-8", help="the encoding of text files and JSON lines (default utf-8)")
    parser.add_argument("--decode-errors", default="strict", help="what to do with a byte that does not decode: strict "
                        "(refuse it, naming the file and offset; the default), replace or ignore")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-par prepare``: tokenize once (module docstring), print what was written."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verify is not None:
        _verify_command(args.verify)
        return
    missing = [f"--{name}" for name in ("input", "output", "tokenizer") if getattr(args, name) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)} (or --verify DIR alone)")
    prepared = prepare(args.input, args.output, args.tokenizer, val_fraction=args.val_fraction,
                       text_field=args.text_field, num_workers=args.workers, chunk_bytes=args.chunk_bytes,
                       encoding=args.encoding, decode_errors=args.decode_errors)
    counts = ", ".join(f"{split} {tokens:,} tokens" for split, tokens in prepared.tokens.items())
    print(f"prepared {args.output}: {counts} ({prepared.dtype}, tokenizer {prepared.tokenizer['name']})")


def _verify_command(directory: str) -> None:
    try:
        problems = verify_prepared(directory)
    except ValueError as error:
        sys.exit(f"lightning-par prepare --verify: {error}")
    if problems:
        sys.exit("\n".join(problems))
    prepared = read_prepared(directory)
    shards = sum(len(prepared.shards[split]) for split in prepared.splits)
    counts = ", ".join(f"{split} {tokens:,} tokens" for split, tokens in prepared.tokens.items())
    print(f"verified {directory}: {shards} shard files whole ({counts})")


if __name__ == "__main__":
    main(sys.argv[1:])
