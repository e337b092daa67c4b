"""The strategies' arguments as the user wrote them: which ``ParallelConfig`` field each sets, so that an error about
the layout names the argument (``data_parallel_size=-1``), not the mesh dimension it became (``dp_replicate=-1``)."""

from __future__ import annotations

import re

from lightning_par.layout.config import STRATEGY_ARGUMENTS

__all__ = ["argument_names", "rename_arguments"]

def argument_names(data_parallel_field: str | None = None) -> dict[str, str]:
    """ParallelConfig field -> argument, for a strategy whose ``data_parallel_size`` sets ``data_parallel_field``
    (``dp_replicate`` or ``dp_shard``; None when it is the product of both, or absent)."""
    return {**STRATEGY_ARGUMENTS, **({data_parallel_field: "data_parallel_size"} if data_parallel_field else {})}


def rename_arguments(error: BaseException, names: dict[str, str]) -> None:
    """Rewrite a ``ValueError``'s message in place, each config field in ``names`` replaced by its argument (whole
    words only). The error keeps its type and traceback."""
    if names and isinstance(error, ValueError) and error.args and isinstance(error.args[0], str):
        pattern = r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b"
        error.args = (re.sub(pattern, lambda match: names[match.group(1)], error.args[0]), *error.args[1:])
