"""The reference for streamed data that shares no code with the loader (lightning_par/data/shard_windows.py,
share_check.py): a shard file written here byte by byte is read back as its windows, a bad header is refused, the
documented order deals contiguous ranges, and the share check names the first sample that no share holds. The
files litdata writes and the order it reads them in are held to these in tests/test_streaming_data.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_par.data.shard_windows import ShardWindows, documented_order, read_windows
from lightning_par.data.share_check import first_misread


def _write_split(root: Path, files: list[list[list[int]]], dtype: str = "uint16") -> None:
    """A prepared directory whose train split holds ``files``, each a list of items (documents' tokens), laid out
    as the module docstring of shard_windows says."""
    (root / "train").mkdir(parents=True)
    (root / "prepared.json").write_text(json.dumps({"dtype": dtype}))
    chunks = []
    for number, items in enumerate(files):
        header = (len(items) + 2) * 4
        ends = np.cumsum([0] + [len(item) * np.dtype(dtype).itemsize for item in items]) + header
        body = b"".join(np.asarray(item, dtype=dtype).tobytes() for item in items)
        data = np.asarray([len(items), *ends], dtype="<u4").tobytes() + body
        (root / "train" / f"chunk-{number}.bin").write_bytes(data)
        chunks.append({"filename": f"chunk-{number}.bin", "chunk_bytes": len(data)})
    (root / "train" / "index.json").write_text(json.dumps({"chunks": chunks}))


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_windows_are_cut_from_each_files_start_and_its_last_partial_one_dropped(tmp_path: Path, dtype: str) -> None:
    """Two files of 2 + 3 and 4 tokens, windows of 2 tokens: the first gives [0, 1], [2, 3] (token 4 left over),
    the second [10, 11], [12, 13]; a window never spans two files."""
    _write_split(tmp_path, [[[0, 1], [2, 3, 4]], [[10, 11, 12, 13]]], dtype)
    windows = read_windows(str(tmp_path), "train", seq_len=1)
    assert len(windows) == 4
    assert [window.tolist() for window in windows] == [[0, 1], [2, 3], [10, 11], [12, 13]]
    assert windows.take([3, 0]).tolist() == [[12, 13], [0, 1]] and windows.take([1]).dtype == np.int64


def test_a_file_its_header_does_not_describe_is_refused(tmp_path: Path) -> None:
    _write_split(tmp_path, [[[0, 1, 2]]])
    shard = tmp_path / "train" / "chunk-0.bin"
    shard.write_bytes(shard.read_bytes() + b"\0\0")
    with pytest.raises(ValueError, match=f"the shard '{shard}' is not a token shard of uint16 items: its header of 1 "
                                         "items does not describe its 20 bytes"):
        read_windows(str(tmp_path), "train", seq_len=1)
    with pytest.raises(ValueError, match="is in an object store: the shard files are read here from a local"):
        read_windows("s3://bucket/corpus", "train", seq_len=1)


def test_the_documented_order_deals_each_replica_a_contiguous_range() -> None:
    """11 windows, 2 replicas, batches of 2: cut to 8 (two global batches of 4), replica 0 reads 0-3, replica 1
    reads 4-7; each global batch is replica 0's batch then replica 1's."""
    assert documented_order(11, replicas=2, batch_size=2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert documented_order(11, replicas=1, batch_size=3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert documented_order(3, replicas=2, batch_size=2) == []


def test_the_share_check_names_the_first_sample_no_share_holds() -> None:
    """Windows 0-7 of one file, two of them with the same tokens (1 and 5): a share read in the documented order
    passes, and again in the next epoch; a window read by two replicas, a window read twice where the file holds its
    tokens once, a sample cut off a window boundary and one that begins as a window does but ends otherwise each
    fail at their step, naming the replica."""
    tokens = np.arange(16).reshape(8, 2)
    tokens[5] = tokens[1]
    sources = {"corpus": ShardWindows((tokens,))}
    batches = [tokens[[0, 1, 4, 5]], tokens[[2, 3, 6, 7]]]
    assert first_misread(batches, [0, 0], replicas=2, accumulate=1, sources=sources) is None
    assert first_misread(batches * 2, [0, 0, 1, 1], replicas=2, accumulate=1, sources=sources) is None
    overlap = [batches[0], tokens[[2, 3, 2, 3]]]
    assert first_misread(overlap, [0, 0], replicas=2, accumulate=1, sources=sources) == (
        1, "replica 1 read at step 2 window 2 of corpus, which replica 0 read at step 2 of this epoch: the replicas' "
           "shares overlap (docs/data.md, 'Shares')")
    thrice = [tokens[[1, 0, 5, 4]], tokens[[1, 3, 6, 7]]]  # tokens[1] is held twice, read three times
    reason = first_misread(thrice, [0, 0], replicas=2, accumulate=2, sources=sources)
    assert reason is not None and reason[0] == 1
    assert reason[1].startswith("replica 0 read at step 1 window 1 of corpus, which replica 0 read at step 1")
    assert reason[1].endswith("(2 windows of the files hold its tokens)")
    shifted = [batches[0], np.stack([tokens[2], tokens[3], tokens[6], np.r_[tokens[6][1], tokens[7][0]]])]
    assert first_misread(shifted, [0, 0], replicas=2, accumulate=1, sources=sources) == (
        1, "replica 1 trained at step 2 on a sample that is not a window of the shard files (seq_len + 1 tokens cut "
           "from a shard file's start, without overlap: docs/data.md, 'Samples')")
    long_windows = {"corpus": ShardWindows((np.arange(40).reshape(4, 10),))}
    last_token_off = np.arange(40).reshape(4, 10)[[2, 3]]
    last_token_off[1, -1] += 1  # begins as window 3 does
    assert first_misread([last_token_off], [0], replicas=2, accumulate=1, sources=long_windows) == (
        0, "replica 1 trained at step 1 on a sample that is not a window of the shard files (seq_len + 1 tokens cut "
           "from a shard file's start, without overlap: docs/data.md, 'Samples')")


def test_the_reference_shares_no_code_with_the_loader() -> None:
    """With litdata unimportable the reference's modules import, and they import neither of the loader's modules."""
    code = ("import sys\n"
            "sys.modules['litdata'] = None  # as if not installed\n"
            "import lightning_par.data.shard_windows, lightning_par.data.share_check\n"
            "print(sorted(name for name in sys.modules if name in ('lightning_par.data.shards', "
            "'lightning_par.data.streaming')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
