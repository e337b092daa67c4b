"""Optimizers every layout can shard (pure torch: no Lightning)."""

from lightning_par.optim.low_precision import AdamWBF16States, state_bytes
from lightning_par.optim.muon import MuonWithAdamW, muon_parameter_groups

__all__ = ["AdamWBF16States", "MuonWithAdamW", "muon_parameter_groups", "state_bytes"]
