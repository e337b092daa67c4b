"""Dry runs: the real layout code of one rank at any world size, on fake tensors and a fake process group
(``lightning-par check``; docs/planner.md, "Checking before the cluster").

Pure PyTorch: no lightning import.
"""

from lightning_par.dry_run.collectives import CollectiveRecorder
from lightning_par.dry_run.fake_world import FakeAllocation, fake_world, pipeline_metadata_through
from lightning_par.dry_run.tracked_step import StepMemory, StepReport, measure_training_step

__all__ = ["CollectiveRecorder", "FakeAllocation", "StepMemory", "StepReport", "fake_world", "measure_training_step",
           "pipeline_metadata_through"]
