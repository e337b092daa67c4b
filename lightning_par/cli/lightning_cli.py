"""The classes of the ``lightning-par`` command: LightningCLI with every lightning_par strategy name registered, and
its parser, which raises what it refuses (``lightning_par/cli/main.py`` says it in one line)."""

from __future__ import annotations

import difflib
import logging
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_par  # noqa: F401 - importing registers the strategy names with Lightning
from lightning_par.checkpoint import format as checkpoint
from lightning_par.checkpoint import safe_dcp
from lightning_par.callbacks import ParallelMonitor, ParallelProgressBar
from lightning_par.checkpoint.validation import CheckpointError
from lightning_par.cli.errors import CommandLineError

_LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc", "auto")  # "auto": lightning_par/strategies/auto_resume.py


class Parser(LightningArgumentParser):
    """Raises what it refuses (:class:`CommandLineError`) instead of printing its usage and exiting, so that
    :func:`main` can say it in one line (``ParallelCLI`` used from Python keeps LightningCLI's own parser)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # a parser jsonargparse nests inside another: it handles the error
            super().error(message, ex)
        raise CommandLineError(message, self._option_string_actions) from ex


class ParallelCLI(LightningCLI):
    """LightningCLI for any LightningModule and LightningDataModule (``class_path``), with
    :class:`~lightning_par.callbacks.ParallelMonitor` on (the ``monitor:`` section switches its parts) and
    the layout in the progress bar."""

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        self._seeded: int | None = None
        # No model or data class: LightningCLI then takes any subclass of LightningModule / LightningDataModule.
        super().__init__(None, None, args=args, **kwargs)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads a checkpoint file's hyper-parameters before any strategy runs: check it first, as a
        # strategy's load does (docs/errors.md), so a bad path gets the same message here.
        config = self.config.get(self.config.get("subcommand") or "", {})
        path = config.get("ckpt_path") if hasattr(config, "get") else None
        trusted = False if _strategy_argument(config, "checkpoint_weights_only") is False else None
        # Names for a checkpoint the Trainer finds ("last", "best", "hpc", "auto", "registry:..."): not paths yet
        if path and str(path) not in _LIGHTNING_CHECKPOINT_NAMES and not str(path).startswith("registry"):
            problem = checkpoint.checkpoint_problem(Path(path), weights_only=trusted)
            if problem:
                raise CheckpointError(problem)
        try:
            with torch.serialization.safe_globals(safe_dcp.safe_globals()):
                super()._parse_ckpt_path()
        except pickle.UnpicklingError:
            if trusted is not False:
                raise
            # A file trusted with checkpoint_weights_only=False: its hyper-parameters are not read here (LightningCLI
            # reads them with weights_only=True); the strategy loads the whole file.

    def _set_seed(self) -> None:
        # Seeded quietly here and said after the classes are built, so that a mistake in them is the first line.
        config = self.config[self.subcommand] if self.subcommand else self.config
        seed = config.get("seed_everything")
        if seed is False:
            return
        config["seed_everything"] = self._seeded = seed_everything(None if seed is True else seed, workers=True,
                                                                   verbose=False)

    def after_instantiate_classes(self) -> None:
        if self._seeded is not None:
            rank_zero_info(f"Seed set to {self._seeded}")
        super().after_instantiate_classes()

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

    from lightning_par.strategies import STRATEGIES

    if name in StrategyRegistry or name == "auto":
        return
    ours = sorted({key for key, entry in StrategyRegistry.items() if entry["strategy"] in STRATEGIES})
    lightnings = [key for key, entry in StrategyRegistry.items()
                  if entry["strategy"] not in STRATEGIES]
    close = difflib.get_close_matches(name, ours, n=3, cutoff=0.6) + difflib.get_close_matches(
        name, lightnings, n=1, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ValueError(f"trainer.strategy={name!r} is not a strategy name: {hint}lightning-par's strategies are "
                     f"{', '.join(ours)} (and any of Lightning's, e.g. ddp, fsdp)")


def _strategy_argument(config: Any, name: str) -> Any:
    strategy = config.get("trainer", {}).get("strategy")
    init_args = getattr(strategy, "init_args", None) or (strategy.get("init_args") if isinstance(strategy, dict)
                                                         else None)
    return init_args.get(name) if init_args is not None and hasattr(init_args, "get") else None


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's notes (seed, devices, tips) left out of a command's report while it builds a config's classes."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_par")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


__all__ = ["ParallelCLI", "Parser", "check_strategy_name", "quiet_lightning"]
