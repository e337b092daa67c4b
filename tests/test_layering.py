"""Layering (DESIGN.md): the pure layers never import lightning; importing lightning_par registers names."""

from __future__ import annotations

import subprocess
import sys

# Modules that must stay usable without lightning: configuration, mesh, stage arithmetic, techniques,
# checkpoints, fault detection, the planner (and its command), and the pure parts of the model and data packages.
PURE_MODULES = [
    "lightning_par",
    "lightning_par.config",
    "lightning_par.mesh",
    "lightning_par.stages",
    "lightning_par.parallel",
    "lightning_par.parallel.comm",
    "lightning_par.checkpoint",
    "lightning_par.checkpoint_validation",
    "lightning_par.safe_dcp",
    "lightning_par.huggingface",
    "lightning_par.fault",
    "lightning_par.planner",
    "lightning_par.planner.cli",
    "lightning_par.models.llama",
    "lightning_par.data.corpus",
    "lightning_par.data.resumable",
    "lightning_par.data.text",
]


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_pure_layers_do_not_import_lightning() -> None:
    imports = "; ".join(f"import {name}" for name in PURE_MODULES)
    loaded = _run(f"import sys; {imports}; print(sorted(m for m in sys.modules if m.split('.')[0] in "
                  "('lightning', 'pytorch_lightning', 'lightning_fabric')))")
    assert loaded == "[]", f"lightning modules imported by the pure layers: {loaded}"


def test_strategy_names_resolve_whatever_the_import_order() -> None:
    check = ("from lightning.pytorch.strategies import StrategyRegistry; "
             "import lightning; t = lightning.Trainer(strategy='data_parallel', accelerator='cpu', devices=2, "
             "logger=False); print(type(t.strategy).__name__, 'data_parallel' in StrategyRegistry)")
    assert _run(f"import lightning_par; {check}").endswith("DataParallelStrategy True")
    assert _run(f"import lightning; import lightning_par; {check}").endswith("DataParallelStrategy True")


def test_the_planner_needs_nothing_of_the_techniques() -> None:
    """The planner reasons on sizes: it takes the layout rules from ParallelConfig and imports nothing of
    lightning_par.parallel (planning a search, composability included, loads no technique)."""
    code = ("import sys; import lightning_par.planner as planner; from lightning_par.planner.cli import main; "
            "from lightning_par.planner.runtime import plan_for_run; "
            "plan_for_run(planner.ModelSpec.preset('llama3-8b'), planner.ClusterSpec.from_preset('h100-80gb', "
            "devices_per_node=8), batch_size_per_rank=1, seq_len=4096); "
            "print(sorted(m for m in sys.modules if m.startswith('lightning_par.parallel')))")
    assert _run(code) == "[]"
