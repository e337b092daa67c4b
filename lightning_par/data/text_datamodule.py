"""``TextDataModule``: fine-tuning batches from local text, JSON lines or a ``save_to_disk`` dataset, tokenized with
the tokenizer of a model directory and packed with EOS between documents (see ``data/text.py``).

Every rank reads and tokenizes the same files, so every rank holds the same token stream and raises the same error
for a bad input before any collective. Windows, trimming to the data-parallel size and the resumable loader are
``WindowDataModule``'s, as for ``TokenDataModule``: a fine-tune resumes at the exact batch it stopped at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_par.data.corpus import TokenWindowDataset
from lightning_par.data.datamodule import WindowDataModule, check_window_arguments
from lightning_par.data.text import (SAMPLE_BY, check_sources, load_documents, load_tokenizer, model_vocab_size,
                                     pack_documents, tokenizer_of)

__all__ = ["TextDataModule", "TokenizedFilesDataModule"]

# Paths as YAML gives them: one, or a list.
Sources = Union[str, list[str]]


class TokenizedFilesDataModule(WindowDataModule):
    """What the datamodules of local files share (``TextDataModule``, ``InstructionDataModule``): the checked
    paths, a Hugging Face tokenizer given or read from the model's pretrained directory when the data is built, and
    the refusal of token ids the model's embedding has no row for."""

    def __init__(self, *, train_paths: list[Path], val_paths: list[Path] | None, tokenizer: str | None, seq_len: int,
                 batch_size: int, val_fraction: float, num_workers: int, shuffle: bool) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers, shuffle=shuffle)
        self.train_paths, self.val_paths = train_paths, val_paths
        self.tokenizer = None if tokenizer is None else load_tokenizer(tokenizer)
        self.val_fraction = val_fraction

    def _module(self) -> Any:
        return getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None

    def _resolve_tokenizer(self) -> None:
        """Without ``tokenizer=``, take the one saved in the pretrained directory of the model being trained."""
        if self.tokenizer is None:
            self.tokenizer = tokenizer_of(self._module(), type(self).__name__)

    def _check_vocabulary(self, largest_id: int) -> None:
        """Refuse token ids the model's embedding has no row for (each rank would fail alone, mid-step)."""
        model_vocab = model_vocab_size(self._module())
        if model_vocab is not None and largest_id >= model_vocab:
            raise ValueError(f"the tokenizer {self.tokenizer.name_or_path!r} gives token id {largest_id}, but the "
                             f"model's vocab_size is {model_vocab}: use the tokenizer saved with the model")


class TextDataModule(TokenizedFilesDataModule):
    """Packed next-token windows of local documents, for fine-tuning a pretrained model.

    Args:
        train_files: a ``.txt``/``.json``/``.jsonl`` file, a list of files of one kind, or a directory written by
            ``datasets``' ``save_to_disk`` (its ``train`` split when it holds several).
        val_files: the same for validation (a ``save_to_disk`` directory gives its ``validation`` split). Without
            it, the last ``val_fraction`` of the packed training tokens are held out.
        tokenizer: the directory holding the tokenizer (``save_pretrained``). Default: the model's, the
            ``pretrained`` directory of the LightningModule being trained (``HFCausalLM``'s).
        text_field: the JSON field (or dataset column) holding the text.
        sample_by: what one document of a text file is: the whole ``"document"``, each blank-line separated
            ``"paragraph"``, or each ``"line"``. Each document ends with the tokenizer's EOS token.
        seq_len: tokens per sample fed to the model; each sample holds ``seq_len + 1`` tokens.
        batch_size: samples per batch on each data-parallel rank.
        val_fraction: share of the training tokens held out when ``val_files`` is not given.
        num_workers: DataLoader worker processes (0 loads in the main process).
        shuffle: shuffle the training windows.
    """

    def __init__(
        self,
        train_files: Sources,
        val_files: Optional[Sources] = None,
        tokenizer: Optional[str] = None,
        text_field: str = "text",
        sample_by: str = "document",
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        check_window_arguments(seq_len=seq_len, batch_size=batch_size, val_fraction=val_fraction,
                               num_workers=num_workers)
        if sample_by not in SAMPLE_BY:
            raise ValueError(f"sample_by={sample_by!r} is not one of {list(SAMPLE_BY)}")
        train_paths = check_sources("train_files", train_files)
        val_paths = None if val_files is None else check_sources("val_files", val_files)
        super().__init__(train_paths=train_paths, val_paths=val_paths, tokenizer=tokenizer, seq_len=seq_len,
                         batch_size=batch_size, val_fraction=val_fraction, num_workers=num_workers, shuffle=shuffle)
        self.save_hyperparameters()
        self.text_field = text_field
        self.sample_by = sample_by

    def _tokens(self, paths: list[Path], split: str, name: str) -> torch.Tensor:
        documents = load_documents(paths, text_field=self.text_field, sample_by=self.sample_by, split=split,
                                   name=name)
        return pack_documents(documents, self.tokenizer)

    def _split_tokens(self) -> dict[str, torch.Tensor]:
        train = self._tokens(self.train_paths, "train", "train_files")
        if self.val_paths is not None:
            return {"train": train, "val": self._tokens(self.val_paths, "validation", "val_files")}
        held_out = round(train.numel() * self.val_fraction)
        if self.val_fraction and held_out < self.seq_len + 1:
            raise ValueError(f"val_fraction={self.val_fraction} holds out {held_out} of the {train.numel()} training "
                             f"tokens, fewer than one sample of seq_len + 1 = {self.seq_len + 1}: give val_files, a "
                             "larger val_fraction or more text")
        return {"train": train[:train.numel() - held_out], "val": train[train.numel() - held_out:]}

    @override
    def _build(self, split: str) -> Dataset:
        if not self._full:
            self._resolve_tokenizer()
            tokens = self._split_tokens()
            for name, stream in tokens.items():
                self._full[name] = TokenWindowDataset(stream, self.seq_len)
            if len(self._full["train"]) == 0:
                raise ValueError(f"train_files {[str(p) for p in self.train_paths]} give {tokens['train'].numel()} "
                                 f"training tokens, fewer than one sample of seq_len + 1 = {self.seq_len + 1}: "
                                 "give more text or a smaller seq_len")
            self._check_vocabulary(max(int(t.max()) for t in tokens.values() if t.numel()))
        return self._full[split]

    @property
    def document_separator(self) -> int | None:
        """The token that closes each packed document (the tokenizer's end-of-sequence token), once the tokenizer is
        known: where ``HFCausalLM(packed_documents=True)`` keeps documents apart."""
        return None if self.tokenizer is None else int(self.tokenizer.eos_token_id)
