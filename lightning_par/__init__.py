"""lightning-par: PyTorch Lightning strategies for data, sharded, tensor, pipeline, context and expert parallel.

Importing this package makes the strategy names (``Trainer(strategy="data_parallel")``) known to Lightning.
It does so without importing Lightning itself: ``lightning_par.config``, ``lightning_par.parallel`` and
``lightning_par.planner`` must stay usable without it (docs/architecture.md). If Lightning is already imported the
names are registered now; otherwise they are registered the moment ``lightning.pytorch`` finishes
importing. Public classes are loaded on first access (PEP 562).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ParallelConfig": "lightning_par.config",
    "ParallelMesh": "lightning_par.mesh",
    "ModelMap": "lightning_par.parallel.model_map",
    "MeshStrategy": "lightning_par.strategies",
    "DataParallelStrategy": "lightning_par.strategies",
    "ZeroStrategy": "lightning_par.strategies",
    "TensorParallelStrategy": "lightning_par.strategies",
    "ContextParallelStrategy": "lightning_par.strategies",
    "SequenceParallelStrategy": "lightning_par.strategies",
    "PipelineParallelStrategy": "lightning_par.strategies",
    "ExpertParallelStrategy": "lightning_par.strategies",
    "Hybrid3DStrategy": "lightning_par.strategies",
    "AutoParallelStrategy": "lightning_par.strategies",
    "register_strategies": "lightning_par.strategies",
    "LlamaLM": "lightning_par.models",
    "LlamaConfig": "lightning_par.models",
    "TokenDataModule": "lightning_par.data",
}
_RENAMED = {"ModelPlan": "ModelMap"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _RENAMED:  # old names, for one release
        import warnings

        warnings.warn(f"lightning_par.{name} is now lightning_par.{_RENAMED[name]}; the old name goes in the next "
                      "release", FutureWarning, stacklevel=2)
        return __getattr__(_RENAMED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register() -> None:
    # Importing lightning_par.strategies registers the names at its end. If it is in sys.modules already
    # it is being imported right now (it is what pulled lightning in) and will register when it finishes.
    if "lightning_par.strategies" not in sys.modules:
        importlib.import_module("lightning_par.strategies")


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Runs :func:`_register` right after ``lightning.pytorch`` has executed, then removes itself."""

    _target = "lightning.pytorch"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self._target:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        original_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register()

        spec.loader.exec_module = exec_module
        return spec


if "lightning.pytorch" in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterWhenLightningLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
