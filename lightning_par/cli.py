"""The ``lightning-par`` command: LightningCLI with every lightning_par strategy name registered.

    lightning-par fit --config configs/data_parallel.yaml
    lightning-par validate --config configs/data_parallel.yaml --ckpt_path lightning_logs/.../last.ckpt

Any LightningModule / LightningDataModule can be named with ``class_path`` in the YAML (the shipped configs name
the reference Llama model and the standard-library corpus).
"""

from __future__ import annotations

import difflib
import sys
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_par  # noqa: F401 - importing registers the strategy names with Lightning
from lightning_par.callbacks import ParallelMonitor, ParallelProgressBar


class ParallelCLI(LightningCLI):
    """LightningCLI for any LightningModule and LightningDataModule (``class_path``), with
    :class:`~lightning_par.callbacks.ParallelMonitor` on (the ``monitor:`` section switches its parts) and
    the layout in the progress bar."""

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # No model or data class: LightningCLI then takes any subclass of LightningModule / LightningDataModule.
        super().__init__(None, None, args=args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ParallelMonitor, "monitor")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = config["trainer"].get("strategy")
        if isinstance(strategy, str):
            check_strategy_name(strategy)
        if config["trainer"].get("enable_progress_bar") is not False:
            self.trainer_defaults["callbacks"] = [ParallelProgressBar()]


def check_strategy_name(name: str) -> None:
    """Raise ``ValueError`` for a strategy name neither lightning-par nor Lightning registered, naming the closest
    registered names (Lightning's own message lists only its own)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_par.strategies import DEPRECATED_STRATEGIES, STRATEGIES

    if name in StrategyRegistry or name == "auto":
        return
    ours = sorted({key for key, entry in StrategyRegistry.items() if entry["strategy"] in STRATEGIES})
    lightnings = [key for key, entry in StrategyRegistry.items()
                  if entry["strategy"] not in (*STRATEGIES, *DEPRECATED_STRATEGIES)]
    close = difflib.get_close_matches(name, ours, n=3, cutoff=0.6) + difflib.get_close_matches(
        name, lightnings, n=1, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ValueError(f"trainer.strategy={name!r} is not a strategy name: {hint}lightning-par's strategies are "
                     f"{', '.join(ours)} (and any of Lightning's, e.g. ddp, fsdp)")


def main(args: Any = None) -> None:
    """Console-script entry point; ``lightning-par plan ...`` runs the layout planner instead of LightningCLI."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, (list, tuple)) and argv[:1] == ["plan"]:
        from lightning_par.planner.cli import main as plan

        plan(list(argv[1:]))
        return
    ParallelCLI(args=args)


if __name__ == "__main__":
    main()
