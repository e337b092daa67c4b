"""A mistake on the lightning-par command line is said in one line that leads with it.

Each bad input below is given to the command as a user would; the first line of stderr must name the key or flag,
the value and what would fit, with no jsonargparse union report and no advice to unpickle an untrusted file (the
traceback comes with --verbose). A run that fails after its processes started says it once, in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from installed import PYTHON

REPO = Path(__file__).resolve().parents[1]
TP = "--trainer.strategy.init_args.tensor_parallel_size"
PP = "--trainer.strategy.init_args.pipeline_parallel_size"
SCHEDULE = "--trainer.strategy.init_args.pipeline_schedule"

# (config, extra arguments, what the first line must say; "..." stands for words left out)
BAD_INPUTS = {
    "size -2": ("tensor_parallel", [f"{TP}=-2"], "tensor_parallel_size must be a positive integer, got -2"),
    "size 0": ("tensor_parallel", [f"{TP}=0"], "tensor_parallel_size must be a positive integer, got 0"),
    "size two": ("tensor_parallel", [f"{TP}=two"], f"{TP[2:]}=two: expected an integer"),
    "size 2.5": ("tensor_parallel", [f"{TP}=2.5"], f"{TP[2:]}=2.5: expected an integer"),
    "zero_stage 5": ("zero3", ["--trainer.strategy.init_args.zero_stage=5"], "zero_stage=5 is not one of (0, 1, 2, 3)"),
    "offload without ZeRO-3": ("hybrid3d", ["--trainer.strategy.init_args.zero_stage=1",
                                            "--trainer.strategy.init_args.cpu_offload=true"],
                               "cpu_offload=True needs zero_stage=3"),
    "schedule 1fb1": ("pipeline_parallel", [f"{SCHEDULE}=1fb1"], f"{SCHEDULE}=1fb1: not one of 'gpipe', '1f1b', "
                      "...; did you mean '1f1b'?"),  # the rest of layout.schedules.SCHEDULES at the ...
    "schedule GPipe": ("pipeline_parallel", [f"{SCHEDULE}=GPipe"], "did you mean 'gpipe'?"),
    "argument typo": ("tensor_parallel", ["--trainer.strategy.init_args.tensor_paralel_size=2"],
                      "--trainer.strategy.init_args.tensor_paralel_size: TensorParallelStrategy has no argument "
                      "'tensor_paralel_size'; did you mean 'tensor_parallel_size'?"),
    "model argument typo": ("data_parallel", ["--model.init_args.dimm=64"],
                            "--model.init_args.dimm: LlamaLM has no argument 'dimm'; did you mean 'dim'?"),
    "option typo": ("data_parallel", ["--trainer.max_stepz=3"],
                    "--trainer.max_stepz=3: no such option; did you mean '--trainer.max_steps'?"),
    "strategy name": ("data_parallel", ["--trainer.strategy=hybrid3"], "did you mean 'hybrid3d'?"),
    "negative learning rate": ("data_parallel", ["--model.init_args.learning_rate=-0.1"],
                               "learning_rate=-0.1 must be a positive number"),
    "betas out of range": ("data_parallel", ["--model.init_args.betas=[0.9,1.5]"],
                           "betas=[0.9, 1.5] must be two numbers in [0, 1)"),
    "garbage checkpoint": ("data_parallel", ["--ckpt_path=garbage.ckpt"], "'garbage.ckpt' is not a checkpoint"),
    "truncated checkpoint": ("data_parallel", ["--ckpt_path=truncated.ckpt"],
                             "checkpoint 'truncated.ckpt' is truncated or corrupt"),
    "missing checkpoint": ("data_parallel", ["--ckpt_path=missing.ckpt"], "checkpoint 'missing.ckpt' does not exist"),
    "pickled checkpoint": ("data_parallel", ["--ckpt_path=pickled.ckpt"],
                           "checkpoint 'pickled.ckpt' holds decimal.Decimal, which unpickling would have to "
                           "construct"),
}


def _bad_checkpoints(directory: Path) -> None:
    import decimal

    import torch

    (directory / "garbage.ckpt").write_bytes(b"garbage\n")
    torch.save({"state_dict": {}, "hyper_parameters": {"x": decimal.Decimal("1.5")}}, directory / "pickled.ckpt")
    whole = (directory / "pickled.ckpt").read_bytes()
    (directory / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])


def _says(line: str, expected: str) -> bool:
    """Whether ``line`` holds the parts of ``expected`` between its "..." in order."""
    position = 0
    for part in expected.split("..."):
        found = line.find(part, position)
        if found < 0:
            return False
        position = found + len(part)
    return True


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_bad_input_is_said_in_its_first_line(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    from lightning_par.cli.main import main

    config, arguments, expected = BAD_INPUTS[case]
    _bad_checkpoints(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_PAR_VERBOSE", raising=False)
    monkeypatch.setattr("sys.argv", ["lightning-par"])
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(REPO / "configs" / f"{config}.yaml"), *arguments])
    assert exit_.value.code in (1, 2)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("lightning-par: error: ") and _says(lines[0], expected), lines
    assert len(lines) == 2 and "--verbose" in lines[1], lines
    assert "Union subtypes" not in lines[0] and "weights_only` set to `False`" not in lines[0]


def _command(*arguments: str, cwd: Path, python: str = PYTHON, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO / "tests"), **env}
    environment.pop("LIGHTNING_PAR_VERBOSE", None)
    environment.update(env)
    return subprocess.run([python, "-m", "lightning_par.cli", *arguments], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=environment)


def test_the_command_says_the_mistake_first_and_the_traceback_only_when_asked(tmp_path: Path) -> None:
    config = ["fit", "--config", str(REPO / "configs" / "tensor_parallel.yaml"), f"{TP}=-2"]
    quiet = _command(*config, cwd=tmp_path, python=sys.executable)  # cold: everything it prints from its start
    assert quiet.returncode == 1
    assert quiet.stderr.splitlines()[0] == ("lightning-par: error: tensor_parallel_size must be a positive integer, "
                                            "got -2"), quiet.stderr
    assert "Traceback" not in quiet.stderr
    for verbose in (_command(*config, "--verbose", cwd=tmp_path), _command(*config, cwd=tmp_path,
                                                                            LIGHTNING_PAR_VERBOSE="1")):
        assert verbose.returncode == 1 and "Traceback (most recent call last)" in verbose.stderr


def test_a_failure_after_start_up_on_4_ranks_is_said_once_in_one_line(tmp_path: Path) -> None:
    """A model without the pipeline's methods, found by every one of 4 ranks after the process group started: the
    first rank to fail says it in one line (which names the missing methods), no rank prints a traceback or a line of
    its own; with --verbose the first prints its traceback and every other rank one line."""
    arguments = ["fit", "--config", str(REPO / "configs" / "pipeline_parallel.yaml"), "--trainer.devices=4",
                 f"{PP}=4", "--trainer.strategy.init_args.microbatches=4", "--model.init_args.n_layers=4",
                 "--model.class_path=cli_callbacks.LlamaWithoutPipelineContract", "--trainer.logger=false",
                 "--trainer.enable_checkpointing=false"]
    result = _command(*arguments, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    # Lightning's notes went to stdout: the mistake is stderr's first line, but for Lightning's hint to use srun
    # where SLURM is installed (allowed in tests/test_cli.py).
    first = next(line for line in result.stderr.splitlines() if "prepend your python command with `srun`" not in line)
    assert first.startswith("lightning-par: error: "), result.stderr[-3000:]
    assert "GPU available:" in result.stdout, result.stdout[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("lightning-par: ")]
    assert len(said) == 2 and said[1].startswith("lightning-par: (run again with --verbose"), result.stderr[-6000:]
    assert said[0].startswith("lightning-par: error: ") and \
        "needs LlamaWithoutPipelineContract to define split_batch() and loss_fn()" in said[0], said
    assert "Traceback" not in result.stderr, result.stderr[-6000:]
    verbose = _command(*arguments, "--verbose", cwd=tmp_path)
    assert verbose.returncode == 1 and verbose.stderr.count("Traceback (most recent call last)") == 1, \
        verbose.stderr[-6000:]
    # the other ranks' lines follow as they get to print them (Lightning ends every rank once one has exited)
    summaries = [line for line in verbose.stderr.splitlines() if line.startswith("lightning-par: rank ")]
    assert summaries and all("failed in set-up with TypeError" in line for line in summaries), summaries


# Mistakes found only once the ranks have started (config, extra arguments, what the first line must say).
FOUND_AFTER_START = {
    "heads not divisible by tp": ("tensor_parallel", ["--model.init_args.n_heads=3", "--model.init_args.n_kv_heads=3",
                                                      "--model.init_args.dim=96"],
                                  "tensor_parallel_size=2 does not divide the 3 heads of "
                                  "'model.layers.0.attention.q_proj'; ...: [1, 3]"),
    "microbatches larger than the batch": ("pipeline_parallel", ["--trainer.strategy.init_args.microbatches=16"],
                                           "a batch of 8 samples does not split into microbatches=16"),
    "shard directory not prepared": ("pretrain_streaming", ["--data.init_args.data_dir=empty",
                                                            "--data.init_args.prepare_from=null"],
                                     "'empty' holds no prepared data (no prepared.json): prepare it with"),
    "sequence length context parallel cannot cut": ("context_parallel", ["--data.init_args.seq_len=66",
                                                                         "--model.init_args.max_seq_len=66"],
                                                    "sequence length 66 is not divisible by 4 ...; nearest lengths "
                                                    "that fit: [64, 68]"),
}


def test_mistakes_found_after_start_up_are_said_in_the_first_line(tmp_path: Path) -> None:
    """Each command of FOUND_AFTER_START, all started at once: stderr's first line (but for Lightning's srun hint) is
    the mistake, said once, then how to see the traceback."""
    (tmp_path / "empty").mkdir()
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("LIGHTNING_PAR_VERBOSE", None)
    commands = {case: subprocess.Popen(
        [PYTHON, "-m", "lightning_par.cli", "fit", "--config", str(REPO / "configs" / f"{config}.yaml"),
         *arguments, "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_checkpointing=false"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment)
        for case, (config, arguments, _) in FOUND_AFTER_START.items()}
    for case, command in commands.items():
        stderr = command.communicate(timeout=300)[1]
        lines = [line for line in stderr.splitlines() if "prepend your python command with `srun`" not in line]
        assert command.returncode == 1 and _says(lines[0], "lightning-par: error: " + FOUND_AFTER_START[case][2]), \
            (case, stderr[-3000:])
        assert lines[1].startswith("lightning-par: (run again with --verbose"), (case, stderr[-3000:])
        assert sum(line.startswith("lightning-par: error:") for line in lines) == 1, (case, stderr[-3000:])


def test_notes_go_to_stdout_once_however_often_the_command_runs(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Lightning's notes on stdout and its warnings on stderr, each said once after the command ran twice in one
    process (Lightning's launcher runs it again in each rank it starts; tests and notebooks call it in turn)."""
    import logging

    from lightning_par.cli.main import _notes_to_stdout

    logger = logging.getLogger("lightning.pytorch")
    monkeypatch.setattr(logger, "handlers", [logging.StreamHandler(sys.stderr)])
    _notes_to_stdout()
    _notes_to_stdout()
    logger.info("GPU available: False")
    logger.warning("a warning")
    printed = capsys.readouterr()
    assert printed.out == "GPU available: False\n" and printed.err == "a warning\n", printed


def test_docs_errors_lists_every_bad_input() -> None:
    listed = (REPO / "docs" / "errors.md").read_text()
    assert [case for case, (_, _, expected) in BAD_INPUTS.items() if expected not in listed] == []
