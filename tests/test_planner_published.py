"""The planner held to published training runs: torchtitan's Llama 3.1 benchmarks, Megatron-LM's
PTD-P and ZeRO-3 runs (Narayanan et al. 2021, table 2) and Megatron-Core's Mixtral 8x7B.

Each run is costed with its own layout (``PublishedRun.candidate``: the published sizes, schedule and
micro-batches, never the planner's favourite) on a device preset of the hardware the figure came from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_par.planner import ClusterSpec, ModelSpec, TrainingSpec, format_table, plan_layouts
from lightning_par.planner import cluster as cluster_constants
from lightning_par.planner import time as time_constants
from lightning_par.planner.published import PUBLISHED_RUNS, PublishedRun, published_table, throughput_error

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.2  # every prediction within +-20% of the published figure


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=[run.name for run in PUBLISHED_RUNS])
def test_published_throughput_is_predicted_within_20_percent(run: PublishedRun) -> None:
    ratio = run.ratio()
    print(f"{run.name}: published {run.published:,.0f} {run.unit}, predicted {run.predicted():,.0f} ({ratio:.2f})")
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE


def test_held_out_rows_are_predicted_as_well_as_the_fitted_ones() -> None:
    """The rows no constant was fitted to: at least a third of the table, each within +-20%, their mean error within
    12% (0.104 today, against 0.070 on the rows the constants were read from). The constants a row names exist."""
    held_out = [run for run in PUBLISHED_RUNS if run.held_out]
    fitted = [run for run in PUBLISHED_RUNS if not run.held_out]
    error, fitted_error = throughput_error(held_out), throughput_error(fitted)
    print(f"held out: {error}; fitted: {fitted_error}")
    assert 3 * len(held_out) >= len(PUBLISHED_RUNS)
    assert error.largest <= TOLERANCE and error.mean <= 0.12
    for run in fitted:
        for name in run.fits:
            assert hasattr(cluster_constants, name) or hasattr(time_constants, name), (run.name, name)


def test_published_peak_memory_is_predicted_from_20_percent_under_to_45_percent_over() -> None:
    """Where the peak memory is published: from 0.8 to 1.45 of it, within 20% for the full-recomputation 405B
    runs. The planner under-estimates torchtitan's 1F1B 405B row (0.80). The memory model is
    this project's runtime, held to its dry run (tests/test_dry_run.py; at this 1F1B layout within 2%), and the
    published figures are torchtitan's: its 1F1B run holds 17 GiB more (ratio 0.80: float8 and async-TP buffers,
    the allocator's reserve), its 8B runs less (its selective "op" policy keeps every second matmul output)."""
    for run in PUBLISHED_RUNS:
        if run.memory_gib is None:
            continue
        ratio = run.predicted_memory_gib() / run.memory_gib
        assert 0.8 <= ratio <= 1.45, (run.name, ratio)
        if "405B" in run.name:
            assert ratio <= 1 + TOLERANCE, (run.name, ratio)


def test_the_published_set_covers_frameworks_layouts_and_an_moe_run() -> None:
    assert len(PUBLISHED_RUNS) >= 5
    assert len({run.source.split(",")[0] for run in PUBLISHED_RUNS}) >= 3
    assert any(run.model.is_moe for run in PUBLISHED_RUNS)
    assert any(run.config.pp > 1 and run.config.tp > 1 and run.config.zero_stage == 3 for run in PUBLISHED_RUNS)
    assert {run.config.pp_schedule for run in PUBLISHED_RUNS if run.config.pp > 1} >= {"1f1b", "interleaved_1f1b"}
    assert {run.device for run in PUBLISHED_RUNS} >= {"h100-96gb-500w", "a100-80gb", "h100-80gb"}


def test_docs_table_is_the_predictions() -> None:
    docs = (REPO / "docs" / "planner.md").read_text()
    for line in published_table().splitlines():
        assert line in docs, f"docs/planner.md is out of date; regenerate with published_table():\n{line}"


def test_405b_on_512_h100_pipelines_across_nodes() -> None:
    """Inter-node FSDP of Llama 3 405B over 128 ranks gathers its share of 405B
    parameters for every micro-batch at InfiniBand's bus bandwidth; a pipeline sends one micro-batch's hidden
    states per stage boundary and reduces gradients once. The first layout is a pipeline whose optimizer states are
    sharded over its data- (and context-) parallel ranks (ZeRO-1, Megatron's distributed optimizer: gradients reduced to their
    owners, half an all-reduce, then the owners' parameters broadcast) or ZeRO-3, under ZB-V; the best pipelined
    ZeRO-3 layout is within 3% of the first. Among every layout the cost model understands, the first is a pipeline
    with ZeRO-3."""
    cluster = ClusterSpec.from_preset("h100-80gb", nodes=64, devices_per_node=8)
    training = TrainingSpec(global_batch_size=2048, seq_len=8192)
    model = ModelSpec.preset("llama3-405b")
    candidates = plan_layouts(model, cluster, training)
    print("\n" + format_table(candidates))
    best = candidates[0]
    # Sharded over the ranks that hold the same parameters: data and context parallel ones.
    assert best.fits and best.config.pp > 1 and best.config.zero_stage in (1, 3)
    assert int(best.config.dp_shard) * best.config.cp > 1
    sharded = next(c for c in candidates if c.config.pp > 1 and c.config.zero_stage == 3)
    assert sharded.time.total <= 1.03 * best.time.total
    assert all(c.config.pp > 1 for c in candidates[:10])
    every = plan_layouts(model, cluster, training, composable=lambda config: True, top=1)[0]
    assert every.fits and every.config.pp > 1 and every.config.zero_stage == 3


def test_table_step_column_is_in_the_unit_it_names() -> None:
    """The step column's header names its unit (ms for a small CPU run, s for a large one) and the figures
    are in it."""
    tiny = ModelSpec(vocab_size=256, hidden=128, layers=4, heads=4, kv_heads=2, ffn_hidden=512)
    cases = ((tiny, ClusterSpec.from_preset("cpu", devices_per_node=2), TrainingSpec(global_batch_size=4, seq_len=64),
              "ms", 1e3),
             (ModelSpec.preset("llama3-70b"), ClusterSpec.from_preset("h100-80gb", nodes=8),
              TrainingSpec(global_batch_size=1024, seq_len=4096), "s", 1.0))
    for model, cluster, training, unit, scale in cases:
        candidates = plan_layouts(model, cluster, training, top=1)
        header, _, row = format_table(candidates).splitlines()[:3]
        assert f"step {unit} " in header
        shown = float(row.split()[-6])  # then compute, bubble, comm, tokens/s, MFU
        assert shown == pytest.approx(candidates[0].time.total * scale, abs=0.01)
