"""How a run's failure is said: one line, led by the project's message, with the traceback on request. Shared by the
``lightning-par`` command (``cli/main.py``) and the ranks it starts (``strategies/processes.py``); imports nothing,
so that the planner's command stays free of Lightning."""

from __future__ import annotations

# Set by the lightning-par command for the ranks it starts: say the run's first failure there, once, in one line (with
# its traceback under VERBOSE_VARIABLE, which the command's --verbose sets).
ONE_TRACEBACK_VARIABLE = "LIGHTNING_PAR_ONE_TRACEBACK"
VERBOSE_VARIABLE = "LIGHTNING_PAR_VERBOSE"
VERBOSE_HINT = f"lightning-par: (run again with --verbose or {VERBOSE_VARIABLE}=1 for the traceback)"


def one_line(error: BaseException, message: str) -> str:
    """``error``'s ``message`` as the command says it: a refusal's (a ``ValueError``'s) own words, any other error's
    after its type's name."""
    return message if isinstance(error, ValueError) else f"{type(error).__name__}: {message}"
