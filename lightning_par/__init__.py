"""lightning-par: PyTorch Lightning strategies for data, sharded, tensor, pipeline, context and expert parallel.

The strategy names (``Trainer(strategy="data_parallel")``, ``L.Fabric(strategy=...)``) become known to Lightning when
``lightning_par.strategies`` is imported: by ``import lightning_par`` after Lightning, or by the first use of any
strategy class or of the ``lightning-par`` command. Lightning offers no entry point for strategies, and this package
does not import it itself: ``import lightning_par.planner`` and ``lightning-par plan`` stay free of it. The layers
below the strategies (``layout/``, ``parallel/``, ``planner/``, ``checkpoint/``, ``health/``, ``dry_run/``) never
import Lightning and run where it is not installed (docs/architecture.md; ``tests/test_layering.py``). Public classes
are loaded on first access (PEP 562).
"""

from __future__ import annotations

import importlib
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


if sys.modules.get("lightning") is not None:  # already imported, so free: register the names now
    importlib.import_module("lightning_par.strategies")
