"""Fault-tolerant HSDP across replica groups (``ZeroStrategy(fault_tolerance=...)``, torchft), on CPU with gloo.

Every run is real: a ``torchft_lighthouse`` process, and each replica group its own ``torchrun`` of 2 ranks of
``ft_run.py`` (a fresh rendezvous per group, restarts by torchrun). Wall-clock figures are recorded (printed with
``-s``), never asserted; deadlines are only hang guards.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from harness import free_port
from installed import LIGHTHOUSE, TORCHRUN, require_lighthouse

from lightning_par import ZeroStrategy
from lightning_par.checkpoint.format import checkpoint_problem

require_lighthouse()  # torchft-nightly and its lighthouse: the test extra installs them

SCRIPT = Path(__file__).with_name("ft_run.py")
ROOT = Path(__file__).parents[1]
GROUPS = 2


OPTION = {"replica_groups": 2, "min_replicas": 1, "lighthouse": "http://localhost:29510", "replica_group_id": 0}


@pytest.mark.parametrize(("arguments", "option", "message"), [
    ({"zero_stage": 2}, {}, "needs zero_stage=3"),
    ({"replicate_size": 2, "data_parallel_size": 4}, {}, "replicate_size=2"),
    ({}, {"replica_group_id": 2}, r"replica_group_id=2: must be in \[0, 2\)"),
    ({}, {"replica_group_id": -1}, r"replica_group_id=-1"),
    ({}, {"min_replicas": 3}, r"min_replicas=3: must be an integer in \[1, 2\]"),
    ({}, {"lighthouse": None}, "TORCHFT_LIGHTHOUSE is empty"),
    ({}, {"replica_group_id": None}, "REPLICA_GROUP_ID is empty"),
    ({}, {"replica_groups": 0}, "replica_groups=0"),
    ({}, {"lighthous": "x"}, "unknown keys"),
    ({}, {"spares": True, "min_replicas": 2}, r"spares=True with min_replicas=2 and replica_groups=2: spares are"),
])
def test_refused_before_any_process_group(arguments: dict, option: dict, message: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What fault tolerance cannot be combined with is a ValueError from the constructor, naming the value."""
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**arguments, fault_tolerance={**OPTION, **option})


def test_environment_fills_lighthouse_and_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:1")
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    resolved = ZeroStrategy(fault_tolerance={"replica_groups": 2})._fault_tolerance
    assert (resolved.lighthouse, resolved.replica_group_id, resolved.min_replicas) == ("http://lighthouse:1", 1, 1)


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra)
    return env


@contextmanager
def lighthouse(min_replicas: int):
    """A torchft lighthouse on a free port; yields (process, address)."""
    port = free_port()
    process = subprocess.Popen([*LIGHTHOUSE, "--min_replicas", str(min_replicas), "--bind",
                                f"[::]:{port}", "--quorum_tick_ms", "50", "--join_timeout_ms", "1000",
                                "--heartbeat_timeout_ms", "1000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield process, f"http://localhost:{port}"
    finally:
        process.kill()
        process.wait()


def torchrun(out: Path, ranks: int, *args: str, group: int = 0, restarts: int = 1, **env: str) -> subprocess.Popen:
    log = open(out / f"torchrun_{'ref' if '--reference' in args else group}.log", "w")
    command = [*TORCHRUN, "--nnodes", "1", "--nproc_per_node", str(ranks), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"rg{group}", "--max-restarts",
               str(restarts), str(SCRIPT), "--out", str(out), *args]
    return subprocess.Popen(command, env=_env(REPLICA_GROUP_ID=str(group), **env), stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)


def finish(processes: list[subprocess.Popen], deadline: float) -> list[int]:
    """Exit codes, or an AssertionError (after killing them) when they outlive ``deadline`` (a hang guard)."""
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise AssertionError(f"{process.args} still running at the deadline") from None
    return codes


def run_groups(out: Path, min_replicas: int, *args: str, wait: float = 150.0, restarts: int = 1,
               ranks: int = 2, quorum_of: int | None = None) -> list[int]:
    """Both groups through one lighthouse; a quorum forms with ``quorum_of`` groups (by default ``min_replicas``)."""
    with lighthouse(quorum_of or min_replicas) as (_, address):
        groups = [torchrun(out, ranks, "--min-replicas", str(min_replicas), *args, group=g, restarts=restarts,
                           TORCHFT_LIGHTHOUSE=address) for g in range(GROUPS)]
        return finish(groups, time.monotonic() + wait)


def result(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=False)


def logs(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(out.glob("torchrun_*.log")))


def test_parity_with_hsdp(tmp_path: Path) -> None:
    """2 groups x 2 ranks through torchft, no failure, equal to plain HSDP (replicate_size=2) on 4 ranks: the same
    losses per step on every rank and the same final shards and optimizer states. Both groups' ModelCheckpoint
    saves into one directory; one group writes each checkpoint, whole."""
    start = time.monotonic()
    checkpoints = tmp_path / "checkpoints"
    assert run_groups(tmp_path, GROUPS, "--steps", "20", "--checkpoints", str(checkpoints), wait=120.0) == [0, 0], \
        logs(tmp_path)[-4000:]
    groups_seconds = time.monotonic() - start
    reference = torchrun(tmp_path, 4, "--reference", "--steps", "20")
    assert finish([reference], time.monotonic() + 120.0) == [0], logs(tmp_path)[-4000:]
    worst = {"loss": 0.0, "weights": 0.0, "optimizer": 0.0}
    for group in range(GROUPS):
        for rank in range(2):
            mine, theirs = result(tmp_path, f"g{group}_r{rank}_a0"), result(tmp_path, f"ref_r{2 * group + rank}_a0")
            assert [s["global_step"] for s in mine["steps"]] == list(range(1, 21))
            assert {s["participants"] for s in mine["steps"]} == {GROUPS}
            assert mine["global_step"] == theirs["global_step"] == 20
            losses = [abs(a["loss"] - b["loss"]) for a, b in zip(mine["steps"], theirs["steps"], strict=True)]
            worst["loss"] = max(worst["loss"], *losses)
            for name, value in theirs["weights"].items():
                worst["weights"] = max(worst["weights"], (mine["weights"][name] - value).abs().max().item())
            for key, state in theirs["optimizer"].items():
                for name, value in state.items():
                    difference = (mine["optimizer"][key][name].double() - value.double()).abs().max().item()
                    worst["optimizer"] = max(worst["optimizer"], difference)
    print(f"\nparity: groups {groups_seconds:.1f} s, reference {time.monotonic() - start - groups_seconds:.1f} s, "
          f"max differences {worst}")
    assert max(worst.values()) <= 1e-5, worst
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"]
    assert all(checkpoint_problem(path) is None for path in checkpoints.iterdir())


def _check_rejoined(out: Path, restarted_attempt: int) -> dict:
    """Group 0 trained on without stopping; group 1's last attempt healed and ended equal to group 0, bit for bit."""
    figures = {}
    for rank in range(2):
        healthy, restarted = result(out, f"g0_r{rank}_a0"), result(out, f"g1_r{rank}_a{restarted_attempt}")
        steps = [s["global_step"] for s in healthy["steps"]]
        assert steps == list(range(steps[0], healthy["global_step"] + 1)), steps  # every step, none repeated
        assert any(s["participants"] == 1 for s in healthy["steps"]), "group 0 never trained alone"
        assert healthy["steps"][-1]["participants"] == GROUPS
        assert restarted["global_step"] == healthy["global_step"]
        assert restarted["steps"][-1]["torchft_step"] == healthy["steps"][-1]["torchft_step"]
        for name, value in healthy["weights"].items():
            assert torch.equal(restarted["weights"][name], value), name
        for key, state in healthy["optimizer"].items():
            for name, value in state.items():
                assert torch.equal(restarted["optimizer"][key][name], value), (key, name)
        assert restarted["param_groups"] == healthy["param_groups"]
        seconds = [s["seconds"] for s in healthy["steps"]]
        figures[rank] = {"steps": len(steps), "rejoined_at_global_step": restarted["steps"][0]["global_step"],
                         "median_step_s": round(statistics.median(seconds), 3),
                         "longest_step_s": round(max(seconds), 3),
                         "recovered_after_s": round(restarted["steps"][0]["time"] - float((out / "fault").read_text()),
                                                    1)}
    return figures


def test_group_killed_then_killed_again_while_healing(tmp_path: Path) -> None:
    """Group 1's rank 0 dies at step 5; torchrun restarts group 1, whose rank 0 dies again after the healing quorum,
    before its first step (group 0 waits for it in that step's all-reduce, then goes on alone); the third attempt
    heals from group 0 and trains on with it. Group 0 never stops: it takes every step once, and its longest step
    stays under the fault timeout (torchft's 30 s here) and a bound (a hang guard, not a timing)."""
    start = time.monotonic()
    codes = run_groups(tmp_path, 1, "--steps", "200", "--until", "12", "--fail-at", "5", "--step-sleep", "1.0",
                       "--fail-in-recovery", restarts=2)
    assert codes == [0, 0], logs(tmp_path)[-4000:]
    assert not (tmp_path / "g1_r0_a0.pt").exists() and not (tmp_path / "g1_r0_a1.pt").exists()  # both attempts died
    assert (tmp_path / "fault_in_recovery").exists()
    figures = _check_rejoined(tmp_path, restarted_attempt=2)
    assert all(figure["longest_step_s"] < 30 + 30 for figure in figures.values()), figures
    print(f"\nkilled, killed again while healing: {time.monotonic() - start:.1f} s, {figures}")


def test_spares_keep_the_global_batch(tmp_path: Path) -> None:
    """``spares: true`` with min_replicas 1 of 2 groups (one rank each), both in every quorum (the lighthouse waits
    for 2): every step averages one group's gradient (the other trains along as a spare, contributing nothing), and
    both leave every step with the same weights and optimizer states, although they read different samples."""
    codes = run_groups(tmp_path, 1, "--steps", "8", "--spares", ranks=1, quorum_of=2, wait=120.0)
    assert codes == [0, 0], logs(tmp_path)[-4000:]
    first, spare = result(tmp_path, "g0_r0_a0"), result(tmp_path, "g1_r0_a0")
    assert first["global_step"] == spare["global_step"] == 8
    assert all(s["participants"] == 1 for s in first["steps"] + spare["steps"])
    assert [s["loss"] for s in first["steps"]] != [s["loss"] for s in spare["steps"]]  # their own samples
    for name, value in first["weights"].items():
        assert torch.equal(spare["weights"][name], value), name
    for key, state in first["optimizer"].items():
        for name, value in state.items():
            assert torch.equal(spare["optimizer"][key][name], value), (key, name)


def test_lighthouse_lost(tmp_path: Path) -> None:
    """Without the lighthouse no quorum forms: every group fails at its next step, with an error naming the lighthouse,
    instead of hanging (torchft has no fallback: the lighthouse is a single point of failure). The groups' manager
    servers retry the lighthouse until the quorum timeout: 10 s here (torchft's TORCHFT_QUORUM_TIMEOUT_SEC)."""
    start = time.monotonic()
    with lighthouse(GROUPS) as (process, address):
        groups = [torchrun(tmp_path, 2, "--min-replicas", str(GROUPS), "--steps", "200", "--step-sleep", "0.3",
                           group=g, restarts=0, TORCHFT_LIGHTHOUSE=address, TORCHFT_QUORUM_TIMEOUT_SEC="10")
                  for g in range(GROUPS)]
        deadline = time.monotonic() + 90.0
        while not all(_step(tmp_path, g) >= 3 for g in range(GROUPS)):
            assert time.monotonic() < deadline and all(g.poll() is None for g in groups), logs(tmp_path)[-4000:]
            time.sleep(0.2)
        process.kill()
        killed = time.monotonic()
        codes = finish(groups, killed + 120.0)
    print(f"\nlighthouse lost: groups exited {time.monotonic() - killed:.1f} s after it "
          f"({time.monotonic() - start:.1f} s in all), codes {codes}")
    assert all(code != 0 for code in codes), codes
    assert "lightning_par: the torchft quorum failed; is the lighthouse" in logs(tmp_path)


def _step(out: Path, group: int) -> int:
    path = out / f"step_g{group}_r0"
    try:
        return int(path.read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s", "-v"]))
