"""TextDataModule: local text, JSON lines and save_to_disk datasets, tokenized with a model directory's tokenizer,
packed with EOS between documents; every bad input refused with its name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from installed import require
import torch

require("transformers")
require("datasets")

from hf_directories import LINES, make_model_directory, write_corpus  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_directory(tmp_path_factory.mktemp("model"), "llama-tied")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _data(model_dir: Path, train_files, **kwargs):
    from lightning_par.data import TextDataModule

    return TextDataModule(train_files=train_files, **{"tokenizer": str(model_dir), "seq_len": 16, **kwargs})


def test_documents_are_packed_with_eos_between_them(model_dir: Path, corpus: dict[str, Path]) -> None:
    """The stream is each record's tokens followed by EOS, in order; the windows are seq_len + 1 long and overlap by
    one token; the held-out tail is the last val_fraction of the stream."""
    data = _data(model_dir, str(corpus["jsonl"]), val_fraction=0.1)
    data.setup("fit")
    tokenizer = data.tokenizer
    expected = []
    for line in LINES * 6:
        expected += tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]
    train, val = data._full["train"].tokens, data._full["val"].tokens
    assert torch.cat([train, val]).tolist() == expected
    assert val.numel() == round(len(expected) * 0.1)
    assert data.train_dataset[1].tolist() == expected[16:33]
    assert tokenizer.decode(expected[:expected.index(tokenizer.eos_token_id)]).replace(" ", "") == \
        LINES[0].replace(" ", "")


def test_text_paragraphs_jsonl_and_a_saved_dataset_give_the_same_stream(model_dir: Path, corpus: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    import datasets

    streams = {}
    for name, files, kwargs in (("jsonl", str(corpus["jsonl"]), {}),
                                ("text", [str(corpus["text"])], {"sample_by": "paragraph"})):
        data = _data(model_dir, files, val_fraction=0.0, **kwargs)
        data.setup("fit")
        streams[name] = data._full["train"].tokens
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": LINES * 6}),
                          "validation": datasets.Dataset.from_dict({"body": LINES[:3]})}).save_to_disk(str(saved))
    data = _data(model_dir, str(saved), val_files=str(saved), text_field="body")
    data.setup("fit")
    assert torch.equal(streams["jsonl"], streams["text"])
    assert torch.equal(data._full["train"].tokens, streams["jsonl"])
    assert data._full["val"].tokens.numel() < streams["jsonl"].numel() / 6
    one_document = _data(model_dir, str(corpus["text"]), val_fraction=0.0)  # the whole file, one EOS at its end
    one_document.setup("fit")
    tokens = one_document._full["train"].tokens
    assert (tokens == one_document.tokenizer.eos_token_id).sum() == 1 and tokens[-1] == 2


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD_INPUTS = {
    "missing file": (lambda d: dict(train_files=str(d / "nowhere.jsonl")),
                     "train_files: '.*nowhere.jsonl' does not exist"),
    "empty file": (lambda d: dict(train_files=_write(d / "empty.jsonl", "\n")),
                   "train_files: .*empty.jsonl' is empty"),
    "field not in the records": (lambda d: dict(train_files=_write(d / "r.jsonl", json.dumps({"body": "x"}) + "\n")),
                                 r"text_field='text' is not a field of train_files .* its fields are \['body'\]"),
    "records without text": (lambda d: dict(train_files=_write(d / "n.jsonl", json.dumps({"text": ""}) + "\n")),
                             "holds no text in the field 'text'"),
    "record that is not text": (lambda d: dict(train_files=_write(d / "i.jsonl", json.dumps({"text": 3}) + "\n")),
                                "record 0 has text=3 \\(int\\), not text"),
    "unknown suffix": (lambda d: dict(train_files=_write(d / "data.csv", "a,b\n")), "is neither text"),
    "mixed kinds": (lambda d: dict(train_files=[_write(d / "a.txt", "x"), _write(d / "b.jsonl", "{}")]),
                    "mixes text and JSON files"),
    "no tokenizer": (lambda d: dict(tokenizer=str(make_model_directory(d / "bare", "qwen2", tokenizer=False)),
                                       train_files=_write(d / "t.txt", "text")), "holds no tokenizer"),
    "tokenizer not a directory": (lambda d: dict(tokenizer=str(d / "nothing"), train_files=_write(d / "t.txt", "x")),
                                  "is not a directory"),
    "too little text": (lambda d: dict(train_files=_write(d / "s.txt", "the dog"), val_fraction=0.0),
                        "fewer than one sample of seq_len \\+ 1 = 17"),
    "held-out share too small": (lambda d: dict(train_files=_write(d / "m.txt", " ".join(LINES)), val_fraction=0.01),
                                 "val_fraction=0.01 holds out"),
    "sample_by": (lambda d: dict(train_files=_write(d / "t.txt", "x"), sample_by="sentence"),
                  "sample_by='sentence' is not one of"),
    "seq_len": (lambda d: dict(train_files=_write(d / "t.txt", "x"), seq_len=0), "seq_len=0 must be"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_named(model_dir: Path, tmp_path: Path, case: str) -> None:
    arguments, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        _data(model_dir, **arguments(tmp_path)).setup("fit")


def test_token_ids_beyond_the_model_vocabulary_are_refused(model_dir: Path, corpus: dict[str, Path]) -> None:
    """A tokenizer that is not the model's would index past its embedding on some rank, mid-step."""
    from types import SimpleNamespace

    data = _data(model_dir, str(corpus["jsonl"]))
    module = SimpleNamespace(model_config=SimpleNamespace(vocab_size=16))
    data.trainer = SimpleNamespace(lightning_module=module, strategy=None)
    with pytest.raises(ValueError, match="gives token id .* but the model's vocab_size is 16"):
        data.setup("fit")


def test_the_tokenizer_defaults_to_the_models(model_dir: Path, corpus: dict[str, Path]) -> None:
    """Without tokenizer=, the pretrained directory of the module being trained gives it; without one, refused."""
    from types import SimpleNamespace

    from lightning_par.data import TextDataModule

    data = TextDataModule(train_files=str(corpus["jsonl"]), seq_len=16)
    data.trainer = SimpleNamespace(lightning_module=SimpleNamespace(hparams={"pretrained": str(model_dir)}),
                                   strategy=None)
    data.setup("fit")
    assert data.tokenizer.name_or_path == str(model_dir)
    orphan = TextDataModule(train_files=str(corpus["jsonl"]), seq_len=16)
    orphan.trainer = SimpleNamespace(lightning_module=SimpleNamespace(hparams={}), strategy=None)
    with pytest.raises(ValueError, match="TextDataModule needs tokenizer="):
        orphan.setup("fit")
