"""hybrid3d: every technique on one mesh; parity with one process for the combinations it composes."""

from __future__ import annotations

import functools

import pytest
from harness import run_distributed
from parity import assert_fails_on_every_rank, assert_layout_matches
from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule

PARITY_RTOL = 1e-5
make_module = functools.partial(SGDLlamaLM, **{**MODEL, "n_layers": 4, "n_kv_heads": 4})
make_moe_module = functools.partial(SGDLlamaLM, **{**MODEL, "moe_experts": 4, "moe_top_k": 2})
make_tied_module = functools.partial(SGDLlamaLM, **{**MODEL, "n_layers": 4, "n_kv_heads": 4, "tie_embeddings": True})
MODULES = {"dense": make_module, "moe": make_moe_module, "tied": make_tied_module}


def make_strategy(**kwargs):
    from lightning_par import Hybrid3DStrategy

    return Hybrid3DStrategy(**kwargs)


@pytest.mark.parametrize(
    ("world_size", "dp", "kwargs", "accumulate", "clip", "model"),
    [
        # 8 ranks: each of 2 replicas is a 2-stage pipeline of tensor-parallel pairs with sequence parallel.
        (8, 2, dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True,
                    microbatches=2), 2, 0.05, "dense"),
        (4, 1, dict(tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="gpipe", microbatches=2),
         1, None, "dense"),
        (4, 2, dict(tensor_parallel_size=2), 2, 0.05, "dense"),  # zero_stage 0: reduce_gradients, not DDP
        (4, 2, dict(tensor_parallel_size=2, expert_parallel_size=2), 2, None, "moe"),
        # ZeRO-1 inside a pipeline (Megatron's distributed optimizer): each stage's states over its dp ranks.
        (4, 2, dict(data_parallel_size=2, pipeline_parallel_size=2, zero_stage=1, microbatches=2), 2, 0.05, "dense"),
        # FSDP2 inside each stage (torchtitan's PP x FSDP): every stage a root, one reduce-scatter per batch; the
        # embedding and head tied across the stages; two stages per rank; and with tensor parallel under it.
        (4, 2, dict(data_parallel_size=2, pipeline_parallel_size=2, zero_stage=3, microbatches=2), 2, 0.05, "tied"),
        (4, 2, dict(data_parallel_size=2, pipeline_parallel_size=2, zero_stage=3, microbatches=2,
                    pipeline_schedule="interleaved_1f1b"), 1, None, "dense"),
        (8, 2, dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=3,
                    sequence_parallel=True, microbatches=2), 2, 0.05, "dense"),
        # ZeRO-1 over tensor-parallel shards (Megatron's distributed optimizer), alone and inside a pipeline.
        (4, 2, dict(tensor_parallel_size=2, zero_stage=1), 2, None, "dense"),  # unclipped: a scale would show
        (8, 2, dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1,
                    sequence_parallel=True, microbatches=2, pipeline_schedule="zbv"), 1, 0.05, "dense"),
        (8, 4, dict(data_parallel_size=4, replicate_size=2, pipeline_parallel_size=2, zero_stage=1, microbatches=2),
         1, None, "dense"),
        # Experts with ZeRO-3 (torchtitan's EP x FSDP): the dense parts sharded over dp, each expert over the
        # ranks holding it: none at dp2 x ep2, two at dp4 x ep2, two and replicated twice under HSDP.
        (2, 2, dict(expert_parallel_size=2, zero_stage=3), 2, 0.05, "moe"),
        (4, 4, dict(expert_parallel_size=2, zero_stage=3), 1, 0.05, "moe"),
        (8, 8, dict(data_parallel_size=8, replicate_size=2, expert_parallel_size=2, zero_stage=3), 2, None, "moe"),
        (4, 2, dict(tensor_parallel_size=2, expert_parallel_size=2, zero_stage=3), 2, 0.05, "moe"),
        # Experts inside pipeline stages: the routers' losses added in backward, and reported, by each stage.
        (4, 2, dict(data_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=2, microbatches=2), 2, 0.05,
         "moe"),
        (8, 4, dict(data_parallel_size=4, pipeline_parallel_size=2, expert_parallel_size=2, zero_stage=3,
                    microbatches=2), 1, 0.05, "moe"),
    ],
    ids=["dp2xtp2xpp2-sp-acc2-clip", "pp2xtp2-gpipe", "dp2xtp2-zero0-acc2-clip",
         "tp2xep2-dp2-acc2", "pp2xdp2-zero1-acc2-clip", "pp2xdp2-zero3-tied-acc2-clip",
         "pp2xdp2-zero3-interleaved", "dp2xtp2xpp2-zero3-sp-acc2-clip",
         "dp2xtp2-zero1-acc2", "dp2xtp2xpp2-zero1-sp-zbv-clip", "pp2xdp2x2-zero1", "ep2xdp2-zero3-acc2-clip", "ep2xdp4-zero3-clip", "ep2xhsdp2x4-zero3-acc2", "tp2xep2xdp2-zero3-acc2-clip",
         "pp2xep2xdp2-acc2-clip", "pp2xep2xdp4-zero3-clip"],
)
# ZeRO-3 x tp2 with sequence parallel is test_tensor_parallel.py's dp2xtp2-sp-acc2-clip (the same layout), dp2 x cp2
# test_context_parallel.py's, ep2 inside dp4 test_experts.py's.
def test_hybrid_layout_matches_single_process(world_size: int, dp: int, kwargs: dict, accumulate: int, clip,
                                              model: str) -> None:
    assert_layout_matches(MODULES[model], make_datamodule,
                          functools.partial(make_strategy, **kwargs), world_size=world_size, dp=dp, steps=STEPS,
                          accumulate=accumulate, clip=clip, rtol=PARITY_RTOL, label=f"hybrid3d {kwargs}")


def test_a_torch_that_reduces_before_the_weight_pass_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from lightning_par.parallel.pipeline.split import check_weight_pass_with_zero3

    check_weight_pass_with_zero3("zbv", 3)  # this torch has the runtime's REDUCE_GRAD
    monkeypatch.delattr(_PipelineStageBase, "perform_reduce_grad")
    check_weight_pass_with_zero3("1f1b", 3)  # its whole backward settles the gradients itself
    check_weight_pass_with_zero3("dualpipev", 1)
    with pytest.raises(ValueError, match=r"pipeline_schedule='dualpipev' with zero_stage=3 needs torch's pipeline "
                                         r"runtime to reduce FSDP2's gradients after each stage's last"):
        check_weight_pass_with_zero3("dualpipev", 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(data_parallel_size=4, replicate_size=3), r"replicate_size=3 does not divide data_parallel_size=4"),
        (dict(pipeline_parallel_size=2, save_distributed_checkpoint=False), r"pipeline_parallel_size=2: each rank saves its own stages"),
        (dict(tensor_parallel_size=0), r"tensor_parallel_size must be a positive integer, got 0"),
    ],
)
def test_bad_layouts_are_refused_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_strategy(**kwargs)


def test_every_knob_reaches_the_layout() -> None:
    knobs = dict(sequence_parallel=True, loss_parallel=True, context_parallel_method="ring", pipeline_schedule="zbv",
                 microbatches=8, virtual_stages=3, pipeline_balance="profile", activation_checkpointing="selective",
                 activation_checkpointing_every=2, reshard_after_forward=False, param_dtype="bf16",
                 reduce_dtype="fp32", cpu_offload=True, zero_stage=3, tensor_parallel_size=2, replicate_size=2,
                 data_parallel_size=4)
    config = make_strategy(**knobs).parallel_config
    assert (config.sequence_parallel, config.loss_parallel, config.cp_method, config.pp_schedule) == (True, True,
                                                                                                   "ring", "zbv")
    assert (config.microbatches, config.pp_virtual_stages, config.pp_balance) == (8, 3, "profile")
    assert (config.activation_checkpointing, config.activation_checkpointing_every) == ("selective", 2)
    assert (config.reshard_after_forward, config.param_dtype, config.reduce_dtype, config.cpu_offload) == (
        False, "bf16", "fp32", True)
    assert (config.zero_stage, config.tp, config.dp_replicate, config.dp_shard) == (3, 2, 2, 2)
    ddp = make_strategy(bucket_cap_mb=50.0, static_graph=True, gradient_compression="bf16").parallel_config
    assert (ddp.ddp_bucket_cap_mb, ddp.ddp_static_graph, ddp.gradient_compression) == (50.0, True, "bf16")


def test_sizes_that_do_not_fill_the_world_fail_on_every_rank() -> None:
    assert_fails_on_every_rank(make_module, make_datamodule,
                               functools.partial(make_strategy, tensor_parallel_size=2, pipeline_parallel_size=2),
                               world_size=2, message="pipeline_parallel_size=2 x tensor_parallel_size=2 = 4 does not divide the world size 2")


def test_a_tied_weight_two_fsdp_stages_of_one_rank_would_share_fails_on_every_rank() -> None:
    assert_fails_on_every_rank(make_tied_module, make_datamodule,
                               functools.partial(make_strategy, pipeline_parallel_size=2, zero_stage=3,
                                                 pipeline_schedule="interleaved_1f1b", microbatches=2),
                               world_size=2, message="the tied parameter model.embed_tokens.weight = "
                                                     "model.lm_head.weight would belong to two of them")


def _planned_runs(rank: int, world_size: int) -> list[dict]:
    import lightning

    import lightning_par
    from lightning_par.planner import ClusterSpec, ModelSpec
    from lightning_par.planner.runtime import plan_for_run

    runs = []
    for strategy in (lightning_par.AutoParallelStrategy(),
                     # Everything fixed but tp, with one data-parallel rank: the planner must give tp the 2 ranks.
                     make_strategy(data_parallel_size=1, tensor_parallel_size="auto", microbatches=2)):
        trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2,
                                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False)
        module = make_module()
        trainer.fit(module, datamodule=make_datamodule())
        runs.append({"chosen": strategy.parallel_config, "ranked": [c.config for c in strategy.planned_layouts],
                     "loss": float(trainer.callback_metrics["train_loss"])})
    expected = plan_for_run(ModelSpec.from_module(make_module()), ClusterSpec.from_preset("cpu", devices_per_node=2),
                            batch_size_per_rank=2, seq_len=16)
    runs[0]["expected"] = expected[0].config
    return runs


def test_sizes_left_auto_are_planned_at_setup() -> None:
    auto, tp_only = run_distributed(_planned_runs, 2)[0]
    chosen = auto["chosen"]
    # The layout that ran is the planner's first choice, recomputed here from the same inputs.
    assert (chosen.tp, chosen.pp, chosen.cp, chosen.dp, chosen.zero_stage) == (
        auto["expected"].tp, auto["expected"].pp, auto["expected"].cp, auto["expected"].dp,
        auto["expected"].zero_stage)
    assert chosen.activation_checkpointing == auto["expected"].activation_checkpointing
    assert len(auto["ranked"]) > 1 and 0.0 < auto["loss"] < 10.0
    assert (tp_only["chosen"].tp, tp_only["chosen"].dp, tp_only["chosen"].pp) == (2, 1, 1)
    assert all(c.tp == 2 and c.pp == 1 for c in tp_only["ranked"])


def _plan_a_users_own_model(rank: int, world_size: int, spec: dict | None) -> dict:
    import lightning
    from cli_callbacks import TinyCausalTransformer

    import lightning_par
    from lightning_par.data import TokenDataModule

    strategy = lightning_par.AutoParallelStrategy(model_spec=spec, tensor_parallel_size=1, pipeline_parallel_size=1,
                                                  context_parallel_size=1, expert_parallel_size=1)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0)
    datamodule = TokenDataModule(source="synthetic", vocab_size=256, seq_len=16, batch_size=2, num_samples=64)
    try:
        trainer.fit(TinyCausalTransformer(), datamodule=datamodule)
    except ValueError as error:
        return {"error": str(error)}
    return {"planned": len(strategy.planned_layouts), "loss": float(trainer.callback_metrics["train_loss"])}


def test_the_planner_takes_the_architecture_of_a_model_without_a_config_from_model_spec() -> None:
    """A user's own module (torch's TransformerEncoderLayer blocks, no `.config`) under auto_parallel: refused with
    what to give, then planned and trained from model_spec (the sizes, as a YAML mapping would give them)."""
    refused = run_distributed(_plan_a_users_own_model, 2, None)[0]
    assert "give the strategy's model_spec instead" in refused["error"]
    spec = dict(vocab_size=256, hidden=32, layers=2, heads=2, kv_heads=2, ffn_hidden=64, ffn_matrices=2)
    for result in run_distributed(_plan_a_users_own_model, 2, spec):
        assert result["planned"] > 1 and 0.0 < result["loss"] < 10.0
