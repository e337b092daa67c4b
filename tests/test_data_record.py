"""Prepared data held to what its prepare made (lightning_par.data.shard_record, .prepare, .shards): every shard
file recorded with its checksum and checked against the index at set-up, ``prepare --verify``, parts recorded only
when their shards are whole, resume refused on other data and taken on moved data, and large documents tokenized
in parts that give the ids of the whole."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from installed import require

require("litdata")

import lightning_par.data.prepare as prepare_module  # noqa: E402
from lightning_par.data.documents import load_document_tokenizer, part_end, piece_bytes, work_items  # noqa: E402
from lightning_par.data.prepare import main, prepare, read_prepared, verify_prepared  # noqa: E402

SEQ_LEN, BATCH = 16, 2


def _text(words: int, seed: int, *, newline_every: int = 12) -> str:
    rng = random.Random(seed)
    vocabulary = ["alpha", "beta", "gamma", "delta", "the", "of", "über", "naïve", "x1", "—", "data,"]
    return "".join(rng.choice(vocabulary) + ("\n" if i % newline_every == newline_every - 1 else " ")
                   for i in range(words))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Byte shards of one JSON-lines corpus, and of another corpus; the same first corpus with a BPE tokenizer."""
    from hf_directories import save_tokenizer

    root = tmp_path_factory.mktemp("record")
    paths = {}
    for name, seed in (("one", 0), ("other", 1)):
        source = root / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"text": _text(random.Random(i).randrange(20, 200), seed * 1000 + i)})
                                  + "\n" for i in range(120)))
        paths[f"{name}_jsonl"] = str(source)
        prepare(str(source), str(root / name), "bytes", val_fraction=0.1, num_workers=2, chunk_bytes="4KB",
                verbose=False)
        paths[name] = str(root / name)
    save_tokenizer(root / "bpe")
    prepare(paths["one_jsonl"], str(root / "one-bpe"), str(root / "bpe"), num_workers=1, chunk_bytes="4KB",
            verbose=False)
    return {**paths, "root": str(root), "bpe": str(root / "bpe"), "one_bpe": str(root / "one-bpe")}


def _module(data_dir, **kwargs):
    from lightning_par.data import StreamingTokenDataModule

    data = StreamingTokenDataModule(data_dir, **{"seq_len": SEQ_LEN, "batch_size": BATCH, "shuffle": False, **kwargs})
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 1, "rank": 0}),
                                   lightning_module=None)
    data.setup("fit")
    return data


# ------------------------------------------------------------------------------------------------ the record
def test_prepared_json_records_every_shard_and_verify_finds_a_corrupted_one(prepared: dict[str, str], tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """prepared.json lists each split's shard files as their index does, with their bytes, tokens and sha256; the
    token counts are their sums. `prepare --verify` passes the directory, and names a shard with one byte changed
    (same size: set-up's size check cannot see it) and a removed index entry."""
    data = read_prepared(prepared["one"])
    for split in ("train", "val"):
        index = json.loads(Path(prepared["one"], split, "index.json").read_text())
        assert [(s["filename"], s["bytes"], s["tokens"]) for s in data.shards[split]] == \
            [(c["filename"], c["chunk_bytes"], c["dim"]) for c in index["chunks"]]
        for shard in data.shards[split]:
            digest = hashlib.sha256(Path(prepared["one"], split, shard["filename"]).read_bytes()).hexdigest()
            assert shard["sha256"] == "sha256:" + digest
        assert data.tokens[split] == sum(shard["tokens"] for shard in data.shards[split]) > 0
    assert verify_prepared(prepared["one"]) == []
    main(["--verify", prepared["one"]])
    assert f"verified {prepared['one']}: {len(data.shards['train']) + len(data.shards['val'])} shard files whole" in \
        capsys.readouterr().out

    copy = Path(shutil.copytree(prepared["one"], tmp_path / "copy"))
    shard = copy / "train" / data.shards["train"][2]["filename"]
    content = bytearray(shard.read_bytes())
    content[-3] ^= 0xFF
    shard.write_bytes(bytes(content))
    _module(str(copy))  # the same size: set-up passes
    with pytest.raises(SystemExit, match=f"the shard '{shard}' does not hold the bytes its prepare wrote"):
        main(["--verify", str(copy)])
    with pytest.raises(SystemExit, match="holds no prepared data"):
        main(["--verify", str(tmp_path)])


def test_an_index_that_lies_is_refused_at_set_up_naming_the_shard(prepared: dict[str, str], tmp_path: Path) -> None:
    """Two entries removed from index.json (their data would be dropped silently), an edited token count (a numpy
    buffer error mid-epoch), an entry of another prepare: each refused by every rank's set-up, naming the shard."""
    names = [shard["filename"] for shard in read_prepared(prepared["one"]).shards["train"]]
    cases = {
        "removed": (lambda chunks: chunks[:1] + chunks[3:],
                    f"does not list the shard '{names[1]}' that prepared.json records \\({len(names) - 2} shards "
                    f"listed, {len(names)} made\\)"),
        "edited": (lambda chunks: [{**c, "dim": c["dim"] + 100} if i == 4 else c for i, c in enumerate(chunks)],
                   f"lists the shard '{names[4]}' with tokens \\d+ where prepared.json records \\d+"),
        "foreign": (lambda chunks: chunks + [{**chunks[0], "filename": "chunk-9-9.bin"}],
                    "lists the shard 'chunk-9-9.bin', which prepared.json does not record"),
    }
    for name, (edit, message) in cases.items():
        copy = Path(shutil.copytree(prepared["one"], tmp_path / name))
        if name == "foreign":
            shutil.copy(copy / "train" / names[0], copy / "train" / "chunk-9-9.bin")
        index_path = copy / "train" / "index.json"
        index = json.loads(index_path.read_text())
        index["chunks"] = edit(index["chunks"])
        index_path.write_text(json.dumps(index))
        with pytest.raises(ValueError, match=message):
            _module(str(copy))
        assert any(message.split("\\")[0].split("'")[0] in problem for problem in verify_prepared(str(copy)))


def test_a_part_is_recorded_only_when_its_shards_are_whole(prepared: dict[str, str], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A part whose shard file is gone when it ends (a worker killed, a disk full) stops the prepare, naming the
    file, and is not recorded; the same command run again does it again and ends as a prepare that never
    stopped, shard for shard."""
    tokenize_part = prepare_module._tokenize_part
    calls = []

    def losing_a_shard(store, split, items, *args, kept, **kwargs):
        tokenize_part(store, split, items, *args, kept=kept, **kwargs)
        calls.append(split)
        if len(calls) == 2:
            sorted(Path(store.url(split)).glob("chunk-*.bin"))[-1].unlink()

    options = dict(val_fraction=0.1, num_workers=1, chunk_bytes="4KB", items_per_part=4, verbose=False)
    output = tmp_path / "out"
    monkeypatch.setattr(prepare_module, "_tokenize_part", losing_a_shard)
    with pytest.raises(ValueError, match=r"the shard '.*chunk-.*\.bin' is missing"):
        prepare(prepared["one_jsonl"], str(output), "bytes", **options)
    progress = json.loads((output / "prepare.progress.json").read_text())
    assert progress["parts"]["train"] == 1
    monkeypatch.undo()
    again = prepare(prepared["one_jsonl"], str(output), "bytes", **options)
    whole = prepare(prepared["one_jsonl"], str(tmp_path / "whole"), "bytes", **options)
    assert again.shards == whole.shards


# ------------------------------------------------------------------------------------------------ resume
def _read(loader, batches: int | None = None) -> list[bytes]:
    read = []
    for batch in loader:
        read.append(batch.numpy().tobytes())
        if len(read) == batches:
            break
    return read


def test_resume_refuses_other_data_naming_both_and_takes_the_same_data_moved(prepared: dict[str, str],
                                                                              tmp_path: Path) -> None:
    """A loader state saved on one directory: resumed on that directory moved elsewhere, the epoch goes on at the
    next sample (litdata alone refuses another path); resumed on data prepared with another tokenizer, or on other
    text, refused naming both; a mixture alike."""
    moved = shutil.copytree(prepared["one"], tmp_path / "moved")
    whole = _read(_module(str(moved)).train_dataloader())
    loader = _module(prepared["one"]).train_dataloader()
    first = _read(loader, 3)
    state = loader.state_dict()
    resumed = _module(str(moved)).train_dataloader()
    resumed.load_state_dict(state)
    assert first + _read(resumed) == whole
    assert resumed.state_dict()[resumed.SOURCES][0]["directory"] == str(moved)
    with pytest.raises(ValueError, match=rf"data '{prepared['one']}' was tokenized with 'bytes' and this run's "
                                         rf"'{prepared['one_bpe']}' with '{prepared['bpe']}'"):
        _module(prepared["one_bpe"]).train_dataloader().load_state_dict(state)
    with pytest.raises(ValueError, match=rf"data '{prepared['one']}' \(sha256:\w+\) is not this run's "
                                         rf"'{prepared['other']}' \(sha256:\w+\): it was prepared again"):
        _module(prepared["other"]).train_dataloader().load_state_dict(state)
    mixture = {prepared["one"]: 1.0, prepared["other"]: 1.0}
    whole = _read(_module(mixture).train_dataloader())
    loader = _module(mixture).train_dataloader()
    first = _read(loader, 2)
    state = loader.state_dict()
    resumed = _module({str(moved): 1.0, prepared["other"]: 1.0}).train_dataloader()
    resumed.load_state_dict(state)
    assert first + _read(resumed) == whole
    with pytest.raises(ValueError, match="is not this run's"):
        _module({prepared["other"]: 1.0, prepared["one"]: 1.0}).train_dataloader().load_state_dict(state)


# ------------------------------------------------------------------------------------------------ large documents
def _shard_tokens(split_dir: str) -> np.ndarray:
    index = json.loads(Path(split_dir, "index.json").read_text())
    dtype = np.uint16 if index["config"]["data_format"] == ["no_header_tensor:20"] else np.int32
    return np.concatenate([np.frombuffer(Path(split_dir, c["filename"]).read_bytes()[(c["chunk_size"] + 2) * 4:],
                                         dtype=dtype) for c in index["chunks"]])


def _byte_level_bpe(directory: Path) -> str:
    """A GPT-2-style tokenizer (byte-level BPE, whose pre-tokenizer keeps a space with the word after it)."""
    from hf_directories import LINES
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(LINES + [_text(2000, 5)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    return str(directory)


def test_large_documents_are_tokenized_in_parts_that_give_the_ids_of_the_whole(prepared: dict[str, str],
                                                                              tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Text files larger than a piece are cut into pieces spread over the workers, and documents longer than the
    tokenizer is given at once into parts: each file is still one document whose ids are those of the whole text
    (the tokenizer's leading special tokens once, EOS once), with the bytes tokenizer, the BPE of the tiny models
    (a BOS before each document) and a byte-level BPE; a line without whitespace is cut at a character boundary
    (exact for bytes)."""
    monkeypatch.setattr(prepare_module, "_ENCODE_CHARACTERS", 700)  # the forked workers see it too
    files = tmp_path / "files"
    files.mkdir()
    texts = {"lines.txt": _text(4000, 7), "one-line.txt": _text(3000, 8, newline_every=10 ** 9),
             "small.txt": _text(50, 9)}
    for name, text in texts.items():
        (files / name).write_text(text)
    items = work_items([str(files)], piece_bytes=4096)
    assert [item[0] for item in items] == ["text"] * len(items) and len(items) >= 10
    for tokenizer in ("bytes", prepared["bpe"], _byte_level_bpe(tmp_path / "byte-level")):
        output = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        prepare(str(files), str(output), tokenizer, num_workers=2, chunk_bytes="16KB", verbose=False)
        expected = load_document_tokenizer(tokenizer).encode([texts[name] for name in sorted(texts)])
        assert _shard_tokens(str(output / "train")).tolist() == [token for ids in expected for token in ids], tokenizer
    unspaced = tmp_path / "unspaced"
    unspaced.mkdir()
    (unspaced / "word.txt").write_text("ü" * 3000 + "x")  # two bytes a character: a cut at 2,048 splits one
    prepare(str(unspaced), str(tmp_path / "unspaced-out"), "bytes", num_workers=1, chunk_bytes="8KB", verbose=False)
    assert _shard_tokens(str(tmp_path / "unspaced-out" / "train")).tolist() == [*("ü" * 3000 + "x").encode(), 0]


def test_part_end_cuts_before_the_last_whitespace_run_or_at_a_character() -> None:
    assert part_end("abc def", 10) == 7
    assert part_end("alpha beta  gamma", 12) == 10  # before the run of two spaces
    assert part_end("alpha\n\ngamma delta", 8) == 5
    assert part_end("abcdefgh", 5) == 5
    assert part_end("  abcdefgh", 5) == 5
    data = "aü".encode() * 4  # 3 bytes each: a, then ü in 2
    assert part_end(data, 5) == 4 and data[:4].decode() == "aüa"


def test_pieces_scale_with_the_workers(tmp_path: Path) -> None:
    """A 100 MB JSON-lines file (sparse) gives 4 pieces per worker up to a quarter of a shard, never under 1 MiB."""
    source = tmp_path / "big.jsonl"
    with open(source, "wb") as file:
        file.truncate(100 << 20)
    assert piece_bytes([str(source)], workers=16, largest=16 << 20) == (100 << 20) // 64
    assert piece_bytes([str(source)], workers=2, largest=16 << 20) == 12_800 << 10
    assert piece_bytes([str(source)], workers=1000, largest=16 << 20) == 1 << 20
    assert piece_bytes([str(tmp_path)], workers=16, largest=4096) == 4096
