"""Modules of ``lightning_par.parallel`` that moved: importing one by its old name still works for one release, and
warns with the new name (``FutureWarning``, which Python shows by default)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old module -> the modules its public names now live in
MOVED = {
    "lightning_par.parallel.sequence": ("lightning_par.parallel.context",),
    "lightning_par.parallel.pipeline_trace": ("lightning_par.parallel.pipeline.trace",
                                              "lightning_par.parallel.modules"),
    "lightning_par.parallel.pipeline_runner": ("lightning_par.parallel.pipeline.runner",),
    "lightning_par.parallel.bubble": ("lightning_par.parallel.pipeline.bubble",),
    "lightning_par.parallel.weight_grad": ("lightning_par.parallel.pipeline.weight_grad",),
    "lightning_par.parallel.ties": ("lightning_par.parallel.pipeline.ties", "lightning_par.parallel.modules"),
    "lightning_par.parallel.replica": ("lightning_par.parallel.small_copy",),
    "lightning_par.parallel.plan": ("lightning_par.parallel.model_map",),
    "lightning_par.parallel.plan_check": ("lightning_par.parallel.model_map_check",),
}
# (old module, old name) -> the name it has now
RENAMED = {("lightning_par.parallel.replica", "small_replica"): "small_copy",
           ("lightning_par.parallel.pipeline.split", "SCHEDULES"): "TORCH_SCHEDULES",
           **{(old, name): new for old in ("lightning_par.parallel.plan", "lightning_par.parallel")
              for name, new in (("ModelPlan", "ModelMap"), ("derive_plan", "derive_model_map"),
                                ("huggingface_plan", "huggingface_model_map"), ("resolve_plan", "resolve_model_map"),
                                ("PLAN_SOURCES", "MAP_SOURCES"))},
           **{(old, "check_plan"): "check_model_map"
              for old in ("lightning_par.parallel.plan_check", "lightning_par.parallel")}}


def moved_name(old: str, new_modules: tuple[str, ...], name: str) -> object:
    """``name`` from the first of ``new_modules`` that has it, with a warning naming where it is now."""
    now = RENAMED.get((old, name), name)
    for new in new_modules:
        module = importlib.import_module(new)
        if hasattr(module, now):
            warnings.warn(f"{old}.{name} moved to {new}.{now}; the old name goes in the next release",
                          FutureWarning, stacklevel=3)
            return getattr(module, now)
    raise AttributeError(f"module {old!r} has no attribute {name!r}")


def renamed_attribute(module: str, name: str) -> object:
    """For a module's ``__getattr__``: the new name's object when ``name`` is an old name of ``module``."""
    if (module, name) not in RENAMED:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return moved_name(module, (module,), name)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, f"Moved to {', '.join(MOVED[spec.name])}.")
        module.__getattr__ = lambda name: moved_name(spec.name, MOVED[spec.name], name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Let the old module names import (once per process)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


__all__ = ["MOVED", "RENAMED", "install", "moved_name", "renamed_attribute"]
