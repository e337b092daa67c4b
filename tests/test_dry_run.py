"""``lightning-par check``: the real layout code of chosen ranks at 512 ranks on one machine (fake backend, fake
tensors), its collectives per mesh dimension held to the formulas, its model states to the bytes a rank holds and to
the planner's count of them, and its refusals made before any rank process starts."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from lightning_par.cli.check import chosen_ranks, held_model_states, main

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
# A model whose every dimension divides 512 ranks' shards and 8 tensor-parallel ranks (FSDP2 pads a dimension 0
# that does not divide to a multiple of the shards, which would add bytes the formulas do not count).
DIM, FFN, VOCAB = 512, 1024, 512
MODEL = [f"--model.init_args.vocab_size={VOCAB}", f"--model.init_args.dim={DIM}", "--model.init_args.n_heads=8",
         "--model.init_args.n_kv_heads=8", f"--model.init_args.ffn_hidden_size={FFN}"]
BLOCK_MATRICES = 4 * DIM * DIM + 3 * DIM * FFN  # q, k, v, o; gate, up, down
BLOCK = BLOCK_MATRICES + 2 * DIM  # and two norm gains
ROOT = 2 * VOCAB * DIM + DIM  # embedding, untied head, final norm


def _check(tmp_path: Path, config: str, n_layers: int, *options: str) -> list[dict]:
    report = tmp_path / f"{config}-{n_layers}.json"
    main(["--config", str(REPO / "configs" / config), "--world-size", "512", "--json", str(report), *MODEL,
          f"--model.init_args.n_layers={n_layers}", *options])
    ranks = json.loads(report.read_text())
    assert [rank["cyclic_bytes"] for rank in ranks] == [0] * len(ranks)  # no tensor waited for the collector
    return ranks


def _bytes(report: dict, dimension: str) -> int:
    return report["collectives"][dimension]["bytes"]


def test_zero3_moves_three_times_each_block_and_holds_a_512th_of_the_model(tmp_path: Path) -> None:
    """ZeRO-3 over 512 ranks, one FSDP2 unit per block, resharded after forward: each block is all-gathered for the
    forward, again for the backward, and its gradient reduced (3 x its fp32 bytes, message sizes as
    ``comm/dp_bytes`` counts them); the root (embedding, head, final norm) stays gathered (2 x). Each rank keeps a
    512th of the parameters and AdamW's two moments of them."""
    options = ["--trainer.strategy.init_args.blocks_per_unit=1", "--trainer.strategy.init_args.keep_gathered_blocks=0"]
    two, four = (_check(tmp_path, "zero3.yaml", n, *options)[0] for n in (2, 4))
    assert two["layout"].startswith("pp=1 x dp_replicate=1 x dp_shard=512")
    per_block = (_bytes(four, "dp") - _bytes(two, "dp")) / 2
    assert per_block == pytest.approx(3 * 4 * BLOCK, rel=0.01)
    assert _bytes(two, "dp") == pytest.approx(3 * 4 * 2 * BLOCK + 2 * 4 * ROOT, rel=0.01)
    for report, blocks in ((two, 2), (four, 4)):
        held = 4 * (blocks * BLOCK + ROOT) / 512
        assert report["states"]["parameters"] == pytest.approx(held, rel=0.01)
        assert report["states"]["optimizer_states"] == pytest.approx(2 * held, rel=0.01)
        assert held_model_states(report) == pytest.approx(report["planned"]["model_states"], rel=0.01)


def test_pipeline_tensor_and_data_parallel_traffic_per_block_at_512_ranks(tmp_path: Path) -> None:
    """pp=2 x dp=32 x tp=8 with sequence parallel (configs/hybrid3d.yaml, 8 sequences of 128 tokens per data-parallel
    rank in 4 micro-batches): both stages of rank 0's pipeline run. Per block, tensor parallel moves 8 b s h (an
    all-gather and a reduce-scatter around attention and around the MLP, forward and backward; Korthikanti et al.
    2022); data parallel all-reduces the block's gradient shard once a step; the pipeline sends each micro-batch's
    (2, 128/8, 512) slice of hidden states, whatever the depth. The model is built on the meta device."""
    options = ["--trainer.strategy.init_args.tensor_parallel_size=8",
               "--trainer.strategy.init_args.data_parallel_size=auto"]
    two, four = (_check(tmp_path, "hybrid3d.yaml", n, *options) for n in (2, 4))
    assert [report["rank"] for report in two] == [0, 256] and [report["stages"] for report in two] == [[0], [1]]
    batch, seq_len, tp, microbatches = 8, 128, 8, 4
    for first, second in zip(two, four):  # one more block on each stage
        assert _bytes(second, "tp") - _bytes(first, "tp") == pytest.approx(8 * batch * seq_len * DIM * 4, rel=0.01)
        gradient_shard = 4 * (BLOCK_MATRICES / tp + 2 * DIM)  # norm gains are whole on every tp rank
        assert _bytes(second, "dp") - _bytes(first, "dp") == pytest.approx(gradient_shard, rel=0.01)
        sends = microbatches * (batch // microbatches) * (seq_len // tp) * DIM * 4
        assert sends <= _bytes(first, "pp") <= sends + 64  # + the loss broadcast to every stage
    for report in (*two, *four):
        # Each gradient is the size of its parameter: the first stage's vocabulary-split embedding included, whose
        # gradient is this rank's rows even though the model was allocated after the split.
        assert report["states"]["gradients"] == report["states"]["parameters"], report["stages"]
        assert held_model_states(report) == pytest.approx(report["planned"]["model_states"], rel=0.01), report["stages"]


def zero3_dry_runs(tmp_path: Path, option: str, values: tuple[str, ...]) -> dict[str, dict]:
    """Rank 0's report of configs/zero3.yaml dry-run on 2 ranks with ``--option=value``, for each value."""
    reports = {}
    for value in values:
        report = tmp_path / f"{value}.json"
        main(["--config", str(REPO / "configs" / "zero3.yaml"), "--world-size", "2", "--json", str(report),
              f"--{option}={value}"])
        reports[value] = json.loads(report.read_text())[0]
    return reports


def test_per_op_recomputation_saves_what_the_planner_says(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """configs/zero3.yaml (4 blocks) dry-run with selective and with per-op recomputation: at the step's peak (the
    last block's recomputation, which holds that block's whole working set in either mode) the other three blocks
    keep k, o_proj and up less under ``op``, each block the planner's difference; the planner's peak stays within 10%
    of the dry run's in both modes. A layout without tensor parallel has no split for the report to call unchecked."""
    reports = zero3_dry_runs(tmp_path, "trainer.strategy.init_args.activation_checkpointing", ("selective", "op"))
    blocks = 4
    planned_per_block = (reports["selective"]["planned"]["activations"] - reports["op"]["planned"]["activations"]) \
        / blocks
    measured = reports["selective"]["memory"]["activations"] - reports["op"]["memory"]["activations"]
    assert measured == pytest.approx((blocks - 1) * planned_per_block, rel=0.01)
    for report in reports.values():
        assert report["memory"]["peak"] == pytest.approx(report["planned"]["total"], rel=0.1)
    assert "tensor-parallel split" not in capsys.readouterr().out


def test_check_refuses_before_any_rank_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"= 8 does not equal the world size 12"):
        main(["--config", str(REPO / "configs" / "hybrid3d.yaml"), "--world-size", "12"])
    with pytest.raises(ValueError, match=r"--ranks 16 are not ranks of a world of 16; fit: 0 to 15"):
        main(["--config", str(REPO / "configs" / "zero3.yaml"), "--world-size", "16", "--ranks", "3,16"])
    with pytest.raises(ValueError, match=r"trainer.strategy=DDPStrategy is not a lightning-par strategy"):
        main(["--config", str(REPO / "configs" / "zero3.yaml"), "--world-size", "16", "--trainer.strategy=ddp"])


def test_a_rank_runs_with_the_other_stages_of_its_pipeline() -> None:
    assert chosen_ranks(None, 512, 1) == [0]
    assert chosen_ranks([17], 512, 4) == [17, 145, 273, 401]
    assert chosen_ranks([0, 7], 8, 2) == [0, 3, 4, 7]


def test_a_recomputed_pipeline_holds_no_cast_weight_gradients_at_its_peak(tmp_path: Path) -> None:
    """pp=2 x dp=2 x tp=2 in bf16-mixed with every block recomputed, 4 micro-batches of 1024-wide blocks. Under one
    autocast region with its weight cache, every micro-batch after the first sends each weight's bf16 gradient to the
    cast node of the first micro-batch, which the autograd engine runs last: all of a stage's bf16 weight gradients
    would be held together (4 blocks x 16.8 MB here). The schedule runs without the cache, so at the step's peak
    less than one block's bf16 weights is held in backward temporaries."""
    report = tmp_path / "recomputed.json"
    main(["--config", str(REPO / "configs" / "hybrid3d.yaml"), "--world-size", "8", "--json", str(report),
          "--model.init_args.vocab_size=512", "--model.init_args.dim=1024", "--model.init_args.n_heads=8",
          "--model.init_args.n_kv_heads=8", "--model.init_args.ffn_hidden_size=4096", "--model.init_args.n_layers=8",
          "--trainer.strategy.init_args.tensor_parallel_size=2", "--trainer.strategy.init_args.data_parallel_size=auto",
          "--trainer.precision=bf16-mixed", "--trainer.strategy.init_args.activation_checkpointing=full"])
    block_bf16_bytes = 2 * (4 * 1024 * 1024 + 3 * 1024 * 4096) / 2  # q, k, v, o, gate, up, down over tp=2
    for stage in json.loads(report.read_text()):
        assert stage["memory"]["temporaries"] < block_bf16_bytes, stage["stages"]


def test_a_tensor_a_reference_cycle_holds_counts_until_the_step_ends_whenever_the_collector_would_run() -> None:
    """A step's tensor dropped into a reference cycle is freed by Python's cyclic collector, whose moments a
    process's history sets (its thresholds stand in for that history here). The measured step runs it at fixed points
    only: the cycle's megabyte counts at the peak under any thresholds, and is reported as freed by the collector."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_par.dry_run.tracked_step import _StepPeakTracker

    def step_peak_and_cyclic() -> tuple[int, int]:
        with FakeTensorMode():
            tracker = _StepPeakTracker(track_modules=False)
            with tracker, tracker.collections:
                cycle: list = [torch.empty(MIB, dtype=torch.uint8)]
                cycle.append(cycle)
                del cycle
                torch.empty(MIB, dtype=torch.uint8)
        peak = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
        return peak, tracker.collections.freed

    thresholds = gc.get_threshold()
    try:
        measured = []
        for young in (1, 700, 100_000):  # at once, Python's default, never within the step
            gc.set_threshold(young, *thresholds[1:])
            measured.append(step_peak_and_cyclic())
    finally:
        gc.set_threshold(*thresholds)
    assert measured == [(2 * MIB, MIB)] * 3


def _held_to_the_planner(report: Path, stages: int) -> None:
    """Every rank of ``report``: the planner's model states within 5% of the dry run's, its peak within 15%, and no
    tensor of its step held by a reference cycle (the peak the same whenever Python's collector would run)."""
    ranks = json.loads(report.read_text())
    assert [rank["stages"] for rank in ranks] == [[s] for s in range(stages)]
    for rank in ranks:
        assert rank["cyclic_bytes"] == 0, rank["stages"]
        planned = rank["planned"]
        assert held_model_states(rank) == pytest.approx(planned["model_states"], rel=0.05), rank["stages"]
        assert rank["memory"]["peak"] == pytest.approx(planned["total"], rel=0.15), rank["stages"]


def test_the_planner_holds_to_the_dry_run_of_llama3_8b_on_8_ranks(tmp_path: Path) -> None:
    """Llama 3 8B at 8K context on one node of 8 (benchmarks/dry_run/llama3_8b.yaml: FSDP2 over 8 ranks gathering bf16
    weights, every block recomputed, bf16-mixed), at full depth."""
    report = tmp_path / "8b.json"
    main(["--config", str(REPO / "benchmarks" / "dry_run" / "llama3_8b.yaml"), "--world-size", "8", "--json",
          str(report)])
    _held_to_the_planner(report, 1)
    # One micro-batch a step: the peak is the loss's backward, before any gradient is made (planned within 1.2%).
    (rank,) = json.loads(report.read_text())
    assert rank["memory"]["peak"] == pytest.approx(rank["planned"]["total"], rel=0.05)


def test_the_planner_holds_to_the_dry_run_of_llama3_70b_on_256_ranks(tmp_path: Path) -> None:
    """Llama 3 70B's width and 8K context on 256 ranks (benchmarks/dry_run/llama3_70b.yaml: pp4 x dp8 x tp8 with
    sequence parallel, ZeRO-1, 4 micro-batches, full recomputation, bf16-mixed), four blocks per stage to keep the
    suite short. ZeRO-1 hands out whole tensors: the rank owning the embedding holds more than an even share."""
    report = tmp_path / "70b.json"
    main(["--config", str(REPO / "benchmarks" / "dry_run" / "llama3_70b.yaml"), "--world-size", "256", "--json",
          str(report), "--model.init_args.n_layers=16"])
    _held_to_the_planner(report, 4)


def test_the_planner_holds_to_the_dry_run_of_llama3_405b_on_512_ranks(tmp_path: Path) -> None:
    """Llama 3 405B's width and 8K context on 512 ranks (benchmarks/dry_run/llama3_405b.yaml: pp8 x dp8 x tp8 with
    sequence parallel, ZeRO-1, 8 micro-batches, full recomputation, bf16-mixed), two blocks per stage to keep the
    suite short: with so few blocks the embedding's owner holds twice an even share of the first stage's optimizer
    states (ZeroRedundancyOptimizer hands out whole tensors), and each micro-batch has receive buffers of its own.
    At full depth (benchmarks/dry_run_scale.py, docs/planner.md) they agree as closely."""
    report = tmp_path / "405b.json"
    main(["--config", str(REPO / "benchmarks" / "dry_run" / "llama3_405b.yaml"), "--world-size", "512", "--json",
          str(report), "--model.init_args.n_layers=16"])
    _held_to_the_planner(report, 8)


def test_the_planner_holds_to_the_dry_run_of_a_long_context_layout(tmp_path: Path) -> None:
    """Llama 3 405B's width at 128K tokens, context parallel composed with pipeline and tensor parallel with sequence
    parallel (Llama 3's long-context layout): pp2 x cp8 x tp8 with ring attention on 128 ranks, two blocks per
    stage. The planner counts the ring's chunk-pair scores, the whole sequence the first block keeps as its input
    (it cuts out the rank's chunks) and the logits of the whole sequence the last stage keeps for the loss."""
    report = tmp_path / "long.json"
    main(["--config", str(REPO / "benchmarks" / "dry_run" / "llama3_405b.yaml"), "--world-size", "128", "--json",
          str(report), "--model.init_args.n_layers=4", "--model.init_args.max_seq_len=131072",
          "--data.init_args.seq_len=131072", "--trainer.strategy.init_args.pipeline_parallel_size=2",
          "--trainer.strategy.init_args.context_parallel_size=8",
          "--trainer.strategy.init_args.context_parallel_method=ring"])
    _held_to_the_planner(report, 2)


def test_loss_parallel_holds_the_loss_on_the_vocabulary_shard(tmp_path: Path) -> None:
    """Under loss parallel, DTensor learns each loss operation's global shape by running it on fake tensors of the
    whole vocabulary: a run's cost nothing, and a dry run must not count them. At the step's peak (the loss's
    backward) the temporaries are PyTorch's fused backward on this rank's quarter of the vocabulary, three fp32
    tensors of a quarter of the whole logits each, not two more of the whole logits."""
    report = tmp_path / "loss_parallel.json"
    vocab, batch, seq_len = 16384, 8, 128
    main(["--config", str(REPO / "configs" / "hybrid3d.yaml"), "--world-size", "8", "--json", str(report),
          f"--model.init_args.vocab_size={vocab}", "--model.init_args.dim=64", "--model.init_args.n_heads=4",
          "--model.init_args.n_kv_heads=4", "--trainer.strategy.init_args.pipeline_parallel_size=1",
          "--trainer.strategy.init_args.tensor_parallel_size=4", "--trainer.strategy.init_args.data_parallel_size=auto",
          "--trainer.strategy.init_args.loss_parallel=true"])
    whole_logits = batch * seq_len * vocab * 4
    (rank,) = json.loads(report.read_text())
    assert 0.75 * whole_logits <= rank["memory"]["temporaries"] < 1.25 * whole_logits


def test_a_schedule_that_splits_backward_is_dry_run_too(tmp_path: Path) -> None:
    """ZB-V runs each backward as an input-gradient pass (``torch.autograd.grad``) and a weight pass, which torch's
    module tracker cannot follow: the step is measured without it, the model states as the planner counts them."""
    report = tmp_path / "zbv.json"
    main(["--config", str(REPO / "configs" / "hybrid3d.yaml"), "--world-size", "8", "--json", str(report),
          "--trainer.strategy.init_args.pipeline_schedule=zbv", "--trainer.strategy.init_args.microbatches=8"])
    ranks = json.loads(report.read_text())
    assert [rank["stages"] for rank in ranks] == [[0, 3], [1, 2]]
    for rank in ranks:
        assert held_model_states(rank) == pytest.approx(rank["planned"]["model_states"], rel=0.05), rank["stages"]


def test_a_planned_layout_is_written_onto_the_config_as_it_was_planned() -> None:
    """``plan --check`` gives the config's strategy each layout through hybrid3d's arguments: read back as
    ``lightning-par fit`` reads them, they are the planner's layout."""
    from lightning_par.cli.plan_check import layout_arguments
    from lightning_par.layout.config import ParallelConfig
    from lightning_par.cli.dry_run_rank import layout_of, read_config

    planned = ParallelConfig(pp=2, dp_replicate=2, dp_shard=2, tp=2, zero_stage=3, sequence_parallel=True,
                             loss_parallel=True, pp_schedule="interleaved_1f1b", microbatches=8,
                             activation_checkpointing="selective", param_dtype="bf16").validate(16)
    cli = read_config(["--config", str(REPO / "configs" / "zero3.yaml"), *layout_arguments(planned)])
    assert layout_of(cli, 16) == planned


def test_plan_check_puts_the_dry_run_beside_the_planner(capsys: pytest.CaptureFixture) -> None:
    """``lightning-par plan --config ... --check 1``: the first layout's pipeline ranks, each with its model states
    and peak from the dry run beside the planner's; a command without the config's model is refused first."""
    from lightning_par.cli.plan import main as plan

    plan(["--config", str(REPO / "configs" / "hybrid3d.yaml"), "--top", "1", "--check", "1"])
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines()[out.splitlines().index(next(
        line for line in out.splitlines() if line.startswith("Dry runs of the first layouts"))) + 2:] if "|" in line]
    assert rows, out
    for states, peak in ((row[1].split(), row[2].split()) for row in rows):
        assert float(states[0]) == pytest.approx(float(states[1]), rel=0.05, abs=0.005), out
        assert 0.8 <= float(peak[2]) <= 1.25, out
    with pytest.raises(SystemExit, match="--check dry-runs the config's own model"):
        plan(["--model", "llama3-8b", "--seq-len", "4096", "--check"])
