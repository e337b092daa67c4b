"""Instruction and chat data: the loss is taken on the responses only (counted token by token), packed or padded;
bad records, templates and lengths are refused naming them; and fine-tuning on packed, prompt-masked samples matches
one process under data and pipeline parallel, whose ranks and micro-batches take their loss on different numbers of
tokens."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from installed import require
import torch
from hf_directories import make_model_directory, write_instructions
from parity import assert_parity, layout_runs, reference_run

transformers = require("transformers")
require("datasets")

STEPS = 20


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("instructions")
    files = write_instructions(root / "data", repeats=12)
    return {"model": str(make_model_directory(root / "model", "llama-tied")), **{k: str(v) for k, v in files.items()}}


def _data(workspace: dict[str, str], name: str = "instructions", *, packing: bool = True, seq_len: int = 16,
          batch_size: int = 4, **options):
    from lightning_par.data import InstructionDataModule

    data = InstructionDataModule(train_files=workspace[name], tokenizer=workspace["model"], seq_len=seq_len,
                                 batch_size=batch_size, packing=packing, val_fraction=0.0, **options)
    data.setup("fit")
    return data


def _labelled(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """(every token, the labels) of a dataset's samples, one after the other (packed windows without the token two
    windows share)."""
    ids, labels = [], []
    for index in range(len(dataset)):
        sample = dataset[index]
        keep = slice(1 if ids and "attention_mask" not in sample else 0, None)
        ids.append(sample["input_ids"][keep])
        labels.append(sample["labels"][keep])
    return torch.cat(ids), torch.cat(labels)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_the_loss_is_on_the_responses_and_their_end(workspace: dict[str, str], packing: bool) -> None:
    """Labelled tokens are, in order, each response's tokens and the end-of-sequence token after it: nothing of the
    prompts (the proverbs' first three words), nothing of the padding."""
    from lightning_par.data.text import load_tokenizer

    tokenizer = load_tokenizer(workspace["model"])
    records = [json.loads(line) for line in Path(workspace["instructions"]).read_text().splitlines()]
    data = _data(workspace, packing=packing, seq_len=64 if not packing else 16)
    ids, labels = _labelled(data.train_dataset)
    responses = [t for r in records for t in [*tokenizer(r["response"], add_special_tokens=False)["input_ids"],
                                             tokenizer.eos_token_id]]
    taken = labels[labels != -100]
    if packing:  # the windows cover the stream but its last partial window
        responses = responses[:taken.numel()]
    assert taken.tolist() == responses
    assert torch.equal(ids[labels != -100], taken)  # a label is the token at its own position
    if not packing:
        masks = torch.stack([data.train_dataset[i]["attention_mask"] for i in range(len(data.train_dataset))])
        padded = torch.stack([data.train_dataset[i]["labels"] for i in range(len(data.train_dataset))])[masks == 0]
        assert masks.min() == 0 and bool((padded == -100).all())
    print(f"{'packed' if packing else 'padded'}: {taken.numel()} of {ids.numel()} tokens take the loss")


def test_chats_take_the_loss_on_the_assistant_turns(workspace: dict[str, str]) -> None:
    """Rendered by the tokenizer's chat template; the labelled text is every assistant turn and none of the user's.
    The template ends turns with the end-of-sequence token, so packing separates samples with the pad token."""
    from lightning_par.data.text import load_tokenizer

    tokenizer = load_tokenizer(workspace["model"])
    assert _data(workspace, "chats").document_separator == tokenizer.pad_token_id != tokenizer.eos_token_id
    records = [json.loads(line) for line in Path(workspace["chats"]).read_text().splitlines()]
    first = _data(workspace, "chats", packing=False, seq_len=128).train_dataset[0]
    taken = tokenizer.decode(first["labels"][first["labels"] != -100])
    user = " ".join(m["content"] for m in records[0]["messages"] if m["role"] == "user")
    assistant = [m["content"] for m in records[0]["messages"] if m["role"] == "assistant"]
    assert all(content.replace(" ", "") in taken.replace(" ", "") for content in assistant), taken
    assert "finish" not in taken and user.split()[1] not in taken.split()[:1], taken


def test_bad_records_templates_and_lengths_are_refused(workspace: dict[str, str], tmp_path: Path) -> None:
    from lightning_par.data import InstructionDataModule

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"question": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"record 1 has no text in 'prompt' \(its fields: \['question'\]\)"):
        _data({**workspace, "bad": str(bad)}, "bad")
    plain = tmp_path / "plain"
    tokenizer = transformers.AutoTokenizer.from_pretrained(workspace["model"])
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    with pytest.raises(ValueError, match="has no chat template"):
        InstructionDataModule(train_files=workspace["chats"], tokenizer=str(plain), seq_len=64,
                              val_fraction=0.0).setup("fit")
    with pytest.raises(ValueError, match=r"sample 0 has \d+ tokens, more than a window of seq_len \+ 1 = 5"):
        _data(workspace, packing=False, seq_len=4)
    with pytest.raises(ValueError, match="loss_on='everything' is not one of"):
        InstructionDataModule(train_files=workspace["instructions"], loss_on="everything")


def _module(directory: str):
    from lightning_par.models import HFCausalLM

    return HFCausalLM(pretrained=directory, packed_documents=True, learning_rate=1e-3, warmup_steps=2,
                      max_steps=STEPS, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]})


def _strategy(sizes: dict):
    from lightning_par import Hybrid3DStrategy

    return Hybrid3DStrategy(**sizes)


def _unset_data(workspace: dict[str, str], name: str, batch_size: int):
    from lightning_par.data import InstructionDataModule

    return InstructionDataModule(train_files=workspace[name], tokenizer=workspace["model"], seq_len=16,
                                 batch_size=batch_size, val_fraction=0.0)


def test_fine_tuning_on_instructions_matches_one_process(workspace: dict[str, str]) -> None:
    """LoRA on packed prompt/response samples and on packed chats: 20 AdamW steps under dp2 (ZeRO-3) and pp2 (two
    micro-batches) against one process on the same global batches."""
    layouts = {"dp2-zero3": (2, dict(data_parallel_size=2, zero_stage=3)),
               "pp2": (1, dict(pipeline_parallel_size=2, microbatches=2))}
    runs = {f"{layout} {name}": (functools.partial(_module, workspace["model"]),
                                 functools.partial(_unset_data, workspace, name, 4 // dp),
                                 functools.partial(_strategy, sizes))
            for layout, (dp, sizes) in layouts.items() for name in ("instructions", "chats")}
    results = layout_runs(runs, world_size=2, steps=STEPS, timeout=540)
    for label, result in results.items():
        layout, name = label.split()
        dp = layouts[layout][0]
        expected = reference_run(functools.partial(_module, workspace["model"]),
                                 functools.partial(_unset_data, workspace, name, 4 // dp), dp=dp, steps=STEPS)
        loss_error, weight_error = assert_parity(result, expected, rtol=1e-5, weight_atol=1e-3 * 1e-3 * STEPS)
        print(f"{label}: loss {loss_error:.1e}, weights {weight_error:.1e} absolute")


def test_token_ids_beyond_the_model_vocabulary_are_refused(workspace: dict[str, str]) -> None:
    """A tokenizer that is not the model's would index past its embedding on some rank, mid-step."""
    from types import SimpleNamespace

    from lightning_par.data import InstructionDataModule

    data = InstructionDataModule(train_files=workspace["instructions"], tokenizer=workspace["model"], seq_len=16,
                                 batch_size=4, val_fraction=0.0)
    data.trainer = SimpleNamespace(lightning_module=SimpleNamespace(config=SimpleNamespace(vocab_size=16)),
                                   strategy=None)
    with pytest.raises(ValueError, match="gives token id .* but the model's vocab_size is 16"):
        data.setup("fit")
