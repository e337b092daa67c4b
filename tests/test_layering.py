"""Layering (docs/architecture.md): the pure layers never import lightning; importing lightning_par registers names."""

from __future__ import annotations

import subprocess
import sys

# Modules that must stay usable without lightning: configuration, mesh, stage arithmetic, techniques,
# checkpoints, fault detection, dry runs, the planner (and its command), and the pure parts of the model and data packages.
PURE_MODULES = [
    "lightning_par",
    "lightning_par.config",
    "lightning_par.mesh",
    "lightning_par.stages",
    "lightning_par.parallel",
    "lightning_par.parallel.comm",
    "lightning_par.dry_run",
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
    "lightning_par.data.documents",
    "lightning_par.data.prepare",
    "lightning_par.data.shards",
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


def _package_imports() -> dict[str, set[str]]:
    """Each module of lightning_par and the modules of lightning_par it imports, anywhere in its file (a function's
    deferred import as well: a circle through one is still a circle)."""
    import ast
    from pathlib import Path

    import lightning_par

    root = Path(lightning_par.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:  # `from package import module` names the module
                    imported.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base)
        graph[module] = {name for name in imported if name in names and name != module}
    return graph


def test_the_package_imports_form_no_circle() -> None:
    """No module of lightning_par reaches itself through its imports, except through the package files
    (``__init__.py``) that gather their own modules' names, which Python loads first either way."""
    graph = _package_imports()
    gathering = {module for module, imported in graph.items() if any(m.startswith(module + ".") for m in imported)}

    def circle_from(start: str) -> list[str] | None:
        path, seen = [start], set()

        def visit(module: str) -> list[str] | None:
            for target in sorted(graph[module] - gathering):
                if target == start:
                    return path + [start]
                if target not in seen:
                    seen.add(target)
                    path.append(target)
                    if (found := visit(target)) is not None:
                        return found
                    path.pop()
            return None

        return visit(start)

    circles = [circle for module in sorted(graph) if module not in gathering
               if (circle := circle_from(module)) is not None]
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


def test_moved_modules_import_by_their_old_names_with_a_warning() -> None:
    out = _run("import warnings; warnings.simplefilter('always'); "
               "import lightning_par.parallel\n"
               "with warnings.catch_warnings(record=True) as caught:\n"
               "    warnings.simplefilter('always')\n"
               "    from lightning_par.parallel.ties import clean_name, StageTies\n"
               "    from lightning_par.parallel.sequence import apply_context_parallel\n"
               "    from lightning_par.parallel.zero import materialize_meta_parameters\n"
               "    from lightning_par.parallel.plan import ModelPlan\n"
               "    from lightning_par import ModelPlan as TopModelPlan\n"
               "print(len({str(w.message) for w in caught if issubclass(w.category, FutureWarning)}), "
               "clean_name.__module__, StageTies.__module__, ModelPlan.__name__, TopModelPlan is ModelPlan)")
    assert out.split()[-5:] == ["6", "lightning_par.parallel.modules", "lightning_par.parallel.pipeline.ties",
                                "ModelMap", "True"], out


def test_parallelize_takes_the_old_keyword_plan_with_a_warning() -> None:
    out = _run("import warnings, torch, torch.distributed as dist\n"
               "from lightning_par.config import ParallelConfig\n"
               "from lightning_par.models.llama import LlamaConfig, Transformer\n"
               "from lightning_par.parallel import derive_model_map, parallelize\n"
               "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())\n"
               "config = ParallelConfig(zero_stage=3).validate(1)\n"
               "model = Transformer(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16))\n"
               "model_map = derive_model_map(model)\n"
               "with warnings.catch_warnings(record=True) as caught:\n"
               "    warnings.simplefilter('always')\n"
               "    handle = parallelize(model, config.build_mesh('cpu'), config, plan=model_map)\n"
               "try:\n"
               "    parallelize(model, config.build_mesh('cpu'), config, model_map, plan=model_map)\n"
               "except ValueError as error:\n"
               "    print(error)\n"
               "print(any('parallelize(plan=...) is now parallelize(model_map=...)' in str(w.message) for w in caught), "
               "type(next(handle.module.layers.children())).__name__)")
    assert out.splitlines()[-2] == "give the model map once: as model_map (plan is its old name), not both", out
    assert out.splitlines()[-1].startswith("True FSDP"), out  # the blocks became ZeRO-3 units: the map was used
