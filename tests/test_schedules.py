"""Every row of ``lightning_par.layout.schedules.SCHEDULES`` against what its facts must mean.

Each test iterates the table, so a new schedule is held to the same checks by adding its row. What needs processes
(the order in which torch's schedule really runs, and the bubble that order implies) is in
``tests/test_pipeline_parallel.py::test_pipeline_bubble_matches_theory``, which iterates the table too.
"""

from __future__ import annotations

import pytest

from lightning_par.layout.config import ParallelConfig
from lightning_par.layout.schedules import (SCHEDULES, fewest_microbatches, stage_indices, stages_per_rank,
                                            too_few_microbatches)

NAMES = list(SCHEDULES)
PIPELINES = [(pp, v) for pp in (2, 3, 4, 8) for v in (2, 3)]

# Each row's facts at p=4 ranks, v=2 virtual stages, worked out by hand from its paper: rank 0's stages, the fewest
# micro-batches, rank 0's micro-batches in flight at m=16, the bubble as a share of the compute at m=8.
AT_P4_V2 = {
    "gpipe": ([0], 1, 16.0, 3 / 8),  # all 16 forwards first; (p-1)/m
    "1f1b": ([0], 4, 4.0, 3 / 8),  # p - r ahead
    "interleaved_1f1b": ([0, 4], 4, 5.5, 3 / 16),  # (2(p-1) + (v-1)p + 1) / v chunks; (p-1)/(v·m)
    # 2p chunks of half the rank; the last rank waits p - 1 = 3 chunk forwards of its 6m = 48 equal passes
    "zbv": ([0, 7], 4, 4.0, 3 / 48),
    "dualpipev": ([0, 7], 8, 4.0, 3 / 48),  # one micro-batch per stage; ZB-V's bubble (tests/test_pipeline_parallel.py)
}


def test_every_row_has_its_worked_example() -> None:
    assert set(AT_P4_V2) == set(SCHEDULES), "add the new row's line to AT_P4_V2"


@pytest.mark.parametrize("name", NAMES)
def test_each_row_gives_its_worked_example(name: str) -> None:
    spec = SCHEDULES[name]
    got = (stage_indices(0, 4, name, 2), fewest_microbatches(name, 4, 2), spec.in_flight(4, 0, 16, 2),
           spec.bubble(4, 8, 2))
    assert got[:2] == AT_P4_V2[name][:2] and got[2:] == pytest.approx(AT_P4_V2[name][2:]), (name, got)


@pytest.mark.parametrize("name", NAMES)
def test_every_stage_sits_on_exactly_one_rank(name: str) -> None:
    for pp, v in PIPELINES:
        per_rank = stages_per_rank(name, v)
        held = [stage_indices(rank, pp, name, v) for rank in range(pp)]
        assert all(len(stages) == per_rank for stages in held), (name, pp, v, held)
        assert sorted(s for stages in held for s in stages) == list(range(pp * per_rank)), (name, pp, v, held)
        if SCHEDULES[name].v_shape:  # the bottom of the V: the last stage comes back to rank 0 (Qi et al. 2024)
            assert held[0] == [0, 2 * pp - 1] and held[-1] == [pp - 1, pp], (name, held)
        else:  # looped: rank r holds r, r + p, ... (Narayanan et al. 2021)
            assert all(stages == list(range(rank, pp * per_rank, pp)) for rank, stages in enumerate(held)), held


@pytest.mark.parametrize("name", NAMES)
def test_stages_per_rank_is_fixed_or_the_virtual_stages(name: str) -> None:
    fixed = SCHEDULES[name].stages_per_rank
    assert [stages_per_rank(name, v) for v in (2, 3, 5)] == ([2, 3, 5] if fixed is None else [fixed] * 3)
    if SCHEDULES[name].v_shape:
        assert fixed == 2, "a V holds two stages per rank"


@pytest.mark.parametrize("name", NAMES)
def test_the_fewest_microbatches_are_accepted_and_one_fewer_refused_naming_the_values(name: str) -> None:
    for pp, v in PIPELINES:
        least = fewest_microbatches(name, pp, v)
        assert least >= 1 and too_few_microbatches(least, name, pp, v) is None
        assert too_few_microbatches(4 * pp * stages_per_rank(name, v), name, pp, v) is None
        if least > 1:
            why = too_few_microbatches(least - 1, name, pp, v)
            assert why is not None and f"schedule {name!r}" in why and f"pp={pp}" in why, why
            assert f"got microbatches={least - 1}" in why and f"raise it to {least} or more" in why, why


def test_the_microbatch_messages_of_the_shipped_floors() -> None:
    """The words docs/errors.md quotes (tests/bad_inputs.py holds the strategies to them)."""
    assert too_few_microbatches(1, "1f1b", 2, 2) == ("schedule '1f1b' needs at least pp=2 micro-batches to fill the "
                                                     "pipeline, got microbatches=1; raise it to 2 or more (or use "
                                                     "'gpipe')")
    assert too_few_microbatches(2, "dualpipev", 2, 2) == ("schedule 'dualpipev' needs at least 2 x pp=2 = 4 "
                                                          "micro-batches (one per stage), got microbatches=2; raise "
                                                          "it to 4 or more")
    assert too_few_microbatches(1, "gpipe", 8, 2) is None


@pytest.mark.parametrize("name", NAMES)
def test_activations_in_flight_are_all_microbatches_only_where_every_forward_comes_first(name: str) -> None:
    """GPipe keeps every micro-batch (Huang et al. 2019); the 1F1B family at most a few per rank however many
    micro-batches there are (Narayanan et al. 2021; Qi et al. 2024), about p - r, more on the first ranks."""
    spec = SCHEDULES[name]
    for pp, v in PIPELINES:
        for m in (fewest_microbatches(name, pp, v), 64, 1024):
            held = [spec.in_flight(pp, rank, m, v) for rank in range(pp)]
            assert all(0 < h <= m for h in held), (name, pp, v, m, held)
            assert held == sorted(held, reverse=True), ("later ranks start backward sooner", name, held)
            if spec.forwards_first:
                assert held == [m] * pp, (name, held)
            elif m >= 64:
                assert max(held) <= 2 * pp and held == [spec.in_flight(pp, r, 4 * pp, v) for r in range(pp)], held


@pytest.mark.parametrize("name", NAMES)
def test_the_bubble_shrinks_with_microbatches_and_never_exceeds_fill_and_drain(name: str) -> None:
    """(p-1)/m of the compute idle at most (GPipe's fill and drain, Huang et al. 2019); virtual stages divide it
    (Narayanan et al. 2021); a split backward fills it (Qi et al. 2024). The exact values against the order torch
    runs are in test_pipeline_parallel.py."""
    spec = SCHEDULES[name]
    for pp, v in PIPELINES:
        bubbles = [spec.bubble(pp, m, v) for m in (pp, 2 * pp, 8 * pp)]
        assert all(0 <= b <= (pp - 1) / m for b, m in zip(bubbles, (pp, 2 * pp, 8 * pp))), (name, bubbles)
        assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] > bubbles[-1], (name, bubbles)
        if spec.splits_backward:
            assert bubbles[0] < (pp - 1) / pp / 2, (name, bubbles)


@pytest.mark.parametrize("name", NAMES)
def test_torch_runs_each_row_with_the_class_it_names(name: str) -> None:
    """The row's class exists in torch and takes one stage per rank exactly when the row holds one
    (``build_schedule`` passes ``stages[0]`` to a single-stage schedule, all of the rank's stages otherwise)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, SCHEDULES[name].torch_class)
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    assert single == (SCHEDULES[name].stages_per_rank == 1), (name, cls)
    assert single or issubclass(cls, torch_schedules.PipelineScheduleMulti), cls


def test_every_row_is_accepted_by_the_config_the_command_line_and_the_planner() -> None:
    """Each row's name validates as a ``ParallelConfig`` schedule with the row's split backward, is offered by
    ``lightning-par plan --pp-schedule``, and is costed by the planner with its row's bubble; other names are
    refused."""
    from lightning_par.cli.plan import _parser
    from lightning_par.planner import ClusterSpec, ModelSpec, estimate_step_time

    model = ModelSpec(vocab_size=256, hidden=128, layers=8, heads=4, kv_heads=2, ffn_hidden=512)
    cluster = ClusterSpec.from_preset("h100-80gb", nodes=1, devices_per_node=4)
    for name, spec in SCHEDULES.items():
        m = max(8, fewest_microbatches(name, 4, 2))
        config = ParallelConfig(pp=4, dp_shard=1, pp_schedule=name, microbatches=m)
        assert config.validate(4).splits_backward == spec.splits_backward, name
        assert _parser().parse_args(["--pp-schedule", name]).pp_schedule == name
        time = estimate_step_time(model, config, cluster, seq_len=64, microbatch_size=1, microbatches=m)
        assert time.bubble > 0 and time.bubble == pytest.approx(spec.bubble(4, m, 2) * (time.compute + time.recompute))
    with pytest.raises(ValueError, match=r"pp_schedule='dualpipe' is not one of \('gpipe', '1f1b'"):
        ParallelConfig(pp=2, dp_shard=1, pp_schedule="dualpipe").validate(2)


def _torch_zbv_order(p: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """The order torch's ``ScheduleZBVZeroBubble`` gives each of ``p`` ranks for ``m`` micro-batches, as
    ``BubbleMeter`` records actions, without processes: the schedule computes every rank's order from these fields
    alone (a private method, so a torch that changes it fails here rather than silently)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    schedule = object.__new__(torch_schedules.ScheduleZBVZeroBubble)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = p, 2, m
    schedule.num_stages = schedule._num_stages = 2 * p
    schedule.stage_index_to_group_rank = torch_schedules.generate_stage_to_rank_mapping(p, 2 * p, style="v")
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    return {rank: [(action.stage_index, kinds[action.computation_type.name], action.microbatch_index)
                   for action in schedule._calculate_single_rank_operations(rank) if action is not None]
            for rank in range(p)}


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_bubble_is_the_replay_of_torchs_order_and_below_1f1b(p: int) -> None:
    """ZB-V's row against the order torch runs it in, replayed with equal forward, input- and weight-gradient passes
    (``simulated_bubble``; Qi et al. 2024 count the bubble in such units): for every micro-batch count from the
    fewest (one per rank) up, the row's bubble is the replay's, and below 1F1B's fill and drain."""
    from lightning_par.parallel.pipeline.bubble import simulated_bubble

    for m in (*range(p, 2 * p + 2), 4 * p, 8 * p):
        idle = max(simulated_bubble(_torch_zbv_order(p, m), 2 * p).values())
        bubble = SCHEDULES["zbv"].bubble(p, m, 2)
        assert bubble / (1 + bubble) == pytest.approx(idle, abs=1e-12), (p, m, idle, bubble)
        assert bubble < SCHEDULES["1f1b"].bubble(p, m, 2), (p, m)


def test_labels_and_search_order_tell_the_rows_apart() -> None:
    labels = [spec.label.format(v=2) for spec in SCHEDULES.values()]
    orders = [spec.search_order for spec in SCHEDULES.values()]
    assert len(set(labels)) == len(labels) and len(set(orders)) == len(orders), (labels, orders)
    assert all(spec.paper for spec in SCHEDULES.values())
