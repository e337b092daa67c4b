"""Lightning strategies: thin shells over lightning_par.parallel."""

from lightning_par.strategies.base import MeshStrategy
from lightning_par.strategies.context_parallel import ContextParallelStrategy
from lightning_par.strategies.data_parallel import DataParallelStrategy
from lightning_par.strategies.expert_parallel import ExpertParallelStrategy
from lightning_par.strategies.hybrid3d import AutoParallelStrategy, Hybrid3DStrategy
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.strategies.zero import ZeroStrategy

STRATEGIES = (DataParallelStrategy, ZeroStrategy, TensorParallelStrategy, ContextParallelStrategy,
              PipelineParallelStrategy, ExpertParallelStrategy, Hybrid3DStrategy, AutoParallelStrategy)


def register_strategies() -> None:
    """Add every lightning_par strategy name to Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for strategy in STRATEGIES:
        strategy.register_strategies(StrategyRegistry)


register_strategies()

# Trainer.fit(ckpt_path="auto"): the newest complete checkpoint of the run, or a fresh start.
from lightning_par.strategies import auto_resume  # noqa: E402

auto_resume.install()

# The same names under Lightning Fabric (L.Fabric(strategy="hybrid3d")), registered when imported.
from lightning_par.strategies import fabric  # noqa: E402

__all__ = ["MeshStrategy", "DataParallelStrategy", "ZeroStrategy", "TensorParallelStrategy", "ContextParallelStrategy",
           "PipelineParallelStrategy", "ExpertParallelStrategy", "Hybrid3DStrategy",
           "AutoParallelStrategy", "fabric", "register_strategies", "STRATEGIES"]
