"""Layering (docs/architecture.md): the pure layers never import Lightning, ``layout/`` imports nothing of the package,
nothing below ``cli/`` imports it, no import circles, a short top level; the strategies register their names and the
planner starts without Lightning; methods, schedules and stages are named only by their rows."""

from __future__ import annotations

import subprocess
import sys

# The layers below the strategies: usable where Lightning is not installed.
PURE_PACKAGES = ("lightning_par.layout", "lightning_par.parallel", "lightning_par.planner", "lightning_par.checkpoint",
                 "lightning_par.health", "lightning_par.dry_run", "lightning_par.optim")
# And the pure parts of the model and data packages.
PURE_MODULES = ["lightning_par.models.llama", "lightning_par.data.corpus", "lightning_par.data.resumable",
                "lightning_par.data.text", "lightning_par.data.documents", "lightning_par.data.prepare",
                "lightning_par.data.shards", "lightning_par.data.shard_windows", "lightning_par.data.share_check"]
# Commands that run without Lightning too (their Lightning parts are imported where an option needs them).
PURE_COMMANDS = ["lightning_par.cli.plan"]
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
# The layers that may import Lightning (docs/architecture.md).
LIGHTNING_LAYERS = ("lightning_par.strategies", "lightning_par.callbacks", "lightning_par.cli")


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def test_pure_layers_import_no_lightning_and_run_where_it_is_not_installed() -> None:
    """Statically: no module of the pure layers imports Lightning or a module of the Lightning layers, directly or
    through the package's modules it imports. At run time (the planner's command as well): with Lightning made unimportable, importing them works and
    the planner plans."""
    graph, outside = _package_imports(with_outside=True)
    pure = [module for module in graph if _in(module, PURE_PACKAGES) or module in PURE_MODULES]
    for module in pure:
        reached, frontier = {module}, [module]
        while frontier:
            for target in graph[frontier.pop()] - reached:
                reached.add(target)
                frontier.append(target)
        lightning_layers = sorted(m for m in reached if _in(m, LIGHTNING_LAYERS) and m not in PURE_MODULES)
        lightnings = sorted({name for m in reached for name in outside[m] if name.split(".")[0] in LIGHTNING})
        assert not lightning_layers and not lightnings, (module, lightning_layers, lightnings)
    modules = [m for m in graph if _in(m, PURE_PACKAGES)] + PURE_MODULES + PURE_COMMANDS
    code = ("import sys\n"
            "for name in " + repr(LIGHTNING) + ": sys.modules[name] = None  # as if not installed\n"
            + "".join(f"import {name}\n" for name in sorted(modules))
            + "import lightning_par.planner as planner\n"
            "from lightning_par.planner.runtime import plan_for_run\n"
            "plan_for_run(planner.ModelSpec.preset('llama3-8b'), planner.ClusterSpec.from_preset('h100-80gb', "
            "devices_per_node=8), batch_size_per_rank=1, seq_len=4096)\n"
            "print(sorted(m for m in sys.modules if m.startswith('lightning_par.strategies')))")
    assert _run(code) == "[]"


def test_layout_imports_nothing_of_the_package_and_nothing_below_cli_imports_it() -> None:
    graph = _package_imports()
    layout = {module: sorted(imported) for module, imported in graph.items()
              if _in(module, ("lightning_par.layout",)) and imported - {m for m in graph if _in(m, ("lightning_par.layout",))}}
    assert not layout, f"layout/ imports other modules of the package: {layout}"
    below_cli = {module: sorted(m for m in imported if _in(m, ("lightning_par.cli",)))
                 for module, imported in graph.items() if not _in(module, ("lightning_par.cli",))}
    assert not {module: cli for module, cli in below_cli.items() if cli}, below_cli


def test_the_top_level_holds_the_packages_the_architecture_names_and_nothing_else() -> None:
    """Every module lives in one of the layers of docs/architecture.md's map, and every layer there exists."""
    import re
    from pathlib import Path

    import lightning_par

    root = Path(lightning_par.__file__).parent
    modules = sorted(path.name for path in root.glob("*.py") if path.name != "__init__.py")
    assert not modules, f"modules outside the layers of docs/architecture.md: {modules}"
    packages = {path.parent.name for path in root.glob("*/__init__.py")}
    architecture = (root.parent / "docs" / "architecture.md").read_text()
    map_block = architecture.split("```")[1]
    named = set(re.findall(r"^([a-z_]+)/", map_block, flags=re.MULTILINE))
    named |= set(re.findall(r"^[a-z_]+/, ([a-z_]+)/", map_block, flags=re.MULTILINE))
    assert packages == named, f"packages {sorted(packages - named)} missing from docs/architecture.md's map; " \
                              f"named there but absent: {sorted(named - packages)}"


def test_strategy_names_resolve_whatever_the_import_order_and_the_planner_imports_no_lightning() -> None:
    """``import lightning_par`` registers the names before or after Lightning (which has no entry point for
    strategies); importing only a Lightning-free part (the planner, the command's module) imports no Lightning."""
    check = ("from lightning.pytorch.strategies import StrategyRegistry; "
             "import lightning; t = lightning.Trainer(strategy='data_parallel', accelerator='cpu', devices=2, "
             "logger=False); print(type(t.strategy).__name__, 'data_parallel' in StrategyRegistry)")
    assert _run(f"import lightning_par; {check}").endswith("DataParallelStrategy True")
    assert _run(f"import lightning; import lightning_par; {check}").endswith("DataParallelStrategy True")
    assert _run("import sys, lightning_par.planner, lightning_par.layout.config, lightning_par.cli.main; "
                "print(sorted(m for m in sys.modules if m.split('.')[0] in " + repr(LIGHTNING) + "))") == "[]"
    plan = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_par.cli.main", "plan", "--model",
                           "llama3-8b", "--nodes", "1", "--devices-per-node", "8", "--device", "h100-80gb",
                           "--global-batch-size", "64", "--seq-len", "2048"], capture_output=True, text=True,
                          timeout=120)
    assert plan.returncode == 0 and "Chosen:" in plan.stdout, plan.stderr
    imported = {line.split("|")[-1].strip() for line in plan.stderr.splitlines() if line.startswith("import time:")}
    assert not {name for name in imported if name.split(".")[0] in LIGHTNING}


def test_the_planner_needs_nothing_of_the_techniques() -> None:
    """The planner reasons on sizes: it takes the layout rules from ParallelConfig and imports nothing of
    lightning_par.parallel (planning a search, composability included, loads no technique)."""
    graph = _package_imports()
    reads_techniques = sorted(module for module, imported in graph.items() if _in(module, ("lightning_par.planner",))
                              and any(_in(target, ("lightning_par.parallel",)) for target in imported))
    assert reads_techniques == ["lightning_par.planner.module_spec"], reads_techniques  # a live module's description
    code = ("import sys; sys.modules['lightning'] = None; import lightning_par.planner as planner; from lightning_par.cli.plan import main; "
            "from lightning_par.planner.runtime import plan_for_run; "
            "plan_for_run(planner.ModelSpec.preset('llama3-8b'), planner.ClusterSpec.from_preset('h100-80gb', "
            "devices_per_node=8), batch_size_per_rank=1, seq_len=4096); "
            "print(sorted(m for m in sys.modules if m.startswith('lightning_par.parallel')))")
    assert _run(code) == "[]"


def _package_imports(with_outside: bool = False) -> dict[str, set[str]] | tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Each module of lightning_par and the modules of lightning_par it imports, anywhere in its file (a function's
    deferred import as well: a circle through one is still a circle); ``with_outside``: also what else it imports."""
    import ast
    from pathlib import Path

    import lightning_par

    root = Path(lightning_par.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
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
        outside[module] = {name for name in imported if not name.startswith("lightning_par")}
    return (graph, outside) if with_outside else graph


def test_the_package_imports_form_no_circle() -> None:
    """No module of lightning_par reaches itself through its imports, package files (``__init__.py``) included."""
    graph = _package_imports()

    def circle_from(start: str) -> list[str] | None:
        path, seen = [start], set()

        def visit(module: str) -> list[str] | None:
            for target in sorted(graph[module]):
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

    circles = [circle for module in sorted(graph) if (circle := circle_from(module)) is not None]
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


def test_methods_schedules_and_stages_are_named_only_by_their_rows() -> None:
    """docs/architecture.md: a context method is its row and its function, a schedule its row, a ZeRO stage its row.
    So a method or schedule name other than the config's default is quoted only in its table, its own code and the
    published layouts the planner reproduces; no code compares stage numbers."""
    import re
    from pathlib import Path

    import lightning_par
    from lightning_par.layout.config import ParallelConfig
    from lightning_par.layout.context_methods import CONTEXT_METHODS
    from lightning_par.layout.schedules import SCHEDULES

    root = Path(lightning_par.__file__).parent
    sources = {str(path.relative_to(root)): path.read_text() for path in root.rglob("*.py")}
    published = "planner/published.py"
    for names, default, allowed in ((CONTEXT_METHODS, ParallelConfig.cp_method,
                                     {"layout/context_methods.py", "parallel/context.py", published}),
                                    (SCHEDULES, ParallelConfig.pp_schedule, {"layout/schedules.py", published})):
        for name in set(names) - {default}:
            quoted = {path for path, text in sources.items() if re.search(rf"[\"']{name}[\"']", text)}
            assert quoted <= allowed, (name, sorted(quoted - allowed))
    compared = [f"{path}: {line.strip()}" for path, text in sources.items() for line in text.splitlines()
                if re.search(r"zero_stage *(==|!=|>=|<=|<|>|in|not in) *[(\d]", line)]
    assert not compared, compared
