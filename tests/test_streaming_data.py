"""Pretraining data streamed from token shards prepared once (lightning_par.data.prepare, .shards, .streaming):
what prepare writes, each data-parallel replica's share, exact resume (also on another data-parallel size),
mixtures, every bad input refused, and training on streamed shards against one process on the same tokens in memory
under dp2, tp2, cp2 and pp2 x dp2, on the reference model and a Hugging Face model with packed documents."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import lightning
import numpy as np
import pytest
import torch
from harness import run_distributed
from installed import require
from parity import assert_parity, reference_run

require("litdata")

from lightning_par.data.corpus import is_validation_document, list_stdlib_documents  # noqa: E402
from lightning_par.data.documents import ByteTokenizer, load_document_tokenizer  # noqa: E402
from lightning_par.data.prepare import prepare, read_prepared  # noqa: E402

SEQ_LEN = 32  # a multiple of 4: ring attention over cp=2 cuts it into 4 chunks
BATCH = 4
STEPS = 20


# ------------------------------------------------------------------------------------------------ corpora
def _documents(total_bytes: int, seed: int = 0) -> list[str]:
    """Pieces of the standard library's sources, 100 to 1,500 characters each."""
    rng = random.Random(seed)
    text = "".join(path.read_text(errors="replace") for _, path in list_stdlib_documents()[:40])[:total_bytes]
    documents, start = [], 0
    while start < len(text):
        length = rng.randrange(100, 1500)
        documents.append(text[start:start + length].replace("\0", " "))
        start += length
    return documents


def _write_jsonl(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": document}) + "\n" for document in documents))
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Byte shards of ~150 KB of text (train and val), tiny ones for resuming, two sources for mixtures, and shards
    of proverbs with a Hugging Face tokenizer beside its model."""
    from hf_directories import LINES, make_model_directory

    root = tmp_path_factory.mktemp("streaming")
    documents = _documents(150_000)
    paths = {"documents": str(_write_jsonl(root / "documents.jsonl", documents))}
    prepare(paths["documents"], str(root / "bytes"), "bytes", val_fraction=0.1, num_workers=2, chunk_bytes="16KB",
            verbose=False)
    prepare(_write_jsonl(root / "small.jsonl", _documents(2_800, seed=1)).as_posix(), str(root / "small"), "bytes",
            num_workers=1, chunk_bytes="1KB", verbose=False)
    for name, letter in (("a", "a"), ("b", "b")):  # a source's windows hold its own letter only
        source = _write_jsonl(root / f"{name}.jsonl", [letter * random.Random(i).randrange(50, 200) for i in range(300)])
        prepare(str(source), str(root / f"source-{name}"), "bytes", num_workers=1, chunk_bytes="4KB", verbose=False)
    model = make_model_directory(root / "model", "llama-tied")
    proverbs = _write_jsonl(root / "proverbs.jsonl", LINES * 40)
    prepare(str(proverbs), str(root / "proverbs"), str(model), num_workers=1, chunk_bytes="2KB", verbose=False)
    return {**paths, "root": str(root), "bytes": str(root / "bytes"), "small": str(root / "small"),
            "a": str(root / "source-a"), "b": str(root / "source-b"), "model": str(model),
            "proverbs": str(root / "proverbs"), "proverbs_jsonl": str(proverbs)}


def _shard_tokens(split_dir: str) -> np.ndarray:
    """Every token of a split, in shard order, read from the shard files as litdata lays them out (a header of
    1 + items + 1 uint32, then the items' tokens)."""
    index = json.loads(Path(split_dir, "index.json").read_text())
    dtype = np.uint16 if index["config"]["data_format"] == ["no_header_tensor:20"] else np.int32
    pieces = []
    for chunk in index["chunks"]:
        data = Path(split_dir, chunk["filename"]).read_bytes()
        pieces.append(np.frombuffer(data[(chunk["chunk_size"] + 2) * 4:], dtype=dtype))
    return np.concatenate(pieces)


def _split_documents(tokens: np.ndarray, eos: int) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(tokens == eos)
    return [tuple(piece.tolist()) for piece in np.split(tokens, ends + 1) if len(piece)]


# ------------------------------------------------------------------------------------------------ prepare
def test_prepare_writes_every_document_once_closed_by_eos(corpora: dict[str, str]) -> None:
    """Each document's tokens and EOS, in the split its place decides, nothing lost or doubled (sorted multisets);
    uint16 for a vocabulary of 256; the metadata written last names the tokenizer and counts the tokens."""
    documents = [json.loads(line)["text"] for line in Path(corpora["documents"]).read_text().splitlines()]
    offsets = np.cumsum([0] + [len(line) + 1 for line in Path(corpora["documents"]).read_bytes().split(b"\n")[:-1]])
    expected: dict[str, list] = {"train": [], "val": []}
    for document, offset in zip(documents, offsets):
        split = "val" if is_validation_document(f"{corpora['documents']}:{offset}", 0.1) else "train"
        expected[split].append(tuple(ByteTokenizer().encode([document])[0]))
    prepared = read_prepared(corpora["bytes"])
    assert prepared.dtype == "uint16" and prepared.tokenizer["fingerprint"] == ByteTokenizer.fingerprint
    assert 0 < len(expected["val"]) < len(expected["train"])
    for split in ("train", "val"):
        tokens = _shard_tokens(os.path.join(corpora["bytes"], split))
        assert tokens.dtype == np.uint16 and prepared.tokens[split] == len(tokens)
        assert sorted(_split_documents(tokens, 0)) == sorted(expected[split]), split
    index = json.loads(Path(corpora["bytes"], "train", "index.json").read_text())
    assert len(index["chunks"]) >= 8  # a big file spreads over many shards


def test_prepare_with_a_hugging_face_tokenizer_encodes_as_it_does(corpora: dict[str, str]) -> None:
    """Each record as the tokenizer encodes a text (its special tokens included), closed by its EOS."""
    from hf_directories import LINES

    tokenizer = load_document_tokenizer(corpora["model"])
    tokens = _shard_tokens(os.path.join(corpora["proverbs"], "train"))
    documents = _split_documents(tokens, tokenizer.eos_token_id)
    expected = [(*tokenizer.tokenizer(line)["input_ids"], tokenizer.eos_token_id) for line in LINES * 40]
    assert sorted(documents) == sorted(expected)


def test_parquet_files_and_saved_datasets_give_the_documents_of_json_lines(corpora: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """The same records as parquet (two row groups), as a ``save_to_disk`` dataset and as a directory holding the
    JSON lines: the same documents in the shards."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in Path(corpora["proverbs_jsonl"]).read_text().splitlines()]
    pq.write_table(pa.table({"text": [r["text"] for r in records]}), tmp_path / "records.parquet",
                   row_group_size=len(records) // 2)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "records.jsonl").write_text(Path(corpora["proverbs_jsonl"]).read_text())
    eos = load_document_tokenizer(corpora["model"]).eos_token_id
    expected = sorted(_split_documents(_shard_tokens(os.path.join(corpora["proverbs"], "train")), eos))
    for name in ("records.parquet", "saved", "folder"):
        prepare(str(tmp_path / name), str(tmp_path / f"out-{name}"), corpora["model"], num_workers=1, verbose=False)
        tokens = _shard_tokens(str(tmp_path / f"out-{name}" / "train"))
        assert sorted(_split_documents(tokens, eos)) == expected, name


@pytest.mark.parametrize("tokenizer", ["bytes", "model"])
def test_text_that_is_not_utf8_is_refused_naming_the_file_and_byte(corpora: dict[str, str], tmp_path: Path,
                                                                   tokenizer: str) -> None:
    """A latin-1 text file, a UTF-16 one, a binary file named .txt and a JSON line with a latin-1 byte: each refused
    with the file and the byte's offset, with either tokenizer, where a lenient decode would tokenize other text.
    With the encoding named, or a policy for bad bytes, each is read as told; an unknown one is refused."""
    name = corpora["model"] if tokenizer == "model" else tokenizer
    cases = {"latin1.txt": ("café crème\n".encode("latin-1"), 3),
             "utf16.txt": ("text in UTF-16\n".encode("utf-16"), 0),
             "binary.txt": (bytes(range(200, 256)) * 4, 0),
             "records.jsonl": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', 17 + 13)}
    for file, (data, offset) in cases.items():
        (tmp_path / file).write_bytes(data)
        with pytest.raises(ValueError, match=f"{file}: the byte at offset {offset} .* is not utf-8"):
            prepare(str(tmp_path / file), str(tmp_path / f"out-{file}"), name, num_workers=1, verbose=False)
    # Named, the encoding decodes the text; a policy for bad bytes is applied as named.
    encoder = load_document_tokenizer(name)
    latin1 = prepare(str(tmp_path / "latin1.txt"), str(tmp_path / "latin1"), name, num_workers=1, verbose=False,
                     encoding="latin-1")
    assert _shard_tokens(latin1.split_url("train")).tolist() == encoder.encode(["café crème\n"])[0]
    assert latin1.settings["encoding"] == "iso8859-1"
    replaced = prepare(str(tmp_path / "records.jsonl"), str(tmp_path / "replaced"), name, num_workers=1,
                       verbose=False, decode_errors="replace")
    expected = [token for ids in encoder.encode(["fine", "caf\ufffd"]) for token in ids]
    assert _shard_tokens(replaced.split_url("train")).tolist() == expected
    for bad, message in (({"encoding": "klingon"}, "encoding='klingon' is not an encoding Python knows"),
                         ({"decode_errors": "shrug"}, "decode_errors='shrug' is not a policy Python knows")):
        with pytest.raises(ValueError, match=message):
            prepare(str(tmp_path / "latin1.txt"), str(tmp_path / "never"), name, num_workers=1, verbose=False, **bad)


def test_a_prepare_refused_for_no_training_text_runs_again_once_mended(tmp_path: Path) -> None:
    """Inputs without training text are refused after every part ran: nothing is left that a run with the inputs
    mended would trust (each part was recorded as done, and that run refused again)."""
    source = tmp_path / "records.jsonl"
    source.write_text('{"text": ""}\n{"text": null}\n')
    output = tmp_path / "out"
    with pytest.raises(ValueError, match="hold no training text"):
        prepare(str(source), str(output), "bytes", num_workers=1, verbose=False)
    assert not output.exists() or not any(output.iterdir())
    source.write_text('{"text": "now some text"}\n{"text": null}\n')
    prepared = prepare(str(source), str(output), "bytes", num_workers=1, verbose=False)
    assert prepared.tokens == {"train": len("now some text") + 1}


def test_prepare_resumes_a_stopped_run_and_refuses_to_overwrite(corpora: dict[str, str], tmp_path: Path) -> None:
    """A record that is not JSON stops a prepare in its third part with the file and byte; once it is mended, the
    prepare run again keeps the two parts it finished (their shards untouched) and ends with every document once,
    as a prepare that never stopped. Prepared again: kept as it is; with another tokenizer, or into a directory of
    other files: refused."""
    lines = Path(corpora["documents"]).read_bytes().split(b"\n")[:-1]
    offset = sum(len(line) + 1 for line in lines[:len(lines) * 3 // 4])
    bad = lines[len(lines) * 3 // 4]
    source = tmp_path / "documents.jsonl"
    source.write_bytes(b"\n".join(lines).replace(bad, b"x" * len(bad)) + b"\n")
    output = tmp_path / "out"
    options = dict(val_fraction=0.1, num_workers=1, chunk_bytes="16KB", items_per_part=3, verbose=False)
    with pytest.raises(ValueError, match=f"{source}: the line at byte {offset} is not JSON"):
        prepare(str(source), str(output), "bytes", **options)
    with pytest.raises(ValueError, match="a prepare started there did not finish: run it again to resume it"):
        read_prepared(str(output))
    progress = json.loads((output / "prepare.progress.json").read_text())
    assert progress["parts"]["train"] >= 2
    kept = {p.name: p.stat().st_mtime_ns for p in (output / "train").glob("*.bin")}
    source.write_bytes(b"\n".join(lines) + b"\n")
    prepared = prepare(str(source), str(output), "bytes", **options)
    assert {name: (output / "train" / name).stat().st_mtime_ns for name in kept} == kept
    assert not (output / "prepare.progress.json").exists()
    whole = tmp_path / "whole"
    assert prepare(str(source), str(whole), "bytes", **options).tokens == prepared.tokens
    for split in ("train", "val"):
        assert sorted(_split_documents(_shard_tokens(str(output / split)), 0)) == \
            sorted(_split_documents(_shard_tokens(str(whole / split)), 0))

    assert prepare(str(source), str(output), "bytes", **options).tokens == prepared.tokens
    with pytest.raises(ValueError, match="already holds data prepared from .* with the tokenizer 'bytes'"):
        prepare(str(source), str(output), corpora["model"], val_fraction=0.1, verbose=False)
    with pytest.raises(ValueError, match="is not empty and holds no prepare: give a new or empty output directory"):
        prepare(str(source), str(tmp_path), "bytes", verbose=False)


# ------------------------------------------------------------------------------------------------ streaming
def _replica(data_dir, replicas: int = 1, rank: int = 0, module=None, **kwargs):
    """The data module as data-parallel rank ``rank`` of ``replicas`` sets it up (the strategy's sampler
    arguments, as lightning_par's strategies give them), set up."""
    from lightning_par.data import StreamingTokenDataModule

    data = StreamingTokenDataModule(data_dir, **{"seq_len": SEQ_LEN, "batch_size": BATCH, **kwargs})
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(
        distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank}), lightning_module=module)
    data.setup("fit")
    return data


def _samples(batches) -> list[bytes]:
    return [row.numpy().astype(np.uint16).tobytes() for batch in batches for row in batch]


def _all_windows(split_dir: str, seq_len: int = SEQ_LEN) -> list[bytes]:
    """Every window the shards hold: each shard's tokens cut into seq_len + 1 from its start."""
    index = json.loads(Path(split_dir, "index.json").read_text())
    windows = []
    for chunk in index["chunks"]:
        data = Path(split_dir, chunk["filename"]).read_bytes()
        tokens = np.frombuffer(data[(chunk["chunk_size"] + 2) * 4:], dtype=np.uint16)
        windows += [tokens[i:i + seq_len + 1].tobytes() for i in range(0, len(tokens) - seq_len, seq_len + 1)]
    return windows


@pytest.mark.parametrize("workers", [0, 2])
def test_each_replica_reads_its_own_share_and_together_the_corpus(corpora: dict[str, str], workers: int) -> None:
    """Over an epoch, the replicas' samples are disjoint and their union is every window of the shards less the
    fewer than replicas x batch_size that do not fill a last global batch; two loaders of one replica (its tensor or
    pipeline ranks) read the same samples in the same order; every replica has the same number of batches."""
    windows = Counter(_all_windows(os.path.join(corpora["bytes"], "train")))  # source code repeats some windows
    for replicas in (1, 2, 3):
        shares = []
        for rank in range(replicas):
            loaders = [_replica(corpora["bytes"], replicas, rank, num_workers=workers).train_dataloader()
                       for _ in range(2)]
            first, second = (list(loader) for loader in loaders)
            assert len(first) == len(loaders[0]) and all(torch.equal(a, b) for a, b in zip(first, second))
            assert all(batch.dtype == torch.int64 and batch.shape == (BATCH, SEQ_LEN + 1) for batch in first)
            shares.append(_samples(first))
        assert len({len(share) for share in shares}) == 1
        union = Counter(sample for share in shares for sample in share)
        assert union <= windows  # no window read twice
        total = windows.total()
        assert total - union.total() == total % (replicas * BATCH), replicas


def _documented_batches(split_dir: str, replicas: int) -> list[torch.Tensor]:
    """One epoch's global batches in the documented order (docs/data.md, "Shares"), the windows read from the shard
    files by this test's own parser."""
    from lightning_par.data.shard_windows import documented_order

    windows = _all_windows(split_dir)
    return [torch.from_numpy(np.stack([np.frombuffer(windows[number], dtype=np.uint16) for number in numbers])
                             .astype(np.int64)) for numbers in documented_order(len(windows), replicas, BATCH)]


@pytest.mark.parametrize("replicas", [2, 3])
def test_one_process_draws_what_the_replicas_read_epoch_after_epoch(corpora: dict[str, str], replicas: int) -> None:
    """Without shuffling, over two epochs: each replica's loader reads its rows of the documented order (the windows
    in file order, cut to whole global batches, replica r the r-th contiguous range), and ``lightning-par verify``'s
    reference (lightning_par/data/drawn.py) draws those global batches from the shard files without the loader.
    Shuffled, the reference draws each epoch a share of the files (every window at most once, all but the last
    partial global batch), the second epoch in another order."""
    from lightning_par.data.drawn import OneProcessData
    from lightning_par.data.shard_windows import read_windows

    split = os.path.join(corpora["bytes"], "train")
    assert [window.tobytes() for window in read_windows(corpora["bytes"], "train", SEQ_LEN)] == _all_windows(split)
    expected = _documented_batches(split, replicas)
    for rank in range(replicas):
        loader = _replica(corpora["bytes"], replicas, rank, shuffle=False).train_dataloader()
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        for epoch in range(2):
            read = list(loader)
            assert len(read) == len(expected), (rank, epoch)
            assert all(torch.equal(a, b[rows]) for a, b in zip(read, expected)), (rank, epoch)
    drawn = OneProcessData(_replica(corpora["bytes"], shuffle=False), replicas, seed=0).train_dataloader()
    batches = [batch for _ in range(2) for batch in drawn]
    assert len(batches) == 2 * len(expected) and all(torch.equal(a, b) for a, b in zip(batches, expected * 2))

    windows = Counter(_all_windows(split))
    shuffled = OneProcessData(_replica(corpora["bytes"]), replicas, seed=0).train_dataloader()
    epochs = [_samples(shuffled) for _ in range(2)]
    for samples in epochs:
        assert Counter(samples) <= windows and len(samples) == len(expected) * replicas * BATCH
    assert epochs[0] != epochs[1]


def _resumed(data_dir: str, replicas: int, state: dict | None, workers: int, batches: int | None = None,
             **kwargs) -> tuple[list[list[bytes]], dict]:
    """Each replica's loader, resumed from ``state`` (one per replica) when given, read for ``batches`` (or to its
    epoch's end); returns the samples of each replica and each replica's state after them."""
    samples, states = [], []
    for rank in range(replicas):
        loader = _replica(data_dir, replicas, rank, num_workers=workers, **kwargs).train_dataloader()
        if state is not None:
            loader.load_state_dict(state[rank] if isinstance(state, list) else state)
        read = []
        for batch in loader:
            read.append(batch)
            if batches is not None and len(read) == batches:
                break
        samples.append(_samples(read))
        states.append(loader.state_dict())
    return samples, states


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_loader_continues_at_the_next_sample(corpora: dict[str, str], workers: int) -> None:
    """Stopped mid-epoch and resumed from its state: the rest of the epoch and the next epoch, bitwise, also when
    the resumed run is stopped and resumed once more; an epoch that ends at len(loader) (as Lightning ends it) ends
    the resumed state too."""
    data_dir = corpora["small"]
    whole = [_replica(data_dir, 2, rank, num_workers=workers).train_dataloader() for rank in range(2)]
    epochs = [[_samples(list(loader)) for loader in whole] for _ in range(2)]
    length = len(whole[0])
    assert length >= 6
    first, states = _resumed(data_dir, 2, None, workers, batches=2)
    second, states = _resumed(data_dir, 2, states, workers, batches=2)
    rest = []
    for rank in range(2):
        loader = _replica(data_dir, 2, rank, num_workers=workers).train_dataloader()
        loader.load_state_dict(states[rank])
        rest.append(_samples(list(loader)) + [None] + _samples(list(loader)))
    for rank in range(2):
        assert first[rank] + second[rank] + rest[rank] == epochs[0][rank] + [None] + epochs[1][rank], rank
    # In the second epoch: saved twice, once before any batch was drawn since the load.
    later = []
    for rank in range(2):
        loader = _replica(data_dir, 2, rank, num_workers=workers).train_dataloader()
        list(loader)  # the first epoch
        read = _samples([batch for _, batch in zip(range(2), loader)])
        for batches in (0, 1, None):
            state = loader.state_dict()
            loader = _replica(data_dir, 2, rank, num_workers=workers).train_dataloader()
            loader.load_state_dict(state)
            if batches is None:
                read += _samples(list(loader))
            elif batches:
                read += _samples([batch for _, batch in zip(range(batches), loader)])
        later.append(read)
    assert later == epochs[1]


def test_resuming_on_another_data_parallel_size_reads_the_rest_of_the_epoch(corpora: dict[str, str]) -> None:
    """2 replicas stop after 3 batches each (24 samples); 4 replicas (a global batch of 16) resume after the last
    whole global batch, 16: 8 samples are read again, none is skipped, and it says so; at 32 samples (a whole number
    of global batches) nothing is read again. The samples of the epoch are those of an uninterrupted one, less the
    remainder that does not fill a global batch. Another batch_size is rounded and said alike; another seq_len is
    refused."""
    data_dir = corpora["small"]
    windows = Counter(_all_windows(os.path.join(data_dir, "train")))
    for batches, repeated in ((3, 8), (4, 0)):
        before, states = _resumed(data_dir, 2, None, 0, batches=batches)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            after, _ = _resumed(data_dir, 4, states[0], 0)
        said = [str(w.message) for w in caught if "read again" in str(w.message)]
        assert (f"{repeated} samples are read again" in said[0]) if repeated else not said, said
        consumed = Counter(sample for share in before for sample in share)
        resumed = Counter(sample for share in after for sample in share)
        assert resumed <= windows
        assert ((consumed + resumed) - windows).total() == repeated
        assert (windows - consumed - resumed).total() < 4 * BATCH
    # Another batch_size rounds alike, to the new global batch (2 x 5: 4 of the 24 samples read again), and says so;
    # another seq_len would read other windows from the saved position: refused, with both lengths.
    before, states = _resumed(data_dir, 2, None, 0, batches=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after, _ = _resumed(data_dir, 2, states, 0, batch_size=5)
    said = [str(w.message) for w in caught if "read again" in str(w.message)]
    assert "24 samples into its epoch on 2 data-parallel replicas of batch_size 4" in said[0], said
    assert "4 samples are read again" in said[0], said
    consumed = Counter(sample for share in before for sample in share)
    resumed = Counter(sample for share in after for sample in share)
    assert ((consumed + resumed) - windows).total() == 4
    with pytest.raises(ValueError, match=rf"seq_len \+ 1 = {SEQ_LEN + 1} tokens, and this run's are {2 * SEQ_LEN + 1} "
                                         rf"\(seq_len={2 * SEQ_LEN}\): resume with seq_len={SEQ_LEN}"):
        _resumed(data_dir, 2, states, 0, seq_len=2 * SEQ_LEN)


def test_a_mixture_follows_its_weights_and_resumes_exactly(corpora: dict[str, str]) -> None:
    """Weights 3:1 over two sources whose windows are all 'a' or all 'b': over the mixture's epoch the share of 'a'
    is 0.75 within 4 standard errors, the replicas read the same source at each position (one draw sequence) and
    different samples; a mixture resumed from its state continues bitwise."""
    mixture = {corpora["a"]: 3.0, corpora["b"]: 1.0}
    loaders = [_replica(mixture, 2, rank, seq_len=8, batch_size=2).train_dataloader() for rank in range(2)]
    epochs = [list(loader) for loader in loaders]
    assert len(epochs[0]) == len(epochs[1])
    letters = [[chr(int(sample.max())) for batch in epoch for sample in batch] for epoch in epochs]  # EOS is 0
    assert letters[0] == letters[1]
    samples = len(letters[0])
    share = letters[0].count("a") / samples
    assert samples > 300 and abs(share - 0.75) < 4 * (0.75 * 0.25 / samples) ** 0.5, (share, samples)
    first, states = _resumed(mixture, 2, None, 0, batches=5, seq_len=8, batch_size=2)
    rest, _ = _resumed(mixture, 2, states, 0, seq_len=8, batch_size=2)
    for rank in range(2):
        assert first[rank] + rest[rank] == _samples(epochs[rank])
    with pytest.raises(ValueError, match="litdata resumes a weighted mixture only on the same"):
        _resumed(mixture, 4, states[0], 0, seq_len=8, batch_size=2)


# ------------------------------------------------------------------------------------------------ bad input
def _copy(source: str, destination: Path) -> str:
    import shutil

    shutil.copytree(source, destination)
    return str(destination)


def _llama(vocab_size: int = 256):
    from lightning_par.models import LlamaLM

    return LlamaLM(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ_LEN,
                   max_steps=STEPS)


def test_bad_inputs_are_refused_with_the_file_or_value(corpora: dict[str, str], tmp_path: Path) -> None:
    """A missing or truncated shard, an unprepared directory, shards of another tokenizer than the model's, a
    vocabulary larger than the model's, a mixture of two tokenizers, a weight that is not positive and finite, one
    directory named twice in a mixture, a mixture read by workers, too little text: each refused with the file or
    value, in set-up, before any batch."""
    from lightning_par.data import StreamingTokenDataModule

    copy = _copy(corpora["bytes"], tmp_path / "copy")
    shard = sorted(Path(copy, "train").glob("*.bin"))[3]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"the shard '{shard}' holds 100 bytes where its index.json records"):
        _replica(copy)
    shard.unlink()
    with pytest.raises(ValueError, match=f"the shard '{shard}' is missing"):
        _replica(copy)
    with pytest.raises(ValueError, match=re.escape(f"'{tmp_path}' holds no prepared data (no prepared.json): "
                                                   "prepare it with `lightning-par prepare")):
        _replica(str(tmp_path))
    with pytest.raises(ValueError, match=r"was prepared with the tokenizer 'bytes', which gives other ids than the "
                                         r"model's \('.*model'\): prepare it again with --tokenizer"):
        _replica(corpora["bytes"], tokenizer=corpora["model"])
    hf_model = SimpleNamespace(hparams={"pretrained": corpora["model"]}, model_config=SimpleNamespace(vocab_size=64))
    with pytest.raises(ValueError, match="which gives other ids than the model's"):
        _replica(corpora["bytes"], module=hf_model)
    with pytest.raises(ValueError, match="of 256 tokens, more than the model's vocab_size=128"):
        _replica(corpora["bytes"], module=_llama(vocab_size=128))
    with pytest.raises(ValueError, match="the sources of the mixture were prepared with different tokenizers"):
        _replica({corpora["bytes"]: 1.0, corpora["proverbs"]: 1.0})
    for weight in (0, -1.0, "x", float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"the weight of 'b' is {weight!r}; weights must be positive finite"):
            StreamingTokenDataModule({"a": 1.0, "b": weight})
    with pytest.raises(ValueError, match="names one directory twice, as '.*source-a' and '.*source-a/'"):
        StreamingTokenDataModule({corpora["a"]: 1.0, corpora["a"] + "/": 1.0})
    with pytest.raises(ValueError, match="names one directory twice"):
        StreamingTokenDataModule({"s3://bucket/a": 1.0, "s3://bucket/a/": 2.0})
    with pytest.raises(ValueError, match="encoding='utf-9' is not an encoding Python knows"):
        StreamingTokenDataModule(str(tmp_path / "new"), prepare_from=corpora["documents"], encoding="utf-9")
    with pytest.raises(ValueError, match="num_workers=2 with a mixture of 2 sources"):
        StreamingTokenDataModule({corpora["a"]: 1.0, corpora["b"]: 1.0}, num_workers=2)
    with pytest.raises(ValueError, match="holds 2.* training tokens: fewer than one batch of 4 samples of seq_len "
                                         "\\+ 1 = 1025 tokens for each of 2 data-parallel replicas"):
        _replica(corpora["small"], 2, 0, seq_len=1024)


# ------------------------------------------------------------------------------------------------ training
class InMemoryWindows(lightning.LightningDataModule):
    """The reference's data: the windows of the documented order, each taken from the corpus tokenized in memory
    (found there by its tokens), in the order of the global batches: step by step, replica by replica."""

    def __init__(self, samples: list[torch.Tensor], batch_size: int, separator: int) -> None:
        super().__init__()
        self.samples, self.batch_size, self.shuffle, self.document_separator = samples, batch_size, False, separator

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.samples, batch_size=self.batch_size)


def _in_memory(data_dir: str, documents: list[str], tokenizer: str, replicas: int, steps: int) -> InMemoryWindows:
    """The first ``steps`` global batches of the documented order (the shard files read by this test, not by the
    loader), each sample found in the tokens of ``documents`` (the training split's, in their order) encoded in
    memory, and taken from there."""
    encoder = load_document_tokenizer(tokenizer)
    stream = np.asarray([token for ids in encoder.encode(documents) for token in ids], dtype=np.uint16).tobytes()
    batches = _documented_batches(os.path.join(data_dir, "train"), replicas)
    assert len(batches) >= steps, "the epoch is shorter than the run"
    samples = []
    for batch in batches[:steps]:
        for row in batch:
            window = row.numpy().astype(np.uint16).tobytes()
            offset = stream.find(window)
            while offset >= 0 and offset % 2:  # a match must start on a token
                offset = stream.find(window, offset + 1)
            assert offset >= 0, "a window of the shard files is not in the corpus tokenized in memory"
            start = offset // 2
            samples.append(torch.from_numpy(np.frombuffer(stream, dtype=np.uint16)[start:start + SEQ_LEN + 1]
                                            .astype(np.int64)))
    return InMemoryWindows(samples, BATCH, encoder.eos_token_id)


def _training_documents(corpora: dict[str, str], name: str) -> list[str]:
    """The documents of the training split of ``name``'s source, in their order."""
    source = corpora["documents" if name == "bytes" else "proverbs_jsonl"]
    val_fraction = read_prepared(corpora[name]).settings["val_fraction"]
    documents, offset = [], 0
    for line in Path(source).read_bytes().split(b"\n")[:-1]:
        if not (val_fraction and is_validation_document(f"{source}:{offset}", val_fraction)):
            documents.append(json.loads(line)["text"])
        offset += len(line) + 1
    return documents


def _hf_model(directory: str):
    from lightning_par.models import HFCausalLM

    return HFCausalLM(pretrained=directory, packed_documents=True, learning_rate=1e-3, warmup_steps=2, max_steps=STEPS)


def _streamed(data_dir: str, **kwargs):
    from lightning_par.data import StreamingTokenDataModule

    return StreamingTokenDataModule(data_dir, **{"seq_len": SEQ_LEN, "batch_size": BATCH, **kwargs})


def _hybrid(**sizes):
    from lightning_par.strategies import Hybrid3DStrategy

    return Hybrid3DStrategy(**sizes)


# name: (world size, source, model, layout)
LAYOUTS = {
    "dp2": (2, "bytes", "llama", dict(data_parallel_size=2)),
    "tp2-hf-packed": (2, "proverbs", "hf", dict(tensor_parallel_size=2, sequence_parallel=True)),
    "cp2-hf-packed": (2, "proverbs", "hf", dict(context_parallel_size=2, context_parallel_method="ring")),
    "pp2xdp2": (4, "bytes", "llama", dict(pipeline_parallel_size=2, data_parallel_size=2, microbatches=2)),
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_training_on_streamed_shards_matches_one_process_on_the_same_tokens_in_memory(corpora: dict[str, str],
                                                                                     world_size: int) -> None:
    """20 AdamW steps of each layout on shards streamed without shuffling against one process on the windows of the
    corpus tokenized in memory, in the documented order's global batches (docs/data.md, "Shares": placed by this
    test, not read from the loader): the reference model on byte shards
    under dp2 and pp2 x dp2, a Hugging Face Llama with packed documents (its masks from the shards' EOS) under tp2
    with sequence parallel and under cp2 (ring attention)."""
    from parity import layout_runs

    models = {"llama": _llama, "hf": functools.partial(_hf_model, corpora["model"])}
    cases = {name: case for name, case in LAYOUTS.items() if case[0] == world_size}
    runs = {name: (models[model], functools.partial(_streamed, corpora[source], shuffle=False),
                   functools.partial(_hybrid, **sizes))
            for name, (_, source, model, sizes) in cases.items()}
    results = layout_runs(runs, world_size=world_size, steps=STEPS, timeout=540)
    for name, (_, source, model, sizes) in cases.items():
        replicas = sizes.get("data_parallel_size", 1)
        memory = _in_memory(corpora[source], _training_documents(corpora, source),
                            corpora["model"] if model == "hf" else "bytes", replicas, STEPS)
        expected = reference_run(models[model], lambda memory=memory: memory, dp=replicas, steps=STEPS)
        # Adam turns rounding differences (the reference's matmuls run on as many threads as the test process has)
        # into weight differences of up to ~2e-5 of a tensor's largest: held to a thousandth of the farthest Adam
        # can move a weight (tests/parity.py, assert_parity).
        learning_rate = models[model]().hparams.learning_rate
        loss_error, weight_error = assert_parity(results[name], expected, rtol=1e-5,
                                                 weight_atol=1e-3 * learning_rate * STEPS)
        print(f"{name}: loss {loss_error:.1e}, weights {weight_error:.1e}")


class RecordSamples(lightning.Callback):
    """The samples of every batch this rank trains on, and its losses."""

    def __init__(self) -> None:
        self.samples: list[bytes] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.samples += _samples([batch])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class KilledAt(lightning.Callback):
    """Every rank fails at the end of step ``step``, as a run whose processes are killed there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"killed at step {self.step}")


def _fit_streamed(rank: int, world_size: int, data_dir: str, directory: str, *, seed: int, workers: int,
                  ckpt_path: str | None = None, killed_at: int | None = None, max_steps: int = -1,
                  max_epochs: int | None = None) -> dict:
    """Data parallel over every rank, a checkpoint every 3 steps; what each rank trained on."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(seed)
    record = RecordSamples()
    callbacks = [record, ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)]
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy="data_parallel", max_steps=max_steps,
                                max_epochs=max_epochs, callbacks=callbacks + ([KilledAt(killed_at)] if killed_at else []),
                                logger=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0, limit_val_batches=0)
    try:
        trainer.fit(_llama(), datamodule=_streamed(data_dir, num_workers=workers), ckpt_path=ckpt_path)
    except RuntimeError as error:
        assert f"killed at step {killed_at}" in str(error)
    return {"samples": record.samples, "losses": record.losses, "step": trainer.global_step,
            "epoch_batches": len(trainer.train_dataloader),
            "state": trainer.strategy.consolidated_state_dict() if killed_at is None else None}


def test_a_killed_run_resumes_at_the_next_sample_bitwise_and_on_another_data_parallel_size(
        corpora: dict[str, str], tmp_path: Path) -> None:
    """2 replicas, 14 steps across an epoch's end; a run killed at step 7 and resumed from its step-6 checkpoint
    (another seed) trains the same samples, losses and weights, bitwise (loader workers, which the test's ranks
    cannot start, are resumed in the test of the loader above). The same checkpoint
    resumed on 1 replica reads the rest of the epoch: with the 48 samples before it, every window of the epoch once,
    but for the last ones that do not fill a global batch."""
    data_dir = corpora["small"]
    whole = run_distributed(_fit_streamed, 2, data_dir, str(tmp_path / "whole"), seed=0, workers=0, max_steps=14)
    assert whole[0]["epoch_batches"] < 14  # the epoch ends inside the run
    run_distributed(_fit_streamed, 2, data_dir, str(tmp_path / "killed"), seed=0, workers=0, killed_at=7,
                    max_steps=14)
    checkpoint = str(tmp_path / "killed" / "epoch=0-step=6.ckpt")
    resumed = run_distributed(_fit_streamed, 2, data_dir, str(tmp_path / "resumed"), seed=1, workers=0,
                              ckpt_path=checkpoint, max_steps=14)
    for rank in range(2):
        assert resumed[rank]["samples"] == whole[rank]["samples"][6 * BATCH:], rank
        assert resumed[rank]["losses"] == whole[rank]["losses"][6:], rank
    for name, tensor in whole[0]["state"].items():
        assert torch.equal(resumed[0]["state"][name], tensor), name

    (one,) = run_distributed(_fit_streamed, 1, data_dir, str(tmp_path / "one"), seed=1, workers=0,
                             ckpt_path=checkpoint, max_epochs=1)
    consumed = Counter(sample for rank in range(2) for sample in whole[rank]["samples"][:6 * BATCH])
    rest = Counter(one["samples"])
    windows = Counter(_all_windows(os.path.join(data_dir, "train")))
    assert one["samples"] and (consumed + rest) <= windows  # nothing read twice
    assert (windows - consumed - rest).total() < 2 * BATCH  # nothing skipped but the last partial global batch


def test_the_planner_reads_the_batch_and_sequence_length(corpora: dict[str, str]) -> None:
    from lightning_par.strategies.hybrid3d import _loader_shape

    assert _loader_shape(_streamed(corpora["bytes"], seq_len=64, batch_size=2), _llama()) == (2, 64)


def _fit_until_refused(rank: int, world_size: int, data_dir: str) -> str:
    import torch.distributed as dist

    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy="data_parallel", max_steps=1,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False)
    try:
        trainer.fit(_llama(), datamodule=_streamed(data_dir))
    except ValueError as error:
        dist.barrier()  # every rank got here: none is left waiting in a collective
        return str(error)
    raise AssertionError("not refused")


def test_a_truncated_shard_is_refused_on_every_rank_before_training(corpora: dict[str, str], tmp_path: Path) -> None:
    copy = _copy(corpora["bytes"], tmp_path / "copy")
    shard = sorted(Path(copy, "val").glob("*.bin"))[-1]
    shard.write_bytes(shard.read_bytes()[:-2])
    messages = run_distributed(_fit_until_refused, 2, copy)
    assert len(set(messages)) == 1 and f"the shard '{shard}' holds" in messages[0], messages


def test_the_prepare_command(corpora: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``lightning-par prepare`` writes what ``prepare`` writes and says so in a line; a bad input is one line too."""
    from lightning_par.cli.main import main

    main(["prepare", "--input", corpora["proverbs_jsonl"], "--output", str(tmp_path / "out"), "--tokenizer",
          corpora["model"], "--workers", "1", "--chunk-bytes", "2KB"])
    said = capsys.readouterr().out.strip().splitlines()[-1]
    tokens = read_prepared(corpora["proverbs"]).tokens["train"]
    assert said == f"prepared {tmp_path / 'out'}: train {tokens:,} tokens (uint16, tokenizer {corpora['model']})"
    with pytest.raises(SystemExit) as exit_code:
        main(["prepare", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "other"),
              "--tokenizer", "bytes"])
    assert exit_code.value.code == 1
    assert f"lightning-par: error: input '{tmp_path / 'missing.jsonl'}' does not exist" in capsys.readouterr().err
