"""The ``lightning-par`` command: LightningCLI with every lightning_par strategy name registered.

    lightning-par fit --config configs/data_parallel.yaml
    lightning-par validate --config configs/data_parallel.yaml --ckpt_path lightning_logs/.../last.ckpt

Any LightningModule / LightningDataModule can be named with ``class_path`` in the YAML (the shipped configs name
the reference Llama model and the standard-library corpus).
"""

from __future__ import annotations

import difflib
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_par  # noqa: F401 - importing registers the strategy names with Lightning
from lightning_par import checkpoint, safe_dcp
from lightning_par.callbacks import ParallelMonitor, ParallelProgressBar
from lightning_par.checkpoint_validation import CheckpointError
from lightning_par.cli_errors import CommandLineError
from lightning_par.strategies.processes import ONE_TRACEBACK_VARIABLE

VERBOSE_FLAG, VERBOSE_VARIABLE = "--verbose", "LIGHTNING_PAR_VERBOSE"
_LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc")


class _Parser(LightningArgumentParser):
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
        # Lightning's own names for a checkpoint it finds ("last", "best", "hpc", "registry:..."): not paths yet
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


def _strategy_argument(config: Any, name: str) -> Any:
    strategy = config.get("trainer", {}).get("strategy")
    init_args = getattr(strategy, "init_args", None) or (strategy.get("init_args") if isinstance(strategy, dict)
                                                         else None)
    return init_args.get(name) if init_args is not None and hasattr(init_args, "get") else None


def main(args: Any = None) -> None:
    """Console-script entry point; ``lightning-par plan ...`` runs the layout planner instead of LightningCLI.

    A mistake is said in one line on stderr, led by the key and value at fault, and the command exits with 2 (a
    command line or config the parser refused) or 1; the traceback comes with ``--verbose`` or
    ``LIGHTNING_PAR_VERBOSE=1``. A run that fails after its processes started prints the traceback of its first
    failure once, and one line for each rank."""
    argv = list(sys.argv[1:] if args is None else args)
    verbose = VERBOSE_FLAG in argv or os.environ.get(VERBOSE_VARIABLE, "") not in ("", "0")
    if VERBOSE_FLAG in argv:
        argv.remove(VERBOSE_FLAG)
    if argv[:1] == ["plan"]:
        from lightning_par.planner.cli import main as plan

        plan(argv[1:])
        return
    # For the ranks Lightning starts (they run this command again), and only for the command's own run.
    saved = {name: os.environ.get(name) for name in (VERBOSE_VARIABLE, ONE_TRACEBACK_VARIABLE)}
    os.environ[ONE_TRACEBACK_VARIABLE] = "1"
    if verbose:
        os.environ[VERBOSE_VARIABLE] = "1"
    try:
        if args is None:  # LightningCLI reads sys.argv itself (and warns when given both)
            sys.argv[1:] = argv
        ParallelCLI(args=None if args is None else argv, parser_class=_Parser)
    except Exception as error:  # noqa: BLE001 - every error reaches the user, as one line unless asked otherwise
        _report(error, verbose)
        raise SystemExit(2 if isinstance(error, CommandLineError) else 1) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _report(error: BaseException, verbose: bool) -> None:
    """Print ``error`` for the user: the traceback when asked for, nothing more for the run's first failure (printed
    whole when it happened), the one-line summary of a rank of a run that failed elsewhere first, else one line."""
    if getattr(error, "lightning_par_traceback_printed", False):
        return  # the run's first failure, printed whole when it happened (strategies/processes.py)
    if verbose:
        traceback.print_exception(error, file=sys.stderr)
        return
    notes = getattr(error, "__notes__", None) or []
    summary = next((note for note in notes if note.startswith("lightning-par: rank ")), None)
    if summary:  # a rank of a run whose first failure another rank printed
        print(summary, file=sys.stderr)
        return
    text = str(error) if isinstance(error, CommandLineError) else _one_line(error)
    print(f"lightning-par: error: {text}", file=sys.stderr)
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":  # once, not from every rank Lightning started
        print(f"lightning-par: (run again with {VERBOSE_FLAG} or {VERBOSE_VARIABLE}=1 for the traceback)",
              file=sys.stderr)


def _one_line(error: BaseException) -> str:
    from lightning_par.cli_errors import explain

    message = explain(str(error))  # a class's refusal of its arguments comes wrapped in jsonargparse's union text
    return message if isinstance(error, (ValueError, CheckpointError)) else f"{type(error).__name__}: {message}"


if __name__ == "__main__":
    main()
