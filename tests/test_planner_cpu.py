"""The planner calibrated on this machine's ranks (lightning_par.planner.measure).

No test here passes or fails on wall-clock time: the probes run, but their clock is a fake one (every timed call
"takes" a chosen number of seconds), or the timings are given outright. What is checked is the mechanism: the
arithmetic from timings to a ClusterSpec, that the time model then predicts the probed block exactly, that every
rank plans with the same (slowest) figures, and that AutoParallelStrategy(calibrate=True) plans with them. The
wall-clock comparison of prediction and measurement lives in benchmarks/planner_cpu.py and docs/planner.md: a
ratio of two timings on a loaded 2-core CI machine can be made likely, not certain, to stay within bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
from harness import run_distributed

from lightning_par.layout.config import ParallelConfig
from lightning_par.planner import ClusterSpec, ModelSpec
from lightning_par.planner.measure import (
    MIN_ELEMENTWISE_SHARE,
    MachineRates,
    ProbeShape,
    ProbeTimings,
    measure_rates,
    measured_cluster,
    rates_from_timings,
)
from lightning_par.planner.time import COLLECTIVE_OVERLAP, estimate_step_time

# configs/data_parallel.yaml's model (LlamaLM dim 128, 4 layers, 4 heads, 2 kv heads), 8 x 128 tokens per rank.
SPEC = ModelSpec(vocab_size=256, hidden=128, layers=4, heads=4, kv_heads=2, ffn_hidden=352, name="LlamaLM")
SEQ, MBS = 128, 8
MS = 2.0**-10  # about a millisecond, exact in binary
TIMINGS = ProbeTimings(peak=0.016, linear=0.014, attention=0.005, block=0.028, optimizer=0.0015, link=0.004,
                       link_bytes=4 * SPEC.total_params, world_size=2)


class FakeClock:
    """Each timed call lasts ``step`` seconds: the clock advances by ``step`` at each reading. Steps are powers of
    two, so that the differences of its readings are exact in floating point."""

    def __init__(self, step: float) -> None:
        self.step, self.now = step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _step(cluster: ClusterSpec, config: ParallelConfig) -> object:
    return estimate_step_time(SPEC, config, cluster, seq_len=SEQ, microbatch_size=MBS, microbatches=1,
                              precision="32-true")


def test_the_time_model_predicts_the_probed_block_exactly() -> None:
    shape = ProbeShape.of(SPEC, seq_len=SEQ, microbatch_size=MBS)
    assert (shape.tokens, shape.hidden, shape.heads, shape.kv_heads, shape.ffn_hidden) == (1024, 128, 4, 2, 352)
    rates = rates_from_timings(shape, TIMINGS, memory_bytes=8 * 1024**3)
    cluster = measured_cluster(rates, devices_per_node=2, collective_overlap=0.0)
    # The large matmul is the peak; the probes' rates are peak x efficiency.
    assert cluster.peak_flops == cluster.peak_flops_fp32 == pytest.approx(2 * 1024**3 / 0.016)
    assert cluster.peak_flops * cluster.compute_efficiency == pytest.approx(shape.linear_flops / 0.014)
    assert cluster.peak_flops * cluster.attention_efficiency == pytest.approx(12 * 128 * 128 * 1024 / 0.005)
    assert cluster.memory_bytes == 8 * 1024**3 and cluster.name == "cpu (measured)"
    # The all-reduce's bus bandwidth: 2(d-1)/d of the bytes over its time.
    assert cluster.intra_node_bandwidth == pytest.approx(4 * SPEC.total_params / 0.004)

    step = _step(cluster, ParallelConfig(dp_shard=2))
    # Every block of the run is the probed micro-batch through the probed block: the prediction is the measurement.
    blocks = step.work["linear"] + step.work["attention"] + step.work["elementwise"]
    assert blocks == pytest.approx(SPEC.layers * TIMINGS.block, rel=1e-12)
    assert step.work["linear"] == pytest.approx(SPEC.layers * TIMINGS.linear, rel=1e-12)
    assert step.work["attention"] == pytest.approx(SPEC.layers * TIMINGS.attention, rel=1e-12)
    # The head runs at the projections' measured rate; AdamW at the probed rate over all of this rank's weights.
    assert step.work["head"] == pytest.approx(6 * 128 * 256 * 1024 / (shape.linear_flops / 0.014), rel=1e-12)
    assert step.optimizer == pytest.approx(SPEC.total_params * TIMINGS.optimizer / shape.block_params, rel=1e-12)
    # With overlap 0 the gradient all-reduce is all exposed: 2(d-1)/d x 4 bytes x params at the measured bandwidth.
    assert step.exposed["dp"] == pytest.approx(step.comm["dp"]) == pytest.approx(TIMINGS.link, rel=1e-12)
    assert step.total == pytest.approx(step.compute + TIMINGS.link + step.optimizer, rel=1e-12)
    assert step.mfu(cluster, "32-true") == pytest.approx(
        SPEC.flops_per_token(SEQ) * 2048 / (step.total * 2 * cluster.peak_flops))


def test_data_sheet_presets_are_unchanged_by_the_new_terms() -> None:
    """The presets leave the optimizer step uncosted and the overlap at its published calibration."""
    preset = ClusterSpec.from_preset("cpu", devices_per_node=2)
    assert preset.optimizer_rate is None and preset.collective_overlap is None
    step = _step(preset, ParallelConfig(dp_shard=2))
    assert step.optimizer == 0.0
    hidden = dataclasses.replace(preset, collective_overlap=COLLECTIVE_OVERLAP)
    assert _step(hidden, ParallelConfig(dp_shard=2)).total == step.total


def test_zero_divides_the_optimizer_step_by_the_ranks_holding_its_states() -> None:
    cluster = measured_cluster(rates_from_timings(ProbeShape.of(SPEC, seq_len=SEQ, microbatch_size=MBS), TIMINGS),
                               devices_per_node=2)
    whole, sharded = (_step(cluster, ParallelConfig(dp_shard=2, zero_stage=stage)).optimizer for stage in (0, 1))
    assert sharded == pytest.approx(whole / 2)


def test_the_elementwise_share_never_goes_negative() -> None:
    """Separately timed probes of a loaded machine may exceed the block they are part of."""
    shape = ProbeShape.of(SPEC, seq_len=SEQ, microbatch_size=MBS)
    rates = rates_from_timings(shape, dataclasses.replace(TIMINGS, linear=0.02, attention=0.01))
    assert rates.memory_bandwidth == pytest.approx(shape.elementwise_bytes / (MIN_ELEMENTWISE_SHARE * 0.028))
    with pytest.raises(ValueError, match="probe timing block=0"):
        rates_from_timings(shape, dataclasses.replace(TIMINGS, block=0))


def test_probe_limits_keep_start_up_short_for_a_large_model() -> None:
    shape = ProbeShape.of(ModelSpec.preset("llama3-70b"), seq_len=8192, microbatch_size=4, precision="bf16-mixed")
    assert shape.tokens == 8192 and shape.sequences == 1
    assert shape.head_dim == 128 and shape.heads % shape.kv_heads == 0 and shape.heads == 8 * shape.kv_heads
    assert shape.block_params <= 1.05 * 32 * 1024**2


def test_a_fake_clock_makes_the_measurement_exact() -> None:
    """The probes run for real (tiny model), the clock is fake: every probe lasts MS."""
    spec = ModelSpec(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64)
    rates = measure_rates(spec, seq_len=16, microbatch_size=2, clock=FakeClock(MS), repeats=2)
    shape = ProbeShape.of(spec, seq_len=16, microbatch_size=2)
    expected = rates_from_timings(shape, ProbeTimings(peak=MS, linear=MS, attention=MS, block=MS,
                                                      optimizer=MS), memory_bytes=rates.memory_bytes)
    assert rates == expected and rates.link_bandwidth is None
    assert MachineRates.from_list(rates.as_list()) == rates


# ------------------------------------------------------------------------------------------ every rank alike
def _measure_on_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from lightning_par.planner.runtime import plan_for_run

    dist.init_process_group("gloo")
    try:
        # Rank 1 is twice as slow as rank 0 at everything: both must plan with rank 1's figures.
        rates = measure_rates(SPEC, seq_len=16, microbatch_size=2, clock=FakeClock(MS * (1 + rank)), repeats=2,
                              local_world_size=world_size)
        cluster = measured_cluster(rates, devices_per_node=world_size, collective_overlap=0.0)
        plan = plan_for_run(SPEC, cluster, batch_size_per_rank=2, seq_len=16)
        return {"rates": rates, "plan": [(c.config, c.time.total) for c in plan]}
    finally:
        dist.destroy_process_group()


def test_every_rank_plans_with_the_slowest_ranks_figures() -> None:
    first, second = run_distributed(_measure_on_ranks, 2)
    assert first == second  # the same bits: the same layout, the same ranking, the same predictions
    shape = ProbeShape.of(SPEC, seq_len=16, microbatch_size=2)
    slow = ProbeTimings(peak=2 * MS, linear=2 * MS, attention=2 * MS, block=2 * MS, optimizer=2 * MS, link=2 * MS,
                        link_bytes=4 * SPEC.total_params, world_size=2)
    assert first["rates"] == rates_from_timings(shape, slow, memory_bytes=first["rates"].memory_bytes)


def _calibrated_fit(rank: int, world_size: int) -> dict:
    import lightning
    from test_hybrid3d import make_datamodule, make_module

    import lightning_par
    from lightning_par.planner import measure

    # The strategy measures with the real probes; only their clock is replaced (rank 1 slower).
    measure.measure_rates = functools.partial(measure.measure_rates, clock=FakeClock(MS * (1 + rank)), repeats=2)
    strategy = lightning_par.AutoParallelStrategy(calibrate=True)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0)
    module = make_module()
    trainer.fit(module, datamodule=make_datamodule())
    chosen = strategy.planned_layouts[0]
    return {"cluster": strategy.planned_cluster, "plan": [(c.config, c.time.total) for c in strategy.planned_layouts],
            "chosen": chosen.config, "predicted": chosen.time.total, "spec": ModelSpec.from_module(module),
            "micro": (chosen.microbatch_size, chosen.microbatches), "ran": strategy.parallel_config,
            "loss": float(trainer.callback_metrics["train_loss"])}


def test_auto_parallel_calibrate_plans_identically_on_every_rank_from_the_measured_rates() -> None:
    first, second = run_distributed(_calibrated_fit, 2)
    assert first["cluster"] == second["cluster"] and first["plan"] == second["plan"]
    cluster = first["cluster"]
    assert cluster.name == "cpu (measured)" and cluster.collective_overlap == 0.0
    # The figures are those of the slower rank's timings (2 ms for every probe and for the all-reduce).
    spec = first["spec"]
    shape = ProbeShape.of(spec, seq_len=16, microbatch_size=2)
    link_bytes = min(25 * 1024**2, 4 * spec.total_params)
    rates = rates_from_timings(shape, ProbeTimings(peak=2 * MS, linear=2 * MS, attention=2 * MS, block=2 * MS,
                                                   optimizer=2 * MS, link=2 * MS, link_bytes=link_bytes, world_size=2),
                               memory_bytes=cluster.memory_bytes)
    expected = measured_cluster(rates, devices_per_node=2, base=ClusterSpec.from_preset("cpu", devices_per_node=2),
                                collective_overlap=0.0)
    assert cluster == expected
    # The layout that ran is the first choice, and its prediction is the calibrated model's for that layout.
    assert (first["ran"].dp, first["ran"].tp, first["ran"].pp, first["ran"].zero_stage) == (
        first["chosen"].dp, first["chosen"].tp, first["chosen"].pp, first["chosen"].zero_stage)
    mbs, microbatches = first["micro"]
    again = estimate_step_time(spec, first["chosen"], expected, seq_len=16, microbatch_size=mbs,
                               microbatches=microbatches, precision="32-true")
    assert math.isclose(first["predicted"], again.total, rel_tol=1e-12)
    assert 0.0 < first["loss"] < 10.0
