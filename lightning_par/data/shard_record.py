"""What a ``prepare`` made, shard file by shard file (``prepared.json``'s ``shards``: name, bytes, tokens, sha256),
and the checks of a prepared split against it: the cheap ones every rank runs in set-up before any batch
(``index.json`` against the record, each file's size against ``index.json``), and the checksums that
``lightning-par prepare --verify`` reads every byte for. litdata's format has no checksums of its own, and its
``index.json`` is trusted as it is: an entry removed drops data silently, an edited token count fails mid-epoch.

Pure Python: no torch, litdata or lightning import.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

__all__ = ["check_shard_files", "shard_checksum", "shard_record", "verify_split"]


def shard_checksum(path: str) -> str:
    """``sha256:`` and the hex digest of a shard file's bytes, read in blocks (a shard is tens of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def shard_record(chunk: dict[str, Any], checksum: str | None) -> dict[str, Any]:
    """What ``prepared.json`` records of one shard file, from its ``index.json`` entry: its name, bytes, tokens and
    checksum (``None`` where the shards were written to an object store)."""
    return {"filename": chunk["filename"], "bytes": int(chunk["chunk_bytes"]), "tokens": int(chunk["dim"] or 0),
            "sha256": checksum}


def check_shard_files(url: str, recorded: list[dict[str, Any]] | None = None) -> None:
    """Raise ``ValueError`` naming a shard file of ``url`` (a local split directory) that ``index.json`` lists
    otherwise than ``recorded`` (what the prepare made, from ``prepared.json``: an entry removed or edited), or that
    is missing or whose size is not the one its ``index.json`` records (truncated, or written by another prepare):
    litdata would find out only when it reaches the file, mid-run, on one rank, or never. An object store's files
    are checked by litdata as it reads. Checksums are :func:`verify_split`'s (they read every byte)."""
    if "://" in url and not url.startswith("local:"):
        return
    url = url.removeprefix("local:")
    index_path = os.path.join(url, "index.json")
    try:
        with open(index_path) as file:
            index = json.load(file)
    except FileNotFoundError:
        raise ValueError(f"{index_path!r} is missing: the shards of {url!r} were not prepared to the end; prepare "
                         "them again") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{index_path!r} is not JSON ({error}): prepare the data again") from error
    if recorded is not None:
        _check_index_against_record(index_path, index["chunks"], recorded)
    for chunk in index["chunks"]:
        path = os.path.join(url, chunk["filename"])
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise ValueError(f"the shard {path!r} is missing (its index.json lists it): prepare the data again, or "
                             "copy the whole directory") from None
        if size != chunk["chunk_bytes"]:
            raise ValueError(f"the shard {path!r} holds {size} bytes where its index.json records "
                             f"{chunk['chunk_bytes']}: it is truncated or from another prepare; prepare the data "
                             "again, or copy the whole directory")


def _check_index_against_record(index_path: str, chunks: list[dict[str, Any]],
                                recorded: list[dict[str, Any]]) -> None:
    listed = [shard_record(chunk, None) for chunk in chunks]
    made = [{**entry, "sha256": None} for entry in recorded]
    if listed == made:
        return
    names = [entry["filename"] for entry in listed]
    for entry in made:
        if entry["filename"] not in names:
            raise ValueError(f"{index_path!r} does not list the shard {entry['filename']!r} that prepared.json "
                             f"records ({len(listed)} shards listed, {len(made)} made): its data would be left out "
                             "silently; copy the whole prepared directory again, or prepare it again")
        found = listed[names.index(entry["filename"])]
        if found != entry:
            changed = ", ".join(f"{key} {found[key]} where prepared.json records {entry[key]}"
                                for key in ("bytes", "tokens") if found[key] != entry[key])
            raise ValueError(f"{index_path!r} lists the shard {entry['filename']!r} with {changed or 'another place'}: "
                             "the index was edited or comes from another prepare; copy the whole prepared directory "
                             "again, or prepare it again")
    extra = next(entry["filename"] for entry in listed if entry["filename"] not in {e["filename"] for e in made})
    raise ValueError(f"{index_path!r} lists the shard {extra!r}, which prepared.json does not record: the index comes "
                     "from another prepare; copy the whole prepared directory again, or prepare it again")


def verify_split(url: str, recorded: list[dict[str, Any]]) -> list[str]:
    """Every problem of a local split directory against what its prepare recorded: :func:`check_shard_files`'s, then
    each shard file whose checksum is not the recorded one (corrupted without a change of size). Empty when whole."""
    try:
        check_shard_files(url, recorded)
    except ValueError as error:
        return [str(error)]
    problems = []
    for entry in recorded:
        path = os.path.join(url.removeprefix("local:"), entry["filename"])
        if entry["sha256"] is not None and shard_checksum(path) != entry["sha256"]:
            problems.append(f"the shard {path!r} does not hold the bytes its prepare wrote (its sha256 differs from "
                            "prepared.json's, at the same size): it is corrupted; copy it again, or prepare the data "
                            "again")
    return problems
