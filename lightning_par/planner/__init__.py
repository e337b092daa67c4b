"""Automatic layout planner: which parallel sizes, ZeRO stage, recomputation and schedule to train with.

Pure Python: a memory model (:mod:`~lightning_par.planner.memory`), a step-time model
(:mod:`~lightning_par.planner.time`) and an exhaustive search (:mod:`~lightning_par.planner.search`) over
the layouts of a :class:`ModelSpec` on a :class:`ClusterSpec`. Never imports lightning; imports torch only
when a search asks ``lightning_par.parallel.compose`` which layouts it can apply.

    from lightning_par.planner import ClusterSpec, ModelSpec, TrainingSpec, plan_layouts, format_table, explain

    candidates = plan_layouts(ModelSpec.preset("llama3-70b"), ClusterSpec.from_preset("h100-80gb", nodes=8),
                              TrainingSpec(global_batch_size=1024, seq_len=4096))
    print(format_table(candidates)); print(explain(candidates))
"""

from lightning_par.planner.cluster import DEVICE_PRESETS, ClusterSpec, calibrate
from lightning_par.planner.measure import MachineRates, measure_rates, measured_cluster
from lightning_par.planner.memory import MemoryBreakdown, estimate_memory
from lightning_par.planner.model import MODEL_PRESETS, ModelSpec
from lightning_par.planner.report import explain, format_table
from lightning_par.planner.search import Candidate, TrainingSpec, evaluate, plan_layouts
from lightning_par.planner.time import StepTime, estimate_step_time

__all__ = [
    "ClusterSpec",
    "DEVICE_PRESETS",
    "calibrate",
    "MachineRates",
    "measure_rates",
    "measured_cluster",
    "ModelSpec",
    "MODEL_PRESETS",
    "MemoryBreakdown",
    "estimate_memory",
    "StepTime",
    "estimate_step_time",
    "TrainingSpec",
    "Candidate",
    "evaluate",
    "plan_layouts",
    "format_table",
    "explain",
]
