"""ZeRO stages 1-3 and HSDP: parity with one process, model-state bytes per rank, clipping, accumulation."""

from __future__ import annotations

import functools

import pytest
import torch
from parity import assert_parity, layout_run, reference_run
from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule

PARITY_RTOL = 1e-5


make_module = functools.partial(SGDLlamaLM, **MODEL)


def make_strategy(stage: int = 3, **kwargs):
    from lightning_par import DataParallelStrategy, ZeroStrategy

    return ZeroStrategy(zero_stage=stage, **kwargs) if stage else DataParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("world_size", "strategy_kwargs"),
    [
        (2, dict(stage=1)),
        (4, dict(stage=1)),
        (2, dict(stage=2)),
        (4, dict(stage=2)),
        (2, dict(stage=3)),
        (4, dict(stage=3)),
        (4, dict(stage=3, replicate_size=2)),  # HSDP 2 x 2
        (4, dict(stage=2, replicate_size=2)),
        (2, dict(stage=3, reshard_after_forward=False)),
        (2, dict(stage=3, keep_gathered_blocks=1, prefetch_blocks=2)),
        (2, dict(stage=3, activation_checkpointing="full")),
        (2, dict(stage=2, activation_checkpointing="selective", activation_checkpointing_every=2)),
    ],
    ids=lambda v: "-".join(f"{k}{x}" for k, x in v.items()) if isinstance(v, dict) else f"ws{v}",
)
def test_zero_matches_single_process(world_size: int, strategy_kwargs: dict) -> None:
    expected = reference_run(make_module, make_datamodule, dp=world_size, steps=STEPS)
    actual = layout_run(make_module, make_datamodule, functools.partial(make_strategy, **strategy_kwargs),
                        world_size=world_size, steps=STEPS)
    loss_error, weight_error = assert_parity(actual, expected, rtol=PARITY_RTOL)
    print(f"zero {strategy_kwargs} ws={world_size}: loss rel err {loss_error:.1e}, weights {weight_error:.1e}")


def test_zero3_units_of_several_blocks_match_single_process() -> None:
    """Five blocks in units of two ([0, 1], [2, 3], [4]): the last two units stay gathered for backward (all their
    blocks are among the last three), prefetching reaches two units ahead (three blocks)."""
    make_deeper = functools.partial(SGDLlamaLM, **{**MODEL, "n_layers": 5})
    expected = reference_run(make_deeper, make_datamodule, dp=2, steps=STEPS)
    grouped = functools.partial(make_strategy, stage=3, blocks_per_unit=2, keep_gathered_blocks=3, prefetch_blocks=3)
    actual = layout_run(make_deeper, make_datamodule, grouped, world_size=2, steps=STEPS)
    loss_error, weight_error = assert_parity(actual, expected, rtol=PARITY_RTOL)
    print(f"zero3 units of 2 blocks: loss rel err {loss_error:.1e}, weights {weight_error:.1e}")


def test_bf16_compute_from_fp32_shards_stays_close_to_fp32() -> None:
    """Stage 3 mixed precision: blocks compute in bf16, shards and the optimizer stay fp32."""
    expected = reference_run(make_module, make_datamodule, dp=2, steps=STEPS)
    mixed = functools.partial(make_strategy, stage=3, param_dtype="bf16", reduce_dtype="fp32")
    actual = layout_run(make_module, make_datamodule, mixed, world_size=2, steps=STEPS)
    loss_error, weight_error = assert_parity(actual, expected, rtol=5e-2)
    assert weight_error > 1e-6, "bf16 compute left the run identical to fp32: the policy was not applied"
    assert all(t.dtype == torch.float32 for t in actual.state_dict.values())
    print(f"bf16 compute, fp32 reduce: loss rel err {loss_error:.1e}, weights {weight_error:.1e}")


def _meta_init(rank: int, world_size: int, strategy: str) -> dict:
    import lightning

    from lightning_par.models import LlamaLM

    from lightning_par import PipelineParallelStrategy

    chosen = PipelineParallelStrategy(microbatches=2) if strategy == "pipeline_parallel" else strategy
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=chosen, max_steps=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0)
    with trainer.init_module(empty_init=True):
        module = LlamaLM(**{k: v for k, v in MODEL.items()})
    was_meta = all(p.is_meta for p in module.parameters())
    trainer.fit(module, datamodule=make_datamodule(batch_size=4))
    # Block 1: on the second pipeline stage, whose rank holds it (rank 0 reads the consolidated copy).
    q = dict(module.named_parameters()).get("model.layers.1.attention.q_proj.weight", torch.empty(64, 32))
    q_local = q.to_local() if hasattr(q, "to_local") else q
    full = trainer.strategy.consolidated_state_dict() or {"q": q_local}  # whole tensors on rank 0 only
    return {"was_meta": was_meta, "q_local_rows": q_local.shape[0], "q_rows": q.shape[0],
            "q_std": float(full.get("model.layers.1.attention.q_proj.weight", q_local).std()),
            "finite": all(bool(torch.isfinite(v).all()) for v in full.values()),
            "rope_ok": bool(torch.allclose(module.model.rope_cos.cpu(), torch.cos(
                torch.arange(16.0)[:, None] / 10000 ** (torch.arange(0, 8, 2) / 8)), atol=1e-6))}


@pytest.mark.parametrize("strategy", ["zero3", "data_parallel", "tensor_parallel", "pipeline_parallel"])
def test_meta_device_initialization(strategy: str) -> None:
    """Trainer.init_module(empty_init=True): no weights until the strategy places them (after sharding). Tensor
    parallel checks its model map and pipeline parallel traces the network without allocating the model."""
    from harness import run_distributed

    for result in run_distributed(_meta_init, 2, strategy):
        assert result["was_meta"] and result["finite"] and result["rope_ok"], result
        expected_rows = result["q_rows"] // 2 if strategy in ("zero3", "tensor_parallel") else result["q_rows"]
        assert result["q_local_rows"] == expected_rows  # zero3: each rank only ever allocated its shard
        assert result["q_std"] == pytest.approx(0.02, rel=0.2)  # the model's own init, not a default one


@pytest.mark.parametrize(
    ("stage", "world_size", "sharded"), [(0, 2, False), (1, 2, False), (2, 4, False), (3, 4, False), (2, 4, True),
                                         (3, 2, True)], ids=lambda v: str(v))
def test_accumulation_and_global_norm_clipping_match_single_process(stage: int, world_size: int,
                                                                    sharded: bool) -> None:
    """Clipping must use the norm of the whole gradient, whatever piece of it each rank holds; gradients reduced
    once per step or on every accumulated batch (``sharded_accumulation``) sum to the same."""
    clip = 0.05  # well below the gradient norm of this model, so every step is clipped
    expected = reference_run(make_module, make_datamodule, dp=world_size, steps=STEPS, accumulate=2,
                             gradient_clip_val=clip)
    strategy = functools.partial(make_strategy, stage=stage, **({"sharded_accumulation": True} if sharded else {}))
    actual = layout_run(make_module, make_datamodule, strategy, world_size=world_size, steps=STEPS, accumulate=2,
                        trainer_kwargs={"gradient_clip_val": clip})
    loss_error, weight_error = assert_parity(actual, expected, rtol=PARITY_RTOL)
    print(f"stage {stage} ws={world_size} acc=2 sharded={sharded} clip={clip}: loss rel err {loss_error:.1e}, "
          f"weights {weight_error:.1e}")


def _local_bytes(tensor) -> int:
    """Bytes of ``tensor`` this rank holds (its shard of a DTensor; 0 for None)."""
    if tensor is None:
        return 0
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def _model_state_bytes(rank: int, world_size: int, stage: int, cp: int = 1) -> dict:
    """Bytes of parameters, gradients and optimizer states this rank holds just before an optimizer step; with ``cp``
    context-parallel ranks among the ``world_size``."""
    import lightning
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_par.models import LlamaLM

    class Count(lightning.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step != 1:  # step 0 created the optimizer states; count on step 1
                return
            params = list(pl_module.parameters())
            inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
            self.counts = {
                "params": sum(_local_bytes(p) for p in params),
                "grads": sum(_local_bytes(p.grad) for p in params),
                "optimizer": sum(_local_bytes(v) for state in inner.state.values() for v in state.values()
                                 if hasattr(v, "numel") and v.dim() > 0),
                "numel": sum(p.numel() for p in params),  # global: DTensor.numel() is the full size
            }

    count = Count()
    strategy = "data_parallel" if stage == 0 else f"zero{stage}"
    if cp > 1:
        from lightning_par import Hybrid3DStrategy

        strategy = Hybrid3DStrategy(context_parallel_size=cp, zero_stage=stage)
    # Many similar-sized tensors so that ZeroRedundancyOptimizer's per-tensor partition can balance.
    module = LlamaLM(vocab_size=64, dim=64, n_layers=6, n_heads=4, max_seq_len=16)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2,
                                callbacks=[count], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=make_datamodule())
    return count.counts


# ZeRO paper, section 5 / figure 1, for fp32 Adam: weights 4, gradients 4, optimizer states 8 bytes/param.
ZERO_BYTES_PER_PARAM = {
    0: lambda n: 4 + 4 + 8,
    1: lambda n: 4 + 4 + 8 / n,
    2: lambda n: 4 + (4 + 8) / n,
    3: lambda n: 16 / n,
}


@pytest.mark.parametrize(("world_size", "cp"), [(2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_per_rank_follow_the_zero_paper(stage: int, world_size: int, cp: int) -> None:
    """N is every rank that holds the same parameters: context-parallel ranks partition the states with the
    data-parallel ones (Megatron-Core's distributed optimizer over dp x cp)."""
    from harness import run_distributed

    per_rank = run_distributed(_model_state_bytes, world_size, stage, cp)
    expected = ZERO_BYTES_PER_PARAM[stage](world_size)
    for rank, counts in enumerate(per_rank):
        measured = (counts["params"] + counts["grads"] + counts["optimizer"]) / counts["numel"]
        print(f"stage {stage} N={world_size} rank {rank}: {measured:.2f} bytes/param (paper {expected:.2f}) {counts}")
        # Allowed: 10% (tensors that do not split evenly); measured: within 0.1%.
        assert measured == pytest.approx(expected, rel=0.10), (rank, counts)


def _gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of gradient this rank holds for ``module``: its parameters' ``.grad`` (this rank's shard of a
    DTensor), whole gradients FSDP2 accumulates inside its units, and ZeRO-2's reduced running sums."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_par.parallel.record import layout_record

    total = sum(_local_bytes(p.grad) for p in module.parameters())
    # The modules of a unit of several blocks share one FSDP2 state: count each state once.
    states = {id(state): state for state in (unit._get_fsdp_state() for unit in module.modules()
                                             if isinstance(unit, FSDPModule))}
    for state in states.values():
        for group in state._fsdp_param_groups:
            for param in group.fsdp_params:
                total += _local_bytes(param.unsharded_accumulated_grad)
                total += _local_bytes(getattr(getattr(param, "_unsharded_param", None), "grad", None))
    record = layout_record(module)
    if record is not None and record.gradient_reducer is not None:
        total += sum(_local_bytes(t) for t in record.gradient_reducer._accumulated.values())
    return total


def _gradient_collectives_per_micro_batch(rank: int, world_size: int, stage: int, sharded: bool,
                                          pp: int = 1) -> dict:
    import lightning
    import torch.distributed as dist

    from lightning_par import Hybrid3DStrategy, ZeroStrategy
    from lightning_par.models import LlamaLM

    from lightning_par.parallel.background_reduce import BackgroundReduceScatter

    # The collective each stage reduces gradients with: stage 2 reduces to owners, stage 3 (FSDP2)
    # reduce-scatters (on gloo through BackgroundReduceScatter). Count the calls made during each micro-batch, and
    # the gradient bytes held after it.
    owner = {2: dist, 3: BackgroundReduceScatter}[stage]
    name = {2: "reduce", 3: "__call__"}[stage]
    original, calls = getattr(owner, name), []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(owner, name, counting)
    per_batch: list[int] = []
    held: list[int] = []

    class Count(lightning.Callback):
        def on_train_start(self, trainer, pl_module):
            calls.clear()  # the set-up's check of the units on a small copy reduces its gradients too

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            per_batch.append(len(calls))
            calls.clear()
            aside = trainer.strategy.parallelized._reduced.values()  # ZeRO-2 under a pipeline: the owners' sums
            held.append(_gradient_bytes(pl_module) + sum(_local_bytes(t) for t in aside))

    # Many similar-sized tensors so that ZeRO-2's per-tensor partition balances.
    module = LlamaLM(vocab_size=64, dim=64, n_layers=6, n_heads=4, max_seq_len=16)
    strategy = (ZeroStrategy(zero_stage=stage, sharded_accumulation=sharded) if pp == 1 else
                Hybrid3DStrategy(pipeline_parallel_size=pp, zero_stage=stage, sharded_accumulation=sharded,
                                 microbatches=2))
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2,
                                accumulate_grad_batches=3, callbacks=[Count()], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0)
    trainer.fit(module, datamodule=make_datamodule())
    return {"collectives": per_batch, "held": held, "numel": sum(p.numel() for p in module.parameters())}


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_reduces_gradients_once_per_optimizer_step(stage: int) -> None:
    """Reduced once: between accumulated batches every rank holds the whole fp32 gradient."""
    from harness import run_distributed

    for result in run_distributed(_gradient_collectives_per_micro_batch, 2, stage, False):
        assert [n > 0 for n in result["collectives"]] == [False, False, True, False, False, True], result
        for held in result["held"][:2]:  # after the first two of three accumulated batches
            assert held == pytest.approx(4 * result["numel"], rel=0.05), result


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_accumulation_keeps_a_ranks_part_of_the_gradient(stage: int) -> None:
    """Reduced on every accumulated batch: between them each of N ranks holds 1/N of the fp32 gradient (theory
    within 5%), for N times the reduction traffic."""
    from harness import run_distributed

    for result in run_distributed(_gradient_collectives_per_micro_batch, 2, stage, True):
        assert all(n > 0 for n in result["collectives"]), result
        for held in result["held"][:2]:
            assert held == pytest.approx(4 * result["numel"] / 2, rel=0.05), result


@pytest.mark.parametrize("stage", [2, 3])
def test_under_a_pipeline_gradients_are_reduced_after_every_batch(stage: int) -> None:
    """pp2 x dp2: the schedule holds a stage's whole gradients only while it runs; after every accumulated batch
    ZeRO-2 reduces them to their owners (which keep the sum aside) and FSDP2 reduce-scatters them, so between
    batches each of the 2 data-parallel ranks holds half of its stage's fp32 gradient (theory within 5%), with
    sharded_accumulation or without. (Unreduced, FSDP2 would hold the whole fp32 gradient; its reduce-scatters under
    a pipeline are its own, not counted here.)"""
    from harness import run_distributed

    for result in run_distributed(_gradient_collectives_per_micro_batch, 4, stage, False, 2):
        if stage == 2:
            assert all(n > 0 for n in result["collectives"]), result
        for held in result["held"][:2]:
            assert held == pytest.approx(4 * result["numel"] / 2, rel=0.05), result


def _gathers_per_step(rank: int, world_size: int, knobs: dict) -> dict:
    import os

    import torch.distributed as dist

    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    dist.init_process_group("gloo")
    from lightning_par.layout.config import ParallelConfig
    from lightning_par.models import LlamaLM
    from lightning_par.parallel.comm import flight_recorder_trace
    from lightning_par.parallel.compose import parallelize
    from lightning_par.parallel.model_map import derive_model_map

    torch.manual_seed(0)
    model = LlamaLM(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16)
    config = ParallelConfig(dp_shard=2, zero_stage=3, **knobs).validate(2)
    from lightning_par.parallel.mesh import build_mesh
    handle = parallelize(model, build_mesh(config, "cpu"), config, derive_model_map(model))
    before = len(flight_recorder_trace()["entries"])
    tokens = torch.randint(0, 64, (2, 17))
    model.loss_fn(handle.module(tokens[:, :-1]), tokens[:, 1:]).backward()
    entries = flight_recorder_trace()["entries"][before:]
    states = [block._get_fsdp_state() for block in model.model.layers.children()]
    prefetch = [[states.index(target) for target in state._states_to_forward_prefetch] for state in states]
    dist.destroy_process_group()
    return {"gathers": sum("all_gather" in e["profiling_name"] for e in entries), "forward_prefetch": prefetch}


@pytest.mark.parametrize(("knobs", "gathers", "prefetch"), [
    (dict(), 4 + 1 + 4, [[], [], [], []]),  # the blocks and the root in forward, the blocks again in backward
    (dict(keep_gathered_blocks=3, prefetch_blocks=2), 4 + 1 + 1, [[1, 2], [2, 3], [3], []]),
    (dict(reshard_after_forward=False), 4 + 1, [[], [], [], []]),
    # units [0, 1] and [2, 3]: two gathers in forward and two in backward
    (dict(blocks_per_unit=2), 2 + 1 + 2, [[], [], [], []]),
    # units [0, 1, 2] and [3]: [3] stays gathered; two blocks ahead is one unit ahead (named by its first block)
    (dict(blocks_per_unit=3, keep_gathered_blocks=1, prefetch_blocks=2), 2 + 1 + 1, [[3], [3], [3], []]),
])
def test_zero3_gathers_what_its_controls_say(knobs: dict, gathers: int, prefetch: list) -> None:
    """A step of a 4-block model under ZeRO-3 all-gathers each unit (a block, or ``blocks_per_unit`` blocks) in
    forward and again in backward except the units kept gathered; prefetching changes when the gathers start (each
    unit names the next ones), not their number."""
    from harness import run_distributed

    for result in run_distributed(_gathers_per_step, 2, knobs):
        assert result == {"gathers": gathers, "forward_prefetch": prefetch}, result


def test_zero3_units_are_chosen_from_the_blocks_and_the_memory() -> None:
    """Units move about 25 MiB per collective (DDP's bucket), at least two of them where a gather overlaps compute on
    a stream of its own; one is prefetched; the last unit is kept gathered, and on CPUs more, as far as a tenth of
    the memory allows; a user's blocks_per_unit stays."""
    from lightning_par.layout.zero_units import choose_units

    mib = 2**20
    small = choose_units([3 * mib] * 8)  # 9 blocks would make 27 MiB, but then one unit: half the blocks
    assert (small.blocks_per_unit, small.keep_gathered_blocks, small.prefetch_blocks) == (4, 4, 4)
    assert choose_units([5 * mib] * 40).blocks_per_unit == 5  # 25 MiB
    assert choose_units([30 * mib] * 8).blocks_per_unit == 1  # a block alone is large enough
    # a tenth of 300 MiB holds three units of 3 blocks of 3 MiB, not of 4
    assert choose_units([3 * mib] * 8, memory_bytes=300 * mib).blocks_per_unit == 3
    # on a CPU, memory enough for every block: all kept gathered into backward (no all-gather there), at most the
    # blocks; on an accelerator the last unit alone (a kept unit is held at the activations' peak)
    assert choose_units([3 * mib] * 8, memory_bytes=12 * 2**30, accelerator=False).keep_gathered_blocks == 8
    assert choose_units([3 * mib] * 8, memory_bytes=12 * 2**30).keep_gathered_blocks == 4
    # 10 blocks' worth: 2 units running and prefetched, one unit of 3 kept
    assert choose_units([3 * mib] * 8, memory_bytes=300 * mib, accelerator=False).keep_gathered_blocks == 3
    assert choose_units([3 * mib] * 8, prefetch=False).prefetch_blocks == 0  # a pipeline schedule orders the blocks
    assert choose_units([3 * mib] * 8, accelerator=False).blocks_per_unit == 8  # CPUs: no stream to overlap a gather on
    assert choose_units([3 * mib] * 8, blocks_per_unit=3).keep_gathered_blocks == 3
    assert "units of 4 blocks (12.0 MiB gathered" in small.describe() and "the last 4 blocks kept" in small.describe()


SMALL_HOST = 2 * 2**20  # a host memory in which a tenth holds a few blocks of the model below


def _zero3_defaults(rank: int, world_size: int, small_host_rank: int | None) -> dict:
    import lightning

    from lightning_par import ZeroStrategy
    from lightning_par.models import LlamaLM
    from lightning_par.strategies import unit_controls

    if rank == small_host_rank:  # this rank alone would choose otherwise
        unit_controls.host_memory = lambda: SMALL_HOST
    strategy = ZeroStrategy()
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0)
    model = LlamaLM(vocab_size=64, dim=32, n_layers=6, n_heads=4, max_seq_len=16)
    trainer.fit(model, datamodule=make_datamodule())
    config = strategy.parallel_config
    return {"chosen": {name: getattr(config, name) for name in ("blocks_per_unit", "keep_gathered_blocks",
                                                                  "prefetch_blocks")},
            "block_bytes": [4 * sum(p.numel() for p in block.parameters()) for block in model.model.layers.values()]}


def test_zero3_runs_the_units_it_chose_by_default() -> None:
    """Gather controls are chosen from the model unless given: on CPUs 6 small blocks become one unit, kept gathered
    (a few KiB against the host's memory). Every rank chooses from the least memory of any rank: one with little
    memory makes every rank choose as it would."""
    from harness import run_distributed

    from lightning_par.layout.zero_units import choose_units

    for result in run_distributed(_zero3_defaults, 2, None):
        assert result["chosen"] == {"blocks_per_unit": 6, "keep_gathered_blocks": 6, "prefetch_blocks": 6}, result
    results = run_distributed(_zero3_defaults, 2, 1)
    small = choose_units(results[0]["block_bytes"], memory_bytes=SMALL_HOST / 2, accelerator=False)
    expected = {"blocks_per_unit": small.blocks_per_unit, "keep_gathered_blocks": small.keep_gathered_blocks,
                "prefetch_blocks": small.prefetch_blocks}
    assert expected["blocks_per_unit"] < 6, expected  # the small host alone chooses otherwise
    assert [result["chosen"] for result in results] == [expected, expected], results


def _background_reduce_scatters(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.models import LlamaLM
    from lightning_par.parallel.background_reduce import BackgroundReduceScatter
    from lightning_par.parallel.compose import parallelize
    from lightning_par.parallel.model_map import derive_model_map

    dist.init_process_group("gloo")
    in_flight: list[int] = []
    original = BackgroundReduceScatter.__call__

    def spying(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        in_flight.append(len(self.pending))
        return result

    BackgroundReduceScatter.__call__ = spying
    torch.manual_seed(0)
    model = LlamaLM(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16)
    config = ParallelConfig(dp_shard=world_size, zero_stage=3).validate(world_size)
    from lightning_par.parallel.mesh import build_mesh
    handle = parallelize(model, build_mesh(config, "cpu"), config, derive_model_map(model))
    torch.manual_seed(rank)
    tokens = torch.randint(0, 64, (2, 17))

    def gradients() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model.loss_fn(handle.module(tokens[:, :-1]), tokens[:, 1:]).backward()
        return [p.grad.full_tensor() for p in model.parameters()]

    ours = gradients()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    left = sum(len(m._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm.pending) for m in units)
    for unit in units:
        unit.set_custom_reduce_scatter(DefaultReduceScatter())
    fsdp2s = gradients()
    dist.destroy_process_group()
    return {"in_flight": in_flight, "left": left,
            "max_difference": max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, fsdp2s))}


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_reduce_scatters_run_behind_backward_and_match_fsdp2s(world_size: int) -> None:
    """On gloo each block's reduce-scatter is an all-reduce left running while backward goes on (at most 2 at a
    time), all finished when backward ends; the gradients are FSDP2's own reduce-scatter's."""
    from harness import run_distributed

    for result in run_distributed(_background_reduce_scatters, world_size):
        assert len(result["in_flight"]) == 4 + 1, result  # the blocks, then the root
        assert max(result["in_flight"]) == 2 and result["left"] == 0, result
        assert result["max_difference"] <= 1e-6, result


def test_background_reduce_scatter_finishes_at_once_where_fsdp2_reads_the_output() -> None:
    """Deferred only where FSDP2 just views the output as the new gradient shards: not after a sum (FSDP2 divides),
    into an existing gradient (+=), through a cast (reduce dtype), under gradient hooks, or outside a backward."""
    import torch.distributed as dist

    from lightning_par.parallel.background_reduce import BackgroundReduceScatter

    layer = torch.nn.Linear(4, 4)
    comm = BackgroundReduceScatter(layer, [])
    output = torch.empty(8)
    assert comm._output_left_alone(output, dist.ReduceOp.AVG)
    assert not comm._output_left_alone(output, dist.ReduceOp.SUM)
    assert not comm._output_left_alone(output.bfloat16(), dist.ReduceOp.AVG)
    layer.weight.grad = torch.zeros_like(layer.weight)
    assert not comm._output_left_alone(output, dist.ReduceOp.AVG)
    layer.weight.grad = None
    handle = layer.bias.register_post_accumulate_grad_hook(lambda p: None)
    assert not comm._output_left_alone(output, dist.ReduceOp.AVG)
    handle.remove()
    assert comm._output_left_alone(output, dist.ReduceOp.AVG)
    assert not comm._finish_when_backward_ends()


def _foreach_choices(rank: int, world_size: int) -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    from lightning_par.parallel.foreach import foreach_over_dtensors

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size,))
    shards = [torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh)) for _ in range(2)]
    plain = [torch.nn.Parameter(torch.ones(4))]
    optimizers = [torch.optim.AdamW(shards), torch.optim.AdamW(shards, foreach=False),
                  torch.optim.AdamW([{"params": shards}, {"params": plain}]), torch.optim.AdamW(shards + plain)]
    for optimizer in optimizers:
        foreach_over_dtensors(optimizer)
    dist.destroy_process_group()
    return [[group["foreach"] for group in optimizer.param_groups] for optimizer in optimizers]


def test_dtensor_parameters_step_with_foreach_where_torch_was_left_to_choose() -> None:
    """Only a group of DTensors on one mesh whose ``foreach`` was left to torch; a user's False stays, plain
    tensors (alone or mixed in) keep torch's per-tensor loop."""
    from harness import run_distributed

    assert run_distributed(_foreach_choices, 2)[0] == [[True], [False], [True, None], [None]]


class _ReadsABlocksWeight(torch.nn.Module):
    """A network that reads a parameter of its first block outside the block (not by calling the block's module)."""

    def __init__(self) -> None:
        super().__init__()
        from clients import Decoder

        self.net = Decoder()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.net(tokens)
        return logits + torch.nn.functional.linear(logits[..., :32], self.net.layers[0].attn.q_proj.weight).sum(-1,
                                                                                                         keepdim=True)


def _refused_units(rank: int, world_size: int) -> str:
    import lightning
    from clients import CallsItsModel, client_data

    from lightning_par import ZeroStrategy

    module = CallsItsModel()
    module.model = _ReadsABlocksWeight()
    # Every block freed after its forward (a small model would otherwise keep them all gathered).
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                                strategy=ZeroStrategy(zero_stage=3, keep_gathered_blocks=0),
                                enable_checkpointing=False, enable_progress_bar=False)
    try:
        trainer.fit(module, client_data("calls_its_model", 4))
    except ValueError as error:
        return f"{trainer.global_step}: {error}"
    return "trained"


def test_units_that_cannot_run_as_the_network_runs_them_are_refused_at_set_up() -> None:
    """A block's parameter read outside the block meets its shard there: the small copy cut into the run's units fails
    in set-up, on every rank, naming where (without the check, step 0 fails inside the model)."""
    from harness import run_distributed

    messages = set(run_distributed(_refused_units, 2))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("0: zero_stage=3's units do not compute what CallsItsModel computes: it raises in "
                              "'model'"), message
