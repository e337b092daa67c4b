"""One rank of ``lightning-par check``: the run's own strategy lays the model out for rank ``rank`` of ``world_size``
on the fake backend, with fake tensors, and takes a training step (``lightning_par.dry_run``).

The LightningCLI config is read as ``lightning-par fit`` reads it, with the model built on the meta device and the
trainer on this machine's CPU (one process: the world is the fake one). What differs from the run is said in the
report: the tensor-parallel split is applied as the model map gives it, without the check on a sample that a run does
first (its collectives would move nothing here; ``lightning-par verify`` proves the layout computes what one process
computes).
"""

from __future__ import annotations

import os
import resource
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _configure_optimizers
from torch import Tensor

from lightning_par.parallel.mesh import build_mesh
from lightning_par.cli.lightning_cli import ParallelCLI, Parser
from lightning_par.layout.config import ParallelConfig
from lightning_par.dry_run import FakeAllocation, fake_world, measure_training_step, pipeline_metadata_through
from lightning_par.strategies.base import MeshStrategy
from lightning_par.strategies.setup_checks import layout_sample

__all__ = ["DryRunCLI", "dry_run_rank", "layout_of", "planned_memory", "read_config"]

# The trainer of a dry run: this machine's CPU, one process, nothing written.
_TRAINER = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false"]
# Lightning precision -> (dtype the parameters are converted to, dtype of autocast)
_PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "32-true": (None, None), "64-true": (torch.float64, None), "bf16-mixed": (None, torch.bfloat16),
    "16-mixed": (None, torch.float16), "bf16-true": (torch.bfloat16, None), "16-true": (torch.float16, None)}


class DryRunCLI(ParallelCLI):
    """The run's classes from its config, the model on the meta device (a 405B model costs nothing to build)."""

    def instantiate_classes(self) -> None:
        with torch.device("meta"):
            super().instantiate_classes()


def read_config(cli_args: list[str], *, model_contract: bool = True) -> DryRunCLI:
    """The classes of ``lightning-par fit`` ``cli_args``, on this machine's CPU; refused when the strategy is not
    lightning-par's, or (``model_contract``) the model takes no step through the model contract."""
    with warnings.catch_warnings():  # LightningCLI warns of sys.argv beside args: the command's own options
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        cli = DryRunCLI(args=[*cli_args, *_TRAINER], run=False, parser_class=Parser)
    if not isinstance(cli.trainer.strategy, MeshStrategy):
        raise ValueError(f"trainer.strategy={type(cli.trainer.strategy).__name__} is not a lightning-par strategy: "
                         "check dry-runs lightning-par's layouts (data_parallel, zero1-3, tensor_parallel, "
                         "pipeline_parallel, context_parallel, expert_parallel, hybrid3d)")
    for method in ("split_batch", "loss_fn") if model_contract else ():
        if not callable(getattr(cli.model, method, None)):
            raise ValueError(f"{type(cli.model).__name__} defines no {method}(): a dry run takes the step through the "
                             "model contract (split_batch, forward, loss_fn; docs/models.md)")
    return cli


def layout_of(cli: DryRunCLI, world_size: int) -> ParallelConfig:
    """The layout the config's strategy runs on ``world_size`` ranks (its data-parallel sizes resolved)."""
    strategy = cli.trainer.strategy
    planned = sorted(getattr(strategy, "_planned", ()) or ())
    if planned:
        raise ValueError(f"the strategy leaves {', '.join(planned)} to its planner: a dry run checks one layout; fix "
                         "the sizes in the config (lightning-par plan --config ... ranks them)")
    return strategy.parallel_config.validate(world_size)


def dry_run_rank(cli_args: list[str], *, world_size: int, rank: int, store: torch.distributed.Store | None
                 ) -> dict[str, Any]:
    """Lay out and step rank ``rank`` of ``world_size`` as the config's run would; return its report (JSON types).
    ``store`` carries the pipeline stages' metadata between the dry runs of one pipeline (None without one)."""
    started = time.perf_counter()
    cli = read_config(cli_args)
    strategy, module, trainer = cli.trainer.strategy, cli.model, cli.trainer
    config = layout_of(cli, world_size)
    batch = _first_batch(cli)
    convert, autocast = _precision(trainer.precision)
    if convert is not None:
        module.to(convert)
    metadata = pipeline_metadata_through(store) if config.pp > 1 and store is not None else nullcontext()
    with fake_world(rank, world_size), metadata:
        strategy.parallel_config, strategy._mesh = config, build_mesh(config, "cpu")
        allocation = FakeAllocation()
        sample = layout_sample(module, config, batch, batch_size=batch.shape[0])
        handle = strategy.lay_out(module, module, training=True, accumulate=trainer.accumulate_grad_batches,
                                  sample=lambda config, model_map: sample, dry_run=allocation)
        module.trainer = trainer
        with allocation.mode:
            optimizer = handle.shard_optimizer(_configure_optimizers(module.configure_optimizers())[0][0])
        step = measure_training_step(
            handle, optimizer, allocation.mode, split_batch=module.split_batch, loss_fn=module.loss_fn, batch=batch,
            autocast=None if autocast is None else torch.autocast("cpu", dtype=autocast),
            splits_backward=config.splits_backward)
        coordinates = strategy.mesh.coordinates()
        stages = [stage.stage_index for stage in handle.stages] if handle.pipeline is not None else [0]
    local = sum(_local_numel(p) for p in module.parameters())
    return {"rank": rank, "world_size": world_size, "layout": config.describe(), "zero_stage": config.zero_stage,
            "coordinates": coordinates, "stages": stages, "local_parameters": local, "memory": asdict(step.peak),
            "states": asdict(step.states), "cyclic_bytes": step.cyclic,
            "collectives": {name: asdict(total) for name, total in step.collectives.items() if total.calls},
            "seconds": time.perf_counter() - started, "host_peak_bytes": _host_peak_bytes(), "pid": os.getpid()}


def planned_memory(cli: DryRunCLI, config: ParallelConfig) -> list[dict[str, float]]:
    """The planner's memory model of ``config`` for the config's model and batch: one breakdown (bytes) per
    pipeline rank, in order (``lightning_par.planner.memory.rank_memory``)."""
    from lightning_par.planner.memory import LIGHTNING_PRECISIONS, rank_memory
    from lightning_par.planner.module_spec import module_spec

    inputs, _ = cli.model.split_batch(_first_batch(cli))
    microbatches = config.microbatches if config.pp > 1 else 1
    breakdowns = rank_memory(module_spec(cli.model, cli.trainer.strategy._model_map), config,
                             seq_len=inputs.shape[1], microbatch_size=max(1, inputs.shape[0] // microbatches),
                             precision=LIGHTNING_PRECISIONS.get(cli.trainer.precision, "32-true"),
                             microbatches=microbatches,
                             optimizer=getattr(cli.model, "hparams", {}).get("optimizer", "adamw"))
    return [breakdown.as_dict() for breakdown in breakdowns]


def _first_batch(cli: DryRunCLI) -> Tensor:
    data = cli.datamodule
    if data is None:
        raise ValueError("the config names no data: a dry run takes its batch shape from the data's first batch")
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    if not isinstance(batch, Tensor):
        raise ValueError(f"{type(data).__name__}'s batches are {type(batch).__name__}: a dry run takes batches of "
                         "token ids (one tensor) through the model contract")
    return batch


def _precision(precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    if precision not in _PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r} is not one a dry run takes; fit: {sorted(_PRECISIONS)}")
    return _PRECISIONS[precision]


def _local_numel(parameter: Tensor) -> int:
    local = getattr(parameter, "_local_tensor", parameter)
    return local.numel()


def _host_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def run_rank(argv: list[str]) -> None:
    """A rank process of ``lightning-par check`` (``lightning_par/cli/check.py``): RANK WORLD_SIZE STORE_PORT OUTPUT
    then the config's options."""
    import json
    from pathlib import Path

    rank, world_size, port, output, *cli_args = argv
    store = torch.distributed.TCPStore("127.0.0.1", int(port), is_master=False)
    report = dry_run_rank(cli_args, world_size=int(world_size), rank=int(rank), store=store)
    Path(output).write_text(json.dumps(report))


if __name__ == "__main__":
    import sys

    run_rank(sys.argv[1:])
