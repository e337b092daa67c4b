"""Pure PyTorch parallel techniques over (module, mesh). This package never imports lightning."""

from lightning_par.parallel.compose import check_available, parallelize
from lightning_par.parallel.data import apply_data_parallel, no_gradient_sync
from lightning_par.parallel.plan import ModelPlan, derive_plan

__all__ = ["parallelize", "check_available", "apply_data_parallel", "no_gradient_sync", "ModelPlan", "derive_plan"]
