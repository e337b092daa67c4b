"""``InstructionDataModule``: supervised fine-tuning batches from JSON lines of prompt/response records or chats, the
loss on the responses only, packed or padded (see ``data/instructions.py``).

Every rank reads and tokenizes the same files, so every rank holds the same samples and raises the same error for a
bad record before any collective. Trimming to the data-parallel size and the resumable loader are
``WindowDataModule``'s, as for ``TextDataModule``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from torch.utils.data import Dataset
from typing_extensions import override

from lightning_par.data.datamodule import check_window_arguments
from lightning_par.data.instructions import FORMATS, LOSS_ON, PackedSamples, PaddedSamples, encode, pack_separator
from lightning_par.data.text import JSON_SUFFIXES, check_sources
from lightning_par.data.text_datamodule import TokenizedFilesDataModule

__all__ = ["InstructionDataModule"]

Sources = Union[str, list[str]]


class InstructionDataModule(TokenizedFilesDataModule):
    """Instruction or chat fine-tuning batches: ``{"input_ids", "labels"}`` (and ``attention_mask`` when padded), the
    labels -100 where no loss is taken.

    Args:
        train_files: ``.json``/``.jsonl`` files (one or a list) of records, or a directory written by ``datasets``'
            ``save_to_disk``.
        val_files: the same for validation. Without it, the last ``val_fraction`` of the training records are held out.
        tokenizer: the directory holding the tokenizer (``save_pretrained``); default: the pretrained directory of
            the LightningModule being trained (``HFCausalLM``'s). Chats are rendered with its chat template.
        format: ``"prompt_response"`` (records with ``prompt_field`` and ``response_field``), ``"chat"`` (records with
            ``messages_field``: a list of ``{role, content}``), or ``"auto"``: chat where a record has messages.
        loss_on: ``"responses"`` (the response, or every assistant turn, and the end-of-sequence token closing it) or
            ``"all"`` (every token).
        packing: concatenate samples into windows of ``seq_len + 1`` tokens, each sample closed by a separator the
            model keeps samples apart at (``HFCausalLM(packed_documents=True)``); False: one sample per window, padded
            on the right (a sample longer than the window is refused).
        seq_len, batch_size, val_fraction, num_workers, shuffle: as ``TextDataModule``'s.
    """

    def __init__(
        self,
        train_files: Sources,
        val_files: Optional[Sources] = None,
        tokenizer: Optional[str] = None,
        format: str = "auto",
        prompt_field: str = "prompt",
        response_field: str = "response",
        messages_field: str = "messages",
        loss_on: str = "responses",
        packing: bool = True,
        seq_len: int = 512,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        check_window_arguments(seq_len=seq_len, batch_size=batch_size, val_fraction=val_fraction,
                               num_workers=num_workers)
        if format not in FORMATS:
            raise ValueError(f"format={format!r} is not one of {list(FORMATS)}")
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on={loss_on!r} is not one of {list(LOSS_ON)}")
        train_paths = _json_sources("train_files", train_files)
        val_paths = None if val_files is None else _json_sources("val_files", val_files)
        super().__init__(train_paths=train_paths, val_paths=val_paths, tokenizer=tokenizer, seq_len=seq_len,
                         batch_size=batch_size, val_fraction=val_fraction, num_workers=num_workers, shuffle=shuffle)
        self.save_hyperparameters()
        self.packing = packing
        # The token closing each packed sample (set when the data is built; None when padding).
        self.document_separator: int | None = None

    def _records(self, paths: list, split: str) -> list[dict[str, Any]]:
        import datasets

        if paths[0].is_dir():
            dataset = datasets.load_from_disk(str(paths[0]))
            if isinstance(dataset, datasets.DatasetDict):
                if split not in dataset:
                    raise ValueError(f"the dataset {str(paths[0])!r} has the splits {sorted(dataset)}, not {split!r}")
                dataset = dataset[split]
        else:
            dataset = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train")
        return list(dataset)

    def _samples(self, records: list[dict[str, Any]]) -> list:
        hparams = self.hparams
        return [encode(record, index, self.tokenizer, format=hparams.format, prompt_field=hparams.prompt_field,
                       response_field=hparams.response_field, messages_field=hparams.messages_field,
                       loss_on=hparams.loss_on) for index, record in enumerate(records)]

    @override
    def _build(self, split: str) -> Dataset:
        if not self._full:
            self._resolve_tokenizer()
            train = self._samples(self._records(self.train_paths, "train"))
            if self.val_paths is not None:
                val = self._samples(self._records(self.val_paths, "validation"))
            else:
                held_out = round(len(train) * self.val_fraction)
                train, val = train[:len(train) - held_out], train[len(train) - held_out:]
            if self.packing:
                self.document_separator = pack_separator(train + val, self.tokenizer)
                self._full = {"train": PackedSamples(train, self.seq_len, self.document_separator),
                              "val": PackedSamples(val, self.seq_len, self.document_separator)}
            else:
                pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
                self._full = {"train": PaddedSamples(train, self.seq_len, pad),
                              "val": PaddedSamples(val, self.seq_len, pad)}
            if len(self._full["train"]) == 0:
                raise ValueError(f"train_files {[str(p) for p in self.train_paths]} give no training window of seq_len "
                                 f"+ 1 = {self.seq_len + 1} tokens: give more records or a smaller seq_len")
            self._check_vocabulary(max((max(ids) for ids, _ in train + val if ids), default=0))
        return self._full[split]


def _json_sources(name: str, sources: Sources) -> list:
    paths = check_sources(name, sources)
    if not paths[0].is_dir() and paths[0].suffix not in JSON_SUFFIXES:
        raise ValueError(f"{name}: instruction records are JSON lines ({', '.join(JSON_SUFFIXES)}), not "
                         f"{str(paths[0])!r}")
    return paths
