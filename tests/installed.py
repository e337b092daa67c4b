"""What the README's test command installs, for the tests that need it: a missing package fails the test that
needs it, naming the package (a skip would let a run pass that proved nothing). Only what CI cannot have, a CUDA
device, may skip. Commands are run through this interpreter (``python -m``), not looked up on ``PATH``, so a
``python -m pytest`` from outside an activated virtual environment runs them too."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

__all__ = ["LIGHTHOUSE", "PYTHON", "TORCHRUN", "require", "require_lighthouse"]

# The interpreter for the commands the tests start: it runs them warm, forked from the test session's server that has
# imported torch, Lightning and lightning_par (tests/warm_server.py), and cold where there is none.
PYTHON = str(Path(__file__).with_name("warm") / "python")
# torch's torchrun, as its console script runs it; torchft's torchft_lighthouse, which reads the process's own command
# line (so it cannot run under `python -c`), from beside this interpreter.
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]
LIGHTHOUSE = [str(Path(sys.executable).parent / "torchft_lighthouse")]


def require_lighthouse() -> None:
    """torchft's lighthouse beside this interpreter, or the test failed naming it."""
    require("torchft")
    if not Path(LIGHTHOUSE[0]).is_file():
        pytest.fail(f"torchft_lighthouse is not in {Path(LIGHTHOUSE[0]).parent}, beside this Python: reinstall "
                    "torchft-nightly (the test extra installs it)", pytrace=False)


def require(module: str) -> ModuleType:
    """``module`` imported, or the test (or the test module, at collection) failed with what installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        pytest.fail(f"{module} is not installed ({error}): the README's test command installs it (pip install -e "
                    "\".[test]\", then pip install --no-deps litgpt==0.5.13 litdata==0.2.76)", pytrace=False)
