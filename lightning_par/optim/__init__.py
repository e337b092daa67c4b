"""Optimizers every layout can shard (pure torch: no Lightning)."""

from lightning_par.optim.muon import MuonWithAdamW, muon_parameter_groups

__all__ = ["MuonWithAdamW", "muon_parameter_groups"]
