"""Datasets and LightningDataModules for next-token training that need no download.

``corpus`` is pure PyTorch (the stdlib byte corpus, window and synthetic datasets); ``resumable`` a DataLoader
that resumes mid-epoch; ``datamodule`` adds the Lightning side, with exact sharding across data-parallel ranks;
``text`` and ``text_datamodule`` read local text for fine-tuning, tokenized with a model directory's tokenizer;
``instructions`` and ``instruction_datamodule`` prompt/response records and chats, the loss on the responses;
``images`` synthetic labelled images for vision models; ``prepare`` tokenizes a pretraining corpus once into token
shards, which ``shards`` and ``streaming`` stream, each data-parallel replica reading its own share.
The datamodules are imported lazily (PEP 562) so that the datasets work without Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_par.data.corpus import SyntheticTokenDataset, TokenWindowDataset, load_stdlib_tokens
from lightning_par.data.resumable import ResumableDataLoader

if TYPE_CHECKING:
    from lightning_par.data.datamodule import TokenDataModule
    from lightning_par.data.images import SyntheticImageDataModule
    from lightning_par.data.instruction_datamodule import InstructionDataModule
    from lightning_par.data.streaming import StreamingTokenDataModule
    from lightning_par.data.text_datamodule import TextDataModule

__all__ = ["SyntheticImageDataModule", "TokenDataModule", "TextDataModule", "InstructionDataModule",
           "StreamingTokenDataModule", "ResumableDataLoader", "TokenWindowDataset", "SyntheticTokenDataset",
           "load_stdlib_tokens"]


def __getattr__(name: str) -> Any:
    if name == "TokenDataModule":
        from lightning_par.data.datamodule import TokenDataModule

        return TokenDataModule
    if name == "SyntheticImageDataModule":
        from lightning_par.data.images import SyntheticImageDataModule

        return SyntheticImageDataModule
    if name == "TextDataModule":
        from lightning_par.data.text_datamodule import TextDataModule

        return TextDataModule
    if name == "InstructionDataModule":
        from lightning_par.data.instruction_datamodule import InstructionDataModule

        return InstructionDataModule
    if name == "StreamingTokenDataModule":
        from lightning_par.data.streaming import StreamingTokenDataModule

        return StreamingTokenDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
