"""Every row of ``lightning_par.layout.context_methods.CONTEXT_METHODS`` against what its facts must mean.

Each test iterates the table, so a new method is held to the same checks by adding its row. What needs processes
(the method's attention against one process's, the bytes it sends against its row's ``exchange_bytes``, its refusal
of attention dropout where its row says it has none) is in
``tests/test_context_parallel.py::test_attention_over_slices_equals_attention_over_the_whole``, which iterates the
table too, as does the training parity there.
"""

from __future__ import annotations

import pytest

from lightning_par.layout.config import CP_METHODS, ParallelConfig
from lightning_par.layout.context_methods import CONTEXT_METHODS, chunks_of_rank, fits, sequence_divisor
from lightning_par.parallel.context import causal_score_blocks, local_positions

NAMES = list(CONTEXT_METHODS)


@pytest.mark.parametrize("name", NAMES)
def test_the_ranks_chunks_cover_the_sequence_once_with_the_rows_causal_work(name: str) -> None:
    for cp in (2, 4, 8):
        seq_len = 4 * sequence_divisor(cp, name)
        positions = sorted(p for rank in range(cp) for p in local_positions(seq_len, rank, cp, name).tolist())
        assert positions == list(range(seq_len))
        assert sorted(c for rank in range(cp) for c in chunks_of_rank(rank, cp, name)) == \
            list(range(sequence_divisor(cp, name)))
        work = [causal_score_blocks(rank, cp, name) for rank in range(cp)]
        # Balanced: every rank the same unmasked score blocks; contiguous: rank r the r + 1/2 blocks before its own.
        assert work == ([2 * cp] * cp if CONTEXT_METHODS[name].balances_causal_work else
                        [rank + 0.5 for rank in range(cp)]), (cp, work)


@pytest.mark.parametrize("name", NAMES)
def test_a_method_fits_what_its_row_divides(name: str) -> None:
    spec = CONTEXT_METHODS[name]
    divisor = sequence_divisor(4, name)
    assert fits(3 * divisor, 8, 4, name) and not fits(3 * divisor + 1, 8, 4, name)
    assert fits(3 * divisor, 6, 4, name) == (not spec.splits_heads)  # 6 heads do not split over 4 ranks


def test_every_row_is_accepted_by_the_config_the_command_line_and_the_planner() -> None:
    """Each row's name validates as a ``ParallelConfig`` method, is offered by ``lightning-par plan --cp-method``, and
    is planned with its row's label and exchanged bytes; other names are refused with every row's summary."""
    from lightning_par.cli.plan import _parser
    from lightning_par.planner import ClusterSpec, ModelSpec, TrainingSpec, plan_layouts
    from lightning_par.planner.report import layout_name

    model = ModelSpec(vocab_size=256, hidden=128, layers=4, heads=4, kv_heads=2, ffn_hidden=512)
    cluster = ClusterSpec.from_preset("h100-80gb", nodes=1, devices_per_node=4)
    assert CP_METHODS == tuple(sorted(NAMES, key=lambda name: CONTEXT_METHODS[name].search_order))
    for name, spec in CONTEXT_METHODS.items():
        assert ParallelConfig(cp=4, dp_shard=1, cp_method=name).validate(4).cp_method == name
        assert _parser().parse_args(["--cp-method", name]).cp_method == name
        (best, *_) = plan_layouts(model, cluster, TrainingSpec(global_batch_size=4, seq_len=64),
                                  fixed={"cp": 4, "cp_method": name, "tp": 1})
        assert best.config.cp_method == name and f"cp4{spec.label}" in layout_name(best).split(), layout_name(best)
        assert best.time.comm_bytes["cp"] > 0
    with pytest.raises(ValueError, match="is not one of .*" + "; ".join(
            f"{spec.name}: {spec.summary}" for spec in CONTEXT_METHODS.values()).replace("(", r"\(")):
        ParallelConfig(cp=2, dp_shard=1, cp_method="striped").validate(2)


@pytest.mark.parametrize("name", NAMES)
def test_the_planner_costs_the_rows_exchanges_and_memory(name: str) -> None:
    """The planner's cp volume of a block is the row's ``exchange_bytes`` (which the attention test holds to the bytes
    really sent), and its activations and score blocks the row's."""
    from lightning_par.planner import ClusterSpec, ModelSpec, estimate_memory, estimate_step_time

    model = ModelSpec(vocab_size=256, hidden=128, layers=4, heads=4, kv_heads=2, ffn_hidden=512)
    cluster = ClusterSpec.from_preset("h100-80gb", nodes=1, devices_per_node=4)
    spec = CONTEXT_METHODS[name]

    def cp_volume(layers: int) -> float:
        deeper = ModelSpec(**{**model.__dict__, "layers": layers})
        config = ParallelConfig(cp=4, dp_shard=1, cp_method=name)
        return estimate_step_time(deeper, config, cluster, seq_len=64, microbatch_size=2,
                                  microbatches=1).comm_bytes["cp"]

    local = 2 * (64 // 4) * 128 * 2  # bf16 (B, H, T/cp, D) of the whole width
    assert cp_volume(8) - cp_volume(4) == pytest.approx(4 * spec.exchange_bytes(local, 4, 2, 4, False))
    memory = estimate_memory(model, ParallelConfig(cp=4, dp_shard=1, cp_method=name), seq_len=64,
                             microbatch_size=2, microbatches=1)
    assert memory.attention_scores == pytest.approx(spec.score_bytes(2, 4, 64, 4))
