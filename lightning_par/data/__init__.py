"""Datasets and a LightningDataModule for next-token training that need no download.

``corpus`` is pure PyTorch (the stdlib byte corpus, window and synthetic datasets);
``datamodule`` adds the Lightning side, with exact sharding across data-parallel ranks.
"""

from lightning_par.data.corpus import SyntheticTokenDataset, TokenWindowDataset, load_stdlib_tokens
from lightning_par.data.datamodule import TokenDataModule

__all__ = ["TokenDataModule", "TokenWindowDataset", "SyntheticTokenDataset", "load_stdlib_tokens"]
