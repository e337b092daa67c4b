"""lightning-par: PyTorch Lightning strategies for data, sharded, tensor, pipeline, context and expert parallel.

Importing this package makes the strategy names (``Trainer(strategy="data_parallel")``, ``L.Fabric(strategy=...)``)
known to Lightning, before or after Lightning is imported: it imports ``lightning_par.strategies``, which registers
them (Lightning offers no entry point for strategies). An import that asks only for a part that runs without Lightning
(``import lightning_par.planner``, the layout, the techniques, ``lightning-par plan``) imports no Lightning; the
strategies then register the names when they are first imported. The layers below the strategies (``layout/``,
``parallel/``, ``planner/``, ``checkpoint/``, ``health/``, ``dry_run/``) never import Lightning and run where it is
not installed (docs/architecture.md; ``tests/test_layering.py``). Public classes are loaded on first access (PEP 562).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ParallelConfig": "lightning_par.layout.config",
    "ParallelMesh": "lightning_par.parallel.mesh",
    "ModelMap": "lightning_par.parallel.model_map",
    "MeshStrategy": "lightning_par.strategies",
    "DataParallelStrategy": "lightning_par.strategies",
    "ZeroStrategy": "lightning_par.strategies",
    "TensorParallelStrategy": "lightning_par.strategies",
    "ContextParallelStrategy": "lightning_par.strategies",
    "PipelineParallelStrategy": "lightning_par.strategies",
    "ExpertParallelStrategy": "lightning_par.strategies",
    "Hybrid3DStrategy": "lightning_par.strategies",
    "AutoParallelStrategy": "lightning_par.strategies",
    "register_strategies": "lightning_par.strategies",
    "LlamaLM": "lightning_par.models",
    "LlamaConfig": "lightning_par.models",
    "TokenDataModule": "lightning_par.data",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The parts of the package that run without Lightning, and the commands that import it only where a run needs it:
# importing one of them alone registers nothing (docs/architecture.md).
_LIGHTNING_FREE = ("lightning_par.layout", "lightning_par.parallel", "lightning_par.planner", "lightning_par.checkpoint",
                   "lightning_par.health", "lightning_par.dry_run")
_LIGHTNING_FREE_MODULES = ("lightning_par.cli", "lightning_par.cli.main", "lightning_par.cli.plan")


def _asked_for() -> str:
    """The module of this package that the running import asked for (``lightning_par.planner`` when this package is
    imported as its parent): the outermost of the imports in progress that are this package's. Read from the import
    system's frames, which CPython keeps on the stack; ``lightning_par`` where none is found."""
    asked, frame = __name__, sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_find_and_load":  # importlib._bootstrap, one frame per module being imported
            name = frame.f_locals.get("name", "")
            if not isinstance(name, str) or not (name == __name__ or name.startswith(__name__ + ".")):
                break
            asked = name
        frame = frame.f_back
    return asked


def _registers_now() -> bool:
    """Whether this import registers the strategy names: where Lightning is imported already (free), or installed and
    the import asked for more than a Lightning-free part (``import lightning_par`` before ``import lightning`` must
    still make ``Trainer(strategy="hybrid3d")`` work: Lightning has no entry point for strategies)."""
    if "lightning" in sys.modules:
        return sys.modules["lightning"] is not None
    if importlib.util.find_spec("lightning") is None:
        return False
    asked = _asked_for()
    return asked not in _LIGHTNING_FREE_MODULES and not any(asked == part or asked.startswith(part + ".")
                                                            for part in _LIGHTNING_FREE)


if _registers_now():
    importlib.import_module("lightning_par.strategies")
