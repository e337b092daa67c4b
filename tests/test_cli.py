"""The lightning-par command trains the shipped config and writes TensorBoard scalars."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from installed import PYTHON

REPO = Path(__file__).resolve().parents[1]


# Every shipped config trains here, as it is (tests/test_slurm.py also trains hybrid3d as a two-node SLURM job;
# tests/test_docs.py the fine-tuning configs, as the README runs them, on the model directory it makes first).
# The fine-tune configs read a model directory (tests/test_hf_finetune.py), the `_s3` ones write to an object store
# (tests/test_object_store.py runs them against an S3 server).
CONFIGS = sorted(path.stem for path in (REPO / "configs").glob("*.yaml")
                 if not path.stem.startswith("finetune_") and not path.stem.endswith("_s3"))
# The shipped config as it is, shortened: few steps, a small slice of the corpus (the streaming config prepares the
# whole corpus once, in seconds, and streams it).
SHORTENED = ["--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
             "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false"]
SMALL_CORPUS = ["--data.init_args.max_bytes=300000"]


def _shortened(name: str) -> list[str]:
    return SHORTENED + ([] if name.startswith("pretrain_streaming") else SMALL_CORPUS)


# The one process sums each batch's gradient in another order than the ranks do; a quantised moment then rounds a
# last-bit difference to another level (docs/optimizers.md): 3.7e-5 in the weights after the 6 steps.
VERIFY_TOLERANCE = {"adamw_8bit": 1e-4}


def _devices(name: str) -> int:
    return _config(name)["trainer"]["devices"]


def _config(name: str) -> dict:
    import yaml

    return yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())


# Warnings a correct run may print, each with why it is left: (category, words of the message).
ALLOWED_WARNINGS: list[tuple[str, str]] = [
    # Lightning's, where a `srun` command exists (this machine has one): a user on a SLURM login node who meant to
    # run under SLURM needs it, and on a machine without SLURM it is not said.
    ("PossibleUserWarning", "The `srun` command is available on your system but is not used"),
]


def _run_configs(rank: int, world_size: int, names: list[str],
                 root: str) -> dict[str, tuple[str | None, list[str]]]:
    """Each config in turn through the command's entry point (``lightning-par fit``), on these ranks, each in a
    directory of its own, recording what it trained for ``lightning-par verify``'s comparison in ``record/``: None for
    a run that ended well, else what it raised; and the warnings it gave (as the process's filters show them, the
    first time at each place in the code)."""
    import traceback
    import warnings

    from lightning_par.cli.main import main
    from lightning_par.cli.verify import record_callback

    sys.argv = ["lightning-par"]  # as the command runs: LightningCLI warns of arguments given twice otherwise
    outcomes: dict[str, tuple[str | None, list[str]]] = {}
    for name in names:
        directory = Path(root, name)
        directory.mkdir(parents=True, exist_ok=True)
        os.chdir(directory)
        with warnings.catch_warnings(record=True) as caught:
            try:
                main(["fit", "--config", str(REPO / "configs" / f"{name}.yaml"), *_shortened(name),
                      record_callback(directory / "record", append=True)])
                error = None
            except BaseException:  # noqa: BLE001 - SystemExit too: the command's way to fail
                error = traceback.format_exc()
        outcomes[name] = (error, [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught])
    return outcomes


@pytest.fixture(scope="module")
def shipped_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str | None], dict[str, set[str]]]:
    """Every shipped config trained once, the configs of one process count in one launch: the ranks start once, the
    runs follow each other on them (Lightning sees ranks launched outside it, as under torchrun or SLURM; the
    command's own launcher is run as written by tests/test_docs.py and by the test of a user's module below)."""
    from harness import run_distributed

    root = tmp_path_factory.mktemp("shipped")
    outcomes: dict[str, str | None] = {}
    warned: dict[str, set[str]] = {}
    for devices in sorted({_devices(name) for name in CONFIGS}):
        names = [name for name in CONFIGS if _devices(name) == devices]
        per_rank = run_distributed(_run_configs, devices, names, str(root), timeout=300 * len(names))
        for name in names:
            failures = [f"--- rank {r} ---\n{o[name][0]}" for r, o in enumerate(per_rank) if o[name][0] is not None]
            outcomes[name] = "\n".join(failures) or None
            warned[name] = {warning for o in per_rank for warning in o[name][1]}
    return root, outcomes, warned


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_trains_and_logs_to_tensorboard(shipped_runs: tuple[Path, dict[str, str | None]],
                                                       name: str) -> None:
    root, outcomes, _ = shipped_runs
    assert outcomes[name] is None, outcomes[name][-8000:]
    (run_dir,) = (root / name / "lightning_logs" / name).iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train_loss", "val_loss"} <= set(scalars), scalars
    train_loss = [event.value for event in events.Scalars("train_loss")]
    assert len(train_loss) == 6
    assert all(0.0 < value < 10.0 for value in train_loss)  # byte vocabulary: ln(256) = 5.5 at the start
    assert (run_dir / "checkpoints" / "epoch=0-step=6.ckpt" / "meta.pt").is_file()
    _assert_monitoring(name, events)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_shipped_configs_run_gives_no_warning(shipped_runs: tuple[Path, dict[str, str | None], dict[str, set[str]]],
                                                name: str) -> None:
    """A correct run says nothing a user would have to look into: every warning any rank gave is one of
    ALLOWED_WARNINGS, each left for the reason written beside it."""
    _, outcomes, warned = shipped_runs
    assert outcomes[name] is None, outcomes[name][-8000:]
    unexpected = sorted(warning for warning in warned[name]
                        if not any(warning.startswith(category) and words in warning
                                   for category, words in ALLOWED_WARNINGS))
    assert not unexpected, "\n".join(unexpected)


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_trains_what_one_process_trains(shipped_runs: tuple[Path, dict[str, str | None]], name: str,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``lightning-par verify``'s comparison of the run above: one process draws the global batches from the config's
    data module (at world size 1, dealt to the run's data-parallel replicas) and trains them with the config's model,
    optimizer and schedule; the 6 steps' samples, losses, gradient norms and weights agree within 1e-5 (quantised
    optimizer moments: VERIFY_TOLERANCE; the fine-tuning configs are verified in tests/test_verify.py)."""
    from lightning_par.cli.verify import compare, format_comparison, read_layout_run, reference_run

    root, outcomes, _ = shipped_runs
    assert outcomes[name] is None, outcomes[name][-8000:]
    monkeypatch.chdir(root / name)  # where the run found its data (the streaming config's prepared shards)
    layout = read_layout_run(root / name / "record")
    cli_args = ["--config", str(REPO / "configs" / f"{name}.yaml"), *_shortened(name)]
    steps, seed = len(layout.gradient_norms), _config(name)["seed_everything"]
    reference = reference_run(cli_args, seed, steps, layout.replicas, tmp_path)
    comparison = compare(layout, reference, VERIFY_TOLERANCE.get(name, 1e-5))
    print(f"{name}: {comparison.reason}")
    assert len(layout.gradient_norms) == 6 and comparison.passed, format_comparison(comparison, name)


def _assert_monitoring(name: str, events: EventAccumulator) -> None:
    """The monitor the command adds by default: every scalar there, every step, with plausible values."""
    def values(tag: str) -> list[float]:
        return [event.value for event in events.Scalars(tag)]

    scalars = set(events.Tags()["scalars"])
    expected = {"perf/tokens_per_sec", "perf/samples_per_sec", "perf/tokens_per_sec_per_device",
                "perf/samples_per_sec_per_device", "perf/tflops_per_device", "perf/mfu", "memory/peak_gib_max",
                "memory/peak_gib_mean", "memory/peak_gib_rank0", "train/grad_norm"}
    assert expected <= scalars, expected - scalars
    assert any(tag.startswith("comm/") and tag.endswith("_bytes") for tag in scalars), scalars
    assert all(len(values(tag)) == 6 for tag in expected)
    assert all(0.0 < mfu < 1.0 for mfu in values("perf/mfu"))
    assert all(0.05 < gib < 8.0 for gib in values("memory/peak_gib_max"))
    assert all(0.0 < norm < 100.0 for norm in values("train/grad_norm"))
    for samples, tokens in zip(values("perf/samples_per_sec"), values("perf/tokens_per_sec")):
        assert tokens == pytest.approx(samples * 128, rel=1e-5)  # sequences of 128 tokens
    assert "layout/text_summary" in events.Tags()["tensors"]
    if name == "data_parallel":
        # DDP all-reduces every fp32 gradient once a step; the rest is the loss's metric all-reduce.
        gradient_bytes = 4 * 803_968
        assert gradient_bytes <= values("comm/dp_bytes")[0] <= gradient_bytes + 64
    if name == "tensor_parallel":
        assert "comm/tp_bytes" in scalars and min(values("comm/tp_bytes")) > 0
    if name == "pipeline_parallel":
        # Rank 0 (stage 0) sends each of 4 micro-batches' activations, (2, 128, 128) fp32, to stage 1; the rest
        # is scalars over the pipeline group (the loss broadcast back, the gradient norm's sum of squares). Every
        # step: the validation after step 3, and the weights that verify's record reads between steps, are not the
        # step's.
        activations = 4 * 2 * 128 * 128 * 4
        assert all(activations <= sent <= activations + 64 for sent in values("comm/pp_bytes"))
        # Measured on a shared machine: its value is load (tests/test_pipeline_parallel.py asserts the bubble
        # each schedule's order implies); here, that it is logged every step as a fraction.
        assert all(0.0 <= fraction <= 1.0 for fraction in values("pipeline/bubble_fraction_max"))


def test_a_users_own_module_trains_from_yaml(tmp_path: Path) -> None:
    """Any LightningModule, not only the reference model: a plain torch transformer of the user's, named by its
    class path, trains under a shipped config with the monitor on."""
    command = [
        PYTHON, "-m", "lightning_par.cli", "fit", "--config", str(REPO / "configs" / "data_parallel.yaml"),
        "--model", "cli_callbacks.TinyCausalTransformer", "--trainer.max_steps=4", "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
        "--data.init_args.max_bytes=100000",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO / "tests")}
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (run_dir,) = (tmp_path / "lightning_logs" / "data_parallel").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert len(events.Scalars("train_loss")) == 4
    assert {"perf/tokens_per_sec", "memory/peak_gib_max", "train/grad_norm"} <= set(events.Tags()["scalars"])


def test_console_script_is_installed() -> None:
    result = subprocess.run(["lightning-par", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fit" in result.stdout and "validate" in result.stdout


def test_a_misspelled_strategy_gets_the_closest_names() -> None:
    """Checked when the command has read the config, before anything is built (Lightning's own message lists only
    its own names)."""
    from lightning_par.cli.main import ParallelCLI

    with pytest.raises(ValueError, match=r"trainer.strategy='hybird3d' is not a strategy name: did you mean "
                                         r"'hybrid3d'\? lightning-par's strategies are auto_parallel, context_parallel, data_parallel"):
        ParallelCLI(args=["fit", "--config", str(REPO / "configs" / "data_parallel.yaml"), "--trainer.strategy",
                          "hybird3d"])


def test_two_node_torchrun_rendezvous(tmp_path: Path) -> None:
    """Two torchrun agents (two "nodes", one process each) meet through c10d rendezvous on localhost, as on
    two machines; Lightning's TorchElasticEnvironment is used as it is."""
    from harness import free_port

    from installed import TORCHRUN

    command = [
        *TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=lightning-par-test", "-m", "lightning_par.cli", "fit",
        "--config", str(REPO / "configs" / "data_parallel.yaml"), "--trainer.devices=1", "--trainer.num_nodes=2",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--data.init_args.max_bytes=100000", "--trainer.callbacks+=cli_callbacks.RecordEnvironment",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RECORD_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    agents = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env) for _ in range(2)]
    for agent in agents:
        stdout, stderr = agent.communicate(timeout=300)
        assert agent.returncode == 0, stdout[-3000:] + stderr[-5000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, record in enumerate(records):
        assert record == {"environment": "TorchElasticEnvironment", "world_size": 2, "global_rank": rank,
                          "node_rank": rank, "mesh": {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}}


@pytest.mark.parametrize("name", sorted(path.stem for path in (REPO / "configs").glob("*.yaml")))
def test_print_config_shows_every_strategy_argument(name: str) -> None:
    """LightningCLI sees each strategy's whole signature: ``--print_config`` of a shipped config lists every
    argument of its strategy, the shared ones that reach MeshStrategy through ``**kwargs`` included (the knobs'
    values come from config.py's aliases)."""
    import contextlib
    import importlib
    import inspect
    import io

    import yaml

    from lightning_par.cli.main import ParallelCLI

    with contextlib.redirect_stdout(io.StringIO()) as printed, pytest.raises(SystemExit):
        ParallelCLI(args=["fit", "--config", str(REPO / "configs" / f"{name}.yaml"), "--print_config"])
    from lightning_par.strategies import MeshStrategy

    strategy = yaml.safe_load(printed.getvalue())["trainer"]["strategy"]
    module, _, cls = strategy["class_path"].rpartition(".")
    expected = set()  # its own arguments, and the ones every strategy shares, declared once by MeshStrategy
    for init in (getattr(importlib.import_module(module), cls).__init__, MeshStrategy.__init__):
        expected |= {p for p, parameter in inspect.signature(init).parameters.items()
                     if p not in ("self", "parallel_config") and parameter.kind is not inspect.Parameter.VAR_KEYWORD}
    assert {"model_map", "save_distributed_checkpoint", "timeout"} <= expected
    assert expected <= set(strategy["init_args"]), expected - set(strategy["init_args"])


def test_fit_help_shows_every_argument_of_every_strategy() -> None:
    """``lightning-par fit --trainer.strategy.help <class>`` documents each strategy's own arguments and the shared
    ones it forwards to MeshStrategy, every one with its help text."""
    import contextlib
    import inspect
    import io

    from lightning_par.cli.main import ParallelCLI
    from lightning_par.strategies import STRATEGIES, MeshStrategy

    for strategy in STRATEGIES:
        with contextlib.redirect_stdout(io.StringIO()) as printed, pytest.raises(SystemExit):
            ParallelCLI(args=["fit", "--trainer.strategy.help", f"{strategy.__module__}.{strategy.__qualname__}"])
        shown = printed.getvalue()
        for init in (strategy.__init__, MeshStrategy.__init__):
            for name, parameter in inspect.signature(init).parameters.items():
                if name in ("self", "parallel_config") or parameter.kind is inspect.Parameter.VAR_KEYWORD:
                    continue
                entry = shown.split(f"  --trainer.strategy.{name} ", 1)
                assert len(entry) == 2, f"{strategy.__name__}: {name} is not in fit --help"
                described = entry[1].split("\n  --", 1)[0].split("(type:", 1)[0].split()[1:]  # after the metavar
                assert described, f"{strategy.__name__}: {name} has no help text"


def test_a_knob_value_outside_its_alias_is_refused_by_the_parser(capsys) -> None:
    from lightning_par.cli.main import ParallelCLI, main

    arguments = ["fit", "--config", str(REPO / "configs" / "hybrid3d.yaml"), "--print_config",
                 "--trainer.strategy.init_args.activation_checkpointing=sometimes"]
    with pytest.raises(SystemExit) as exit_:
        ParallelCLI(args=arguments)  # from Python: LightningCLI's own parser, its usage and exit
    assert exit_.value.code not in (0, None)
    assert "sometimes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(arguments)  # the command: one line
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "lightning-par: error: --trainer.strategy.init_args.activation_checkpointing=sometimes: not one of 'none', "
        "'full', 'selective', 'op'")
