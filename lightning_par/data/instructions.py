"""Instruction and chat data for supervised fine-tuning: records of JSON lines turned into token ids and labels that
take the loss on the responses only (-100 elsewhere, Hugging Face's convention), then packed into windows or padded.

Two record formats (Ouyang et al. 2022, "Training language models to follow instructions", take the loss on the
demonstrations alone, as TRL's SFTTrainer and torchtune do by default):

- ``{"prompt": ..., "response": ...}``: the prompt as the tokenizer encodes a text (its beginning-of-sequence token
  included), then the response and the end-of-sequence token, which take the loss;
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered by the tokenizer's own chat template
  (``apply_chat_template``); the tokens of each assistant turn take the loss, found as the difference between the
  conversation rendered up to that turn and up to the turn before it with the generation prompt.

Packing concatenates samples, each closed by a separator token, into one stream cut into windows of the training
length (every position trained; the model keeps the samples apart: ``lightning_par.models.packing``); padding gives
each sample a window of its own, filled on the right with the pad token and an attention mask of 0. Pure PyTorch
plus transformers' tokenizer: no lightning import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["FORMATS", "LOSS_ON", "PackedSamples", "PaddedSamples", "encode", "pack_separator"]

IGNORE_INDEX = -100  # Hugging Face's label for positions that take no loss
FORMATS = ("auto", "prompt_response", "chat")
LOSS_ON = ("responses", "all")
Sample = tuple[list[int], list[int]]  # (token ids, labels)


def encode(record: Mapping[str, Any], index: int, tokenizer: Any, *, format: str, prompt_field: str,
           response_field: str, messages_field: str, loss_on: str) -> Sample:
    """One record as (token ids, labels), closed by the end-of-sequence token; ``index`` names it in errors."""
    kind = format
    if kind == "auto":
        kind = "chat" if messages_field in record else "prompt_response"
    if kind == "chat":
        ids, labels = _chat(record, index, tokenizer, messages_field)
    else:
        ids, labels = _prompt_response(record, index, tokenizer, prompt_field, response_field)
    eos = tokenizer.eos_token_id
    if not ids or ids[-1] != eos:  # closed by the end-of-sequence token, which takes the loss after a response
        closes_a_response = bool(labels) and labels[-1] != IGNORE_INDEX
        ids, labels = [*ids, eos], [*labels, eos if closes_a_response else IGNORE_INDEX]
    if loss_on == "all":
        labels = list(ids)
    return ids, labels


def _text(record: Mapping[str, Any], index: int, field: str, fields: Sequence[str]) -> str:
    value = record.get(field)
    if not isinstance(value, str):
        given = sorted(name for name, content in record.items() if content is not None)  # JSON lines share columns
        raise ValueError(f"record {index} has no text in {field!r} (its fields: {given}): each record needs "
                         f"{' and '.join(repr(f) for f in fields)}, or 'messages' for a chat")
    return value


def _prompt_response(record: Mapping[str, Any], index: int, tokenizer: Any, prompt_field: str,
                     response_field: str) -> Sample:
    fields = (prompt_field, response_field)
    prompt = tokenizer(_text(record, index, prompt_field, fields), add_special_tokens=True)["input_ids"]
    response = tokenizer(_text(record, index, response_field, fields), add_special_tokens=False)["input_ids"]
    if prompt and prompt[-1] == tokenizer.eos_token_id:  # a tokenizer that closes every text: not the prompt
        prompt = prompt[:-1]
    return [*prompt, *response], [IGNORE_INDEX] * len(prompt) + list(response)


def _chat(record: Mapping[str, Any], index: int, tokenizer: Any, messages_field: str) -> Sample:
    messages = record.get(messages_field)
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"record {index}: {messages_field!r} must be a non-empty list of {{role, content}} messages, "
                         f"got {str(messages)[:120]}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"record {index} is a chat, and the tokenizer {tokenizer.name_or_path!r} has no chat template "
                         "to render it with: use a tokenizer saved with one (tokenizer.chat_template), or "
                         "prompt/response records")

    def render(turns: list, generation_prompt: bool = False) -> list[int]:
        return list(tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=generation_prompt,
                                                  return_dict=True)["input_ids"])

    ids = render(messages)
    labels = [IGNORE_INDEX] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:turn], True) if turn else [], render(messages[:turn + 1])
        if ids[:len(before)] != before or ids[:len(through)] != through:
            raise ValueError(f"record {index}: the tokenizer's chat template renders the conversation up to turn "
                             f"{turn} as something other than the start of the whole conversation, so the assistant's "
                             "tokens cannot be told apart: use prompt/response records, or loss_on='all'")
        labels[len(before):len(through)] = ids[len(before):len(through)]
    return ids, labels


def pack_separator(samples: Sequence[Sample], tokenizer: Any) -> int:
    """The token that closes each packed sample: the end-of-sequence token where it closes samples only; the pad
    token where chat turns end with the end-of-sequence token too (a separator inside a sample would cut it)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if not any(eos in ids[:-1] for ids, _ in samples):
        return eos
    if pad is not None and pad != eos and not any(pad in ids for ids, _ in samples):
        return pad
    raise ValueError(f"packing needs a token that closes samples and appears in none: the end-of-sequence token "
                     f"{eos} ends turns inside samples, and the tokenizer has {'no pad token' if pad is None else f'pad token {pad} inside samples too'}; "
                     "give the tokenizer a pad token of its own, or set packing=False")


class PackedSamples(Dataset):
    """Samples concatenated, each followed by ``separator`` (when it does not end with it already; no loss on it),
    cut into windows of ``seq_len + 1`` tokens sharing one boundary token, as ``TokenWindowDataset`` cuts text:
    ``{"input_ids", "labels"}`` per window."""

    def __init__(self, samples: Sequence[Sample], seq_len: int, separator: int) -> None:
        ids: list[int] = []
        labels: list[int] = []
        for sample_ids, sample_labels in samples:
            ids += sample_ids
            labels += sample_labels
            if sample_ids[-1] != separator:
                ids.append(separator)
                labels.append(IGNORE_INDEX)
        self.ids, self.labels = torch.tensor(ids), torch.tensor(labels)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (self.ids.numel() - 1) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        window = slice(index * self.seq_len, index * self.seq_len + self.seq_len + 1)
        return {"input_ids": self.ids[window], "labels": self.labels[window]}


class PaddedSamples(Dataset):
    """One sample per window of ``seq_len + 1`` tokens, padded on the right with ``pad`` (no loss, attention mask 0):
    ``{"input_ids", "labels", "attention_mask"}``. A sample longer than the window is refused, naming it."""

    def __init__(self, samples: Sequence[Sample], seq_len: int, pad: int) -> None:
        self.samples, self.seq_len, self.pad = list(samples), seq_len, pad
        for index, (ids, _) in enumerate(self.samples):
            if len(ids) > seq_len + 1:
                raise ValueError(f"sample {index} has {len(ids)} tokens, more than a window of seq_len + 1 = "
                                 f"{seq_len + 1}: raise seq_len, shorten the sample, or set packing=True")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.samples[index]
        fill = self.seq_len + 1 - len(ids)
        return {"input_ids": torch.tensor([*ids, *[self.pad] * fill]),
                "labels": torch.tensor([*labels, *[IGNORE_INDEX] * fill]),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * fill)}
