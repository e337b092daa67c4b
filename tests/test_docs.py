"""Every command in README.md and docs/*.md is checked as written.

Commands come from the ```bash blocks (continued lines joined, ``&&`` chains split, comments dropped) and
are checked by kind, without the minutes a full run takes:

- ``lightning-par fit|validate ...`` (also after ``srun``/``torchrun ... -m lightning_par.cli``): the
  command line and its config parse, with ``--print_config``, in this process;
- ``lightning-par plan ...``: runs, in this process;
- ``lightning-par check|verify ...``: read and checked as the command does before its processes start;
- ``python benchmarks/X.py ...`` / ``python docs/X.py``: the script's own parser accepts the arguments;
- ``sbatch SCRIPT CONFIG ...``: the script and config exist (tests/test_slurm.py submits it for real);
- ``pip install`` and ``python -m pytest``: what CI itself runs; ``tensorboard``: installed.

Anything else (a user's own ``train.py``, paths of a past run, ``...`` placeholders) is named in the
skip list below with the reason, so a new kind of command fails until someone decides how to check it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WARM_BIN = Path(__file__).resolve().parent / "warm" / "bin"
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Commands that need what only a user has: checked by eye, not here.
NOT_RUNNABLE = (
    "train.py",  # the user's own training script
    "lightning-par-export lightning_logs/",  # a checkpoint of an earlier run
    "lightning-par plan ...",  # an abbreviation in prose
)


def documented_commands() -> list[tuple[str, str]]:
    """(document name, command) for every command in a ```bash block, once: a command that several documents show
    runs under the first of them."""
    found: list[tuple[str, str]] = []
    for document in DOCUMENTS:
        for block in re.findall(r"```bash\n(.*?)```", document.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if not line or line.startswith("#"):
                    continue
                found += [(document.name, part.strip()) for part in line.split("&&")
                          if part.strip() not in {command for _, command in found}]
    return found


COMMANDS = documented_commands()


def test_the_documents_have_commands() -> None:
    assert len(COMMANDS) >= 15, COMMANDS


@pytest.mark.parametrize(("document", "command"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command(document: str, command: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("sys.argv", ["lightning-par"])  # the command line is the documented one, not pytest's
    words = shlex.split(command)
    if any(marker in command for marker in NOT_RUNNABLE):
        pytest.skip("needs the user's own script or an earlier run's files")
    if words[0] == "srun":
        words = words[1:]
    if words[0] == "torchrun":
        words = ["lightning-par", *words[words.index("lightning_par.cli") + 1:]]
    if words[:2] in (["pip", "install"], ["python", "-m"]) and ("pytest" in words or "install" in words):
        return  # CI runs exactly these: .ci/run ends with the README's test command
    if words[0] == "tensorboard":
        assert shutil.which("tensorboard"), "tensorboard is a dependency"
        return
    if words[0] == "torchft_lighthouse":  # torchft's own command (the test extra installs it): its flags exist
        import subprocess

        from installed import LIGHTHOUSE, require_lighthouse

        require_lighthouse()
        usage = subprocess.run([*LIGHTHOUSE, "--help"], capture_output=True, text=True).stdout
        assert all(flag in usage for flag in words if flag.startswith("--")), usage
        return
    if words[0] == "export":  # the variables lightning_par (or torchft) reads
        from lightning_par.health.fault_tolerance import GROUP_VARIABLE, LIGHTHOUSE_VARIABLE

        assert {word.split("=")[0] for word in words[1:]} <= {GROUP_VARIABLE, LIGHTHOUSE_VARIABLE}, command
        return
    if words[0] == "sbatch":
        script = next(word for word in words[1:] if not word.startswith("--"))
        config = words[words.index(script) + 1]
        assert (REPO / script).is_file() and (REPO / config).is_file(), command
        return
    if words[0] == "python" and words[1].endswith(".py"):
        _check_script_arguments(REPO / words[1], words[2:])
        return
    assert words[0] == "lightning-par", f"no check for this kind of command yet: {command}"
    if words[1] in ("check", "verify"):  # read and checked as each command does before its processes start
        from lightning_par.cli.check import read_command as read_check
        from lightning_par.cli.verify import read_command as read_verify

        (read_check if words[1] == "check" else read_verify)(words[2:])
        return
    if words[1] == "prepare":  # its arguments parse; tests/test_streaming_data.py runs it
        from lightning_par.data.prepare import _parser

        _parser().parse_args(words[2:])
        return
    if words[1] == "plan":
        from lightning_par.cli.plan import main as plan

        plan(words[2:])
        # --published prints the table of published runs instead of planning
        assert ("| run | source |" if "--published" in words else "Planning") in capsys.readouterr().out
        return
    _check_fit_command(words[1:])


# The documents whose training commands tests/ runs for real, as written (each chain of a ```bash line, less the
# ``pip install`` that CI itself ran first); a shorter run goes through the config itself, never an override here.
RUN_AS_WRITTEN = ("README.md", "models.md")


def training_chains() -> list[list[str]]:
    """Each ```bash line of RUN_AS_WRITTEN that trains, as the commands of its ``&&`` chain after ``pip install``."""
    chains = []
    for document in (d for d in DOCUMENTS if d.name in RUN_AS_WRITTEN):
        for block in re.findall(r"```bash\n(.*?)```", document.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                parts = [part.strip() for part in line.split(" #")[0].split("&&") if part.strip()]
                if any(part.startswith("lightning-par fit") for part in parts):
                    chains.append([part for part in parts if not part.startswith("pip ")])
    return chains


@pytest.mark.parametrize("chain", training_chains(), ids=lambda chain: " && ".join(chain)[:80])
def test_training_command_runs_as_written(chain: list[str], tmp_path: Path) -> None:
    """The command trains to its end, in a fresh directory that has the repository's configs and examples, and
    leaves TensorBoard logs there (and the fine-tuned model directory its config exports)."""
    import os
    import subprocess

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for shipped in ("configs", "examples"):
        (tmp_path / shipped).symlink_to(REPO / shipped)
    # `python` and `lightning-par` start warm (tests/warm/bin): the command's words are the documented ones.
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PATH": f"{WARM_BIN}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", " && ".join(chain)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=540, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (run,) = [path.parent for path in (tmp_path / "lightning_logs").rglob("events.out.tfevents.*")]
    events = EventAccumulator(str(run))
    events.Reload()
    assert "train_loss" in events.Tags()["scalars"], events.Tags()["scalars"]
    if "finetune_" in chain[-1]:
        import transformers

        scalars = set(events.Tags()["scalars"])
        assert {"val_loss", "perf/mfu", "memory/peak_gib_max", "train/grad_norm"} <= scalars, scalars
        losses = [event.value for event in events.Scalars("train_loss")]
        assert losses[-1] <= 0.75 * losses[0], losses  # the demo visibly learns: its last loss 25% or more lower
    if "finetune_hf.yaml" in chain[-1]:
        assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned") is not None
    if "finetune_lora.yaml" in chain[-1]:  # the adapters, for peft; the checkpoint without the frozen base
        import peft

        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-pretrained" / "model")
        assert peft.PeftModel.from_pretrained(base, tmp_path / "finetuned-adapter") is not None
        (checkpoint,) = run.rglob("*.ckpt")
        assert not any("base_layer" in name for name in _tensor_names(checkpoint)), checkpoint


def _tensor_names(checkpoint: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)


def _check_fit_command(args: list[str]) -> None:
    from lightning_par.cli.main import ParallelCLI

    with contextlib.redirect_stdout(io.StringIO()) as printed, pytest.raises(SystemExit) as exit_:
        ParallelCLI(args=[*args, "--print_config"])
    assert exit_.value.code in (0, None), printed.getvalue()[-2000:]
    assert "strategy:" in printed.getvalue()


def _check_script_arguments(script: Path, args: list[str]) -> None:
    assert script.is_file(), script
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "build_parser"):
        module.build_parser().parse_args(args)
    else:
        assert len(args) >= 1, f"{script.name} takes arguments"


# Paths the documents and docstrings name that are not in this repository, with the reason.
NOT_HERE = {
    "benchmarks/llama3_h100_202412_torchtitan.md": "torchtitan's file, cited with its repository",
    "benchmarks/X.py": "a placeholder in this file's docstring",
    "docs/X.py": "a placeholder in this file's docstring",
}
DOTTED_NAME = re.compile(r"\blightning_par(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FILE_PATH = re.compile(r"(?<![\w/.-])((?:lightning_par|docs|tests|benchmarks|configs|\.ci|parallel|strategies|planner"
                       r"|callbacks|models|data)/[\w./-]*\.(?:py|md|yaml|sh|toml|json|svg|png|txt))\b")


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module of the package, or a name in one (an attribute path below the longest
    importable prefix)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_every_module_and_path_named_in_the_docs_and_docstrings_exists() -> None:
    """Every dotted name under ``lightning_par`` and every repository path (``docs/zero.md``, ``parallel/zero.py``,
    ``tests/test_zero.py::...``) that a document, docstring or comment names is there."""
    import warnings

    sources = [*DOCUMENTS, *sorted((REPO / "lightning_par").rglob("*.py")), *sorted((REPO / "tests").glob("*.py")),
               *sorted((REPO / "benchmarks").rglob("*.py"))]
    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for source in sources:
            text = source.read_text()
            named = source.relative_to(REPO)
            missing += [f"{named}: {name}" for name in sorted(set(DOTTED_NAME.findall(text)))
                        if not _resolves(name)]
            missing += [f"{named}: {path}" for path in sorted(set(FILE_PATH.findall(text)))
                        if path not in NOT_HERE and not (REPO / path).exists()
                        and not (REPO / "lightning_par" / path).exists()]
    assert not missing, "named but not there:\n" + "\n".join(missing)


def _docs_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scalar_charts_draw_the_monitoring_tags_of_a_run(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run"))
    for step in range(5):
        writer.add_scalar("perf/tokens_per_sec", 100.0 + step, step)
        writer.add_scalar("train/loss", 5.0 - step, step)
        writer.add_scalar("epoch", 0, step)  # not a monitoring tag
    writer.close()
    plot = _docs_script("plot_scalars")
    scalars = plot.read_scalars(tmp_path / "run")
    assert sorted(scalars) == ["perf/tokens_per_sec", "train/loss"]
    assert [value for _, value in scalars["train/loss"]] == [5.0, 4.0, 3.0, 2.0, 1.0]
    plot.main([str(tmp_path / "run"), str(tmp_path / "charts.png")])
    assert (tmp_path / "charts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_schedule_chart_draws_every_recorded_action(tmp_path: Path) -> None:
    """GPipe and 1F1B orders as BubbleMeter records them (pp=2, 3 micro-batches): one box per action; an order
    that cannot run is refused rather than drawn."""
    gpipe = [[[rank, "F", m] for m in range(3)] + [[rank, "B", m] for m in range(3)] for rank in range(2)]
    one_f_one_b = [[[0, "F", 0], [0, "F", 1], [0, "B", 0], [0, "F", 2], [0, "B", 1], [0, "B", 2]],
                   [[1, "F", 0], [1, "B", 0], [1, "F", 1], [1, "B", 1], [1, "F", 2], [1, "B", 2]]]
    runs = [{"pp": 2, "schedule": name, "n_stages": 2, "actions": actions}
            for name, actions in (("gpipe", gpipe), ("1f1b", one_f_one_b))]
    plot = _docs_script("plot_schedules")
    assert plot.draw_schedules(runs, tmp_path / "schedules.png") == 24
    assert (tmp_path / "schedules.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    backwards_first = [[[0, "B", 0], [0, "F", 0]], [[1, "F", 0], [1, "B", 0]]]
    with pytest.raises(ValueError, match="deadlock"):
        plot.draw_schedules([{"pp": 2, "schedule": "broken", "n_stages": 2, "actions": backwards_first}],
                            tmp_path / "broken.png")
