"""Lightning strategies: thin shells over lightning_par.parallel."""

from lightning_par.strategies.base import MeshStrategy
from lightning_par.strategies.data_parallel import DataParallelStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.strategies.zero import ZeroStrategy

STRATEGIES = (DataParallelStrategy, ZeroStrategy, TensorParallelStrategy)


def register_strategies() -> None:
    """Add every lightning_par strategy name to Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for strategy in STRATEGIES:
        strategy.register_strategies(StrategyRegistry)


register_strategies()

__all__ = ["MeshStrategy", "DataParallelStrategy", "ZeroStrategy", "TensorParallelStrategy", "register_strategies", "STRATEGIES"]
