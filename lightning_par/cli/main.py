"""The ``lightning-par`` command: fit, validate, test and predict through LightningCLI (``cli_classes.py``), with
every lightning_par strategy name registered; ``plan`` (the layout planner), ``check`` (a dry run), ``verify`` (a
layout against one process) and ``prepare`` (a pretraining corpus tokenized once into shards, docs/data.md).

    lightning-par fit --config configs/data_parallel.yaml
    lightning-par validate --config configs/data_parallel.yaml --ckpt_path lightning_logs/.../last.ckpt

Any LightningModule / LightningDataModule can be named with ``class_path`` in the YAML (the shipped configs name
the reference Llama model and the standard-library corpus).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from lightning_par.cli.errors import CommandLineError
from lightning_par.health.failure_text import ONE_TRACEBACK_VARIABLE, VERBOSE_HINT, VERBOSE_VARIABLE, one_line

VERBOSE_FLAG = "--verbose"


def main(args: Any = None) -> None:
    """Console-script entry point; ``lightning-par plan ...`` runs the layout planner instead of LightningCLI and
    ``lightning-par check ...`` a dry run of a config at its target world size (``lightning_par/cli/check.py``).

    A mistake is said in one line on stderr, led by the key and value at fault, and the command exits with 2 (a
    command line or config the parser refused) or 1; the traceback comes with ``--verbose`` or
    ``LIGHTNING_PAR_VERBOSE=1``. A run that fails after its processes started says its first failure once, in one
    line (with ``--verbose``: its traceback, and one line for each other rank)."""
    argv = list(sys.argv[1:] if args is None else args)
    verbose = VERBOSE_FLAG in argv or os.environ.get(VERBOSE_VARIABLE, "") not in ("", "0")
    if VERBOSE_FLAG in argv:
        argv.remove(VERBOSE_FLAG)
    if argv[:1] == ["plan"]:
        from lightning_par.cli.plan import main as plan

        plan(argv[1:])
        return
    if argv[:1] == ["check"]:
        from lightning_par.cli.check import main as check

        _one_line_errors(check, argv[1:], verbose)
        return
    if argv[:1] == ["prepare"]:
        from lightning_par.data.prepare import main as prepare

        _one_line_errors(prepare, argv[1:], verbose)
        return
    if argv[:1] == ["verify"]:
        from lightning_par.cli.verify import main as verify

        _one_line_errors(verify, argv[1:], verbose)
        return
    from lightning_par.cli.lightning_cli import ParallelCLI, Parser  # Lightning: only for the commands that need it

    _notes_to_stdout()
    # For the ranks Lightning starts (they run this command again), and only for the command's own run.
    saved = {name: os.environ.get(name) for name in (VERBOSE_VARIABLE, ONE_TRACEBACK_VARIABLE)}
    os.environ[ONE_TRACEBACK_VARIABLE] = "1"
    if verbose:
        os.environ[VERBOSE_VARIABLE] = "1"
    try:
        if args is None:  # LightningCLI reads sys.argv itself (and warns when given both)
            sys.argv[1:] = argv
        ParallelCLI(args=None if args is None else argv, parser_class=Parser)
    except Exception as error:  # noqa: BLE001 - every error reaches the user, as one line unless asked otherwise
        _report(error, verbose)
        raise SystemExit(2 if isinstance(error, CommandLineError) else 1) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _notes_to_stdout() -> None:
    """Lightning's and lightning_par's notes (devices, layout, plan) on stdout, their warnings and errors on stderr:
    so that stderr holds the problems only, and a run's mistake is its first line."""
    import logging

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            # Below WARNING: not split yet (a process that runs the command again keeps one handler for its notes).
            split = handler.level >= logging.WARNING
            if type(handler) is logging.StreamHandler and handler.stream is sys.stderr and not split:
                notes = logging.StreamHandler(sys.stdout)
                notes.setFormatter(handler.formatter)
                notes.addFilter(lambda record: record.levelno < logging.WARNING)
                handler.setLevel(logging.WARNING)
                logger.addHandler(notes)


def _one_line_errors(command: Any, argv: list[str], verbose: bool) -> None:
    """Run ``command(argv)``, a mistake said as :func:`main` says it."""
    try:
        command(argv)
    except Exception as error:  # noqa: BLE001 - every error reaches the user, as one line unless asked otherwise
        _report(error, verbose)
        raise SystemExit(2 if isinstance(error, CommandLineError) else 1) from None


def _report(error: BaseException, verbose: bool) -> None:
    """Print ``error`` for the user: nothing more for the run's first failure (said when it happened), the one-line
    summary of a rank of a run that failed elsewhere first when asked for (nothing otherwise), the traceback of any
    other error when asked for, else one line."""
    if getattr(error, "lightning_par_reported", False):
        return  # the run's first failure, said when it happened (strategies/processes.py)
    notes = getattr(error, "__notes__", None) or []
    summary = next((note for note in notes if note.startswith("lightning-par: rank ")), None)
    if summary:  # a rank of a run whose first failure another rank said
        if verbose:
            print(summary, file=sys.stderr)
        return
    if verbose:
        traceback.print_exception(error, file=sys.stderr)
        return
    text = str(error) if isinstance(error, CommandLineError) else _one_line(error)
    print(f"lightning-par: error: {text}", file=sys.stderr)
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":  # once, not from every rank Lightning started
        print(VERBOSE_HINT, file=sys.stderr)


def _one_line(error: BaseException) -> str:
    from lightning_par.cli.errors import explain

    # A class's refusal of its arguments comes wrapped in jsonargparse's union text.
    return one_line(error, explain(str(error)))


def __getattr__(name: str) -> Any:
    # The command's LightningCLI classes, importable from here; loaded (with Lightning) only when asked for (PEP 562).
    if name in ("ParallelCLI", "check_strategy_name"):
        from lightning_par.cli import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ParallelCLI", "check_strategy_name", "main"]


if __name__ == "__main__":
    main()
