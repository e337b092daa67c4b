"""benchmarks/gpu/validate.py, the one-GPU validation script, in its CPU smoke mode: every phase runs (tiny model,
gloo, 2 timed steps, each phase in a process of its own) and leaves finite figures in the JSON, so the script a GPU
machine runs once has had its logic exercised here. About 15-20 s on 2 cores; the limit below only catches a hang."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from installed import PYTHON

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "validate.py"
# Phases that must run on a CPU; the others need CUDA (float8, Lightning's FSDPStrategy) and say so.
RUN_ON_CPU = ("device", "plain", "plain_compile", "lightning", "lightning_compile", "lp_data_parallel", "lp_zero3",
              "lp_hybrid3d", "bubble", "lp_data_parallel_compile", "lp_zero3_compile", "lp_data_parallel_float8")
CUDA_ONLY = ("plain_float8", "lightning_fsdp")
RUN_FIGURES = ("tokens_per_s", "tokens_per_s_median_step", "mfu", "peak_bytes", "predicted_bytes", "memory_ratio",
               "flops_per_token", "peak_flops", "loss_last")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.timeout(300)
def test_smoke_mode_runs_every_phase_with_finite_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu_results.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "OUT")}
    # The script must run from the repository root without an installed package: no PYTHONPATH given.
    env.pop("PYTHONPATH", None)
    completed = subprocess.run([PYTHON, str(SCRIPT), "--smoke", "--out", str(out)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=280, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    print(completed.stdout)
    payload = json.loads(out.read_text())
    phases = payload["phases"]
    assert set(phases) == {*RUN_ON_CPU, *CUDA_ONLY}, sorted(phases)
    failed = {name: phases[name] for name in RUN_ON_CPU if phases[name]["status"] != "ok"}
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    for name in CUDA_ONLY:
        assert phases[name]["status"] == "skipped" and phases[name]["reason"], phases[name]

    assert payload["config"]["parameters"] == phases["device"]["parameters"] > 0
    for key in ("peak_flops", "measured_bf16_matmul_flops", "flops_per_token"):
        assert _finite(phases["device"][key]) and phases["device"][key] > 0, key
    for name in RUN_ON_CPU:
        if name in ("device", "bubble"):
            continue
        result = phases[name]
        for key in RUN_FIGURES:
            assert _finite(result[key]) and result[key] > 0, (name, key, result.get(key))
        assert len(result["step_times_s"]) == payload["config"]["steps"] == 2
        assert all(_finite(t) and t > 0 for t in result["step_times_s"]), (name, result["step_times_s"])
        assert result["predicted"]["bytes"]["total"] == result["predicted_bytes"]
        if name.startswith(("lightning", "lp_")):  # lightning-par's ThroughputMonitor ran alongside
            assert _finite(result["monitor"]["tokens_per_s"]) and _finite(result["monitor"]["mfu"]), name
    for name in ("lp_data_parallel", "lp_zero3", "lp_hybrid3d"):
        assert phases[name]["process_group_backend"] == "gloo" and phases[name]["world_size"] == 1, name
    assert phases["lp_zero3"]["predicted"]["zero_stage"] == 3

    bubble = phases["bubble"]
    assert bubble["sane"], bubble
    for check in ("pipeline", "direct"):
        for key in ("bubble_fraction", "busy_s", "step_s", "busy_over_step"):
            assert _finite(bubble[check][key]), (check, key, bubble[check])
        assert 0 <= bubble[check]["bubble_fraction"] < 1 and bubble[check]["busy_s"] > 0
    assert bubble["pipeline"]["actions"] == bubble["pipeline"]["expected_actions"]
    assert bubble["pipeline"]["simulated_bubble"] == 0  # one rank: the schedule itself leaves no bubble

    assert "plain PyTorch" in payload["summary"] and "lightning-par zero3 (FSDP2) + compile" in payload["summary"]
