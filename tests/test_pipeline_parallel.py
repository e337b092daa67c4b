"""pipeline_parallel: stage placement and balancing, and parity with one process for every schedule."""

from __future__ import annotations

import functools

import pytest
from parity import assert_parity, layout_run, reference_run
from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule

from lightning_par.parallel.pipeline import balance, sizes_from_split_points, stage_indices

PARITY_RTOL = 1e-5
# 8 blocks: 2 stages per rank at pp=4 (interleaved, ZB-V) still get one block each.
make_module = functools.partial(SGDLlamaLM, **{**MODEL, "n_layers": 8})


def make_strategy(**kwargs):
    from lightning_par import PipelineParallelStrategy

    return PipelineParallelStrategy(**kwargs)


def test_stage_placement() -> None:
    assert [stage_indices(r, 4, "1f1b") for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_indices(r, 2, "interleaved_1f1b", 3) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [stage_indices(r, 4, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_balance_minimises_the_largest_stage() -> None:
    assert balance([1.0] * 8, 4) == [2, 2, 2, 2]
    # A heavy embedding and head leave the first and last stages fewer blocks.
    assert balance([1.0] * 8, 4, first=2.0, last=2.0) == [1, 3, 3, 1]
    assert sizes_from_split_points([f"b.{i}" for i in range(6)], ["b.2", "b.3"], 3) == [2, 1, 3]
    with pytest.raises(ValueError, match="split point 'b.9' is not a block"):
        sizes_from_split_points([f"b.{i}" for i in range(6)], ["b.2", "b.9"], 3)


@pytest.mark.parametrize(
    ("world_size", "kwargs", "accumulate", "clip"),
    [
        (2, dict(schedule="gpipe", microbatches=2), 1, None),
        (2, dict(schedule="1f1b", microbatches=2), 2, 0.05),
        (2, dict(schedule="interleaved_1f1b", microbatches=2), 1, None),
        (2, dict(schedule="zbv", microbatches=2), 1, None),
        (4, dict(schedule="gpipe", microbatches=4), 1, None),
        (4, dict(schedule="1f1b", microbatches=4), 1, 0.05),
        (4, dict(schedule="interleaved_1f1b", microbatches=4), 1, None),
        (4, dict(schedule="zbv", microbatches=4), 1, None),
    ],
    ids=["pp2-gpipe", "pp2-1f1b-acc2-clip", "pp2-interleaved", "pp2-zbv", "pp4-gpipe", "pp4-1f1b-clip",
         "pp4-interleaved", "pp4-zbv"],
)
def test_pipeline_matches_single_process(world_size: int, kwargs: dict, accumulate: int, clip) -> None:
    datamodule = functools.partial(make_datamodule, batch_size=4)
    expected = reference_run(make_module, datamodule, dp=1, steps=STEPS, accumulate=accumulate,
                             gradient_clip_val=clip)
    actual = layout_run(make_module, datamodule,
                        functools.partial(make_strategy, pipeline_parallel_size=world_size, **kwargs),
                        world_size=world_size, steps=STEPS, accumulate=accumulate,
                        trainer_kwargs={"gradient_clip_val": clip})
    loss_error, weight_error = assert_parity(actual, expected, rtol=PARITY_RTOL)
    print(f"pipeline_parallel {kwargs} ws={world_size}: loss rel err {loss_error:.1e}, weights {weight_error:.1e}")
