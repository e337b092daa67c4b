"""pipeline_parallel: stage placement and balancing, and parity with one process for every schedule."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from parity import assert_fails_on_every_rank, assert_layout_matches, assert_parity
from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule

from lightning_par.layout.schedules import SCHEDULES, fewest_microbatches
from lightning_par.parallel.mesh import build_mesh
from lightning_par.parallel.pipeline.split import balance, sizes_from_split_points, stage_indices

PARITY_RTOL = 1e-5
# 8 blocks: 2 stages per rank at pp=4 (interleaved, ZB-V) still get one block each.
make_module = functools.partial(SGDLlamaLM, **{**MODEL, "n_layers": 8})


SPLIT_AFTER_3 = {"blocks": "model.layers", "embedding": "model.embed_tokens", "final_norm": "model.norm",
                 "head": "model.lm_head", "split_points": ["model.layers.3"]}


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


# pp=4 for the schedules whose order depends most on the number of stages (1F1B's warm-up, ZB-V's V);
# GPipe and interleaved 1F1B at pp=2.
PARITY_CASES = [
    pytest.param(2, dict(pipeline_schedule="gpipe", microbatches=2), 1, None, id="pp2-gpipe"),
    pytest.param(2, dict(pipeline_schedule="1f1b", microbatches=2), 2, 0.05, id="pp2-1f1b-acc2-clip"),
    pytest.param(2, dict(pipeline_schedule="interleaved_1f1b", microbatches=2, activation_checkpointing="full"), 1,
                 None, id="pp2-interleaved-recompute"),
    pytest.param(2, dict(pipeline_schedule="zbv", microbatches=2), 1, None, id="pp2-zbv"),
    pytest.param(4, dict(pipeline_schedule="1f1b", microbatches=4), 1, 0.05, id="pp4-1f1b-clip"),
    pytest.param(4, dict(pipeline_schedule="zbv", microbatches=4), 1, None, id="pp4-zbv"),
    pytest.param(2, dict(pipeline_schedule="1f1b", microbatches=2, pipeline_balance="profile"), 1, None,
                 id="pp2-profile"),
    pytest.param(2, dict(pipeline_schedule="gpipe", microbatches=4, model_map=SPLIT_AFTER_3), 1, None,
                 id="pp2-split-points"),
    pytest.param(2, dict(pipeline_schedule="dualpipev", microbatches=4), 2, 0.05,  # one micro-batch per stage at least
                 id="pp2-dualpipev-acc2-clip"),
]
# Every other row of layout.schedules.SCHEDULES, at pp=2 with its fewest micro-batches (at least 2).
PARITY_CASES += [pytest.param(2, dict(pipeline_schedule=name, microbatches=max(2, fewest_microbatches(name, 2, 2))),
                              1, None, id=f"pp2-{name}")
                 for name in SCHEDULES if all(case.values[1]["pipeline_schedule"] != name for case in PARITY_CASES)]


@pytest.mark.parametrize(("world_size", "kwargs", "accumulate", "clip"), PARITY_CASES)
def test_pipeline_matches_single_process(world_size: int, kwargs: dict, accumulate: int, clip) -> None:
    datamodule = functools.partial(make_datamodule, batch_size=4)
    assert_layout_matches(make_module, datamodule,
                          functools.partial(make_strategy, pipeline_parallel_size=world_size, **kwargs),
                          world_size=world_size, dp=1, steps=STEPS, accumulate=accumulate, clip=clip,
                          rtol=PARITY_RTOL, label=f"pipeline_parallel {kwargs} ws={world_size}")


# ------------------------------------------------------------------------------------ partial last batches
EPOCHS, BATCH = 3, 4
# 22 samples in batches of 4: five full batches an epoch and 2 left over, which 2 micro-batches cannot split
# evenly into the shape the stages were built for; 6 validation samples leave a batch of 2.
def _ragged_datamodule():
    from lightning_par.data import TokenDataModule

    return TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=BATCH, num_samples=22,
                           num_val_samples=6)


def _fit_epochs(rank: int, world_size: int, make_layout) -> tuple[list[float], dict | None, float]:
    import lightning

    from parity import RecordLoss

    torch.manual_seed(1234)
    recorder = RecordLoss()
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=make_layout(), max_epochs=EPOCHS,
                                callbacks=[recorder], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(make_module(), datamodule=_ragged_datamodule())
    state = trainer.strategy.consolidated_state_dict()
    return recorder.losses, state if rank == 0 else None, float(trainer.callback_metrics["val_loss"])


def _reference_epochs() -> tuple[list[float], dict, float]:
    """One process over the batches the layout trains: each epoch in the order of Lightning's DistributedSampler
    (``randperm`` seeded by the epoch), full batches only; then the validation loss over every validation sample."""
    from parity import _optimizer_and_scheduler

    datamodule = _ragged_datamodule()
    datamodule.setup("fit")
    dataset = datamodule.train_dataloader().dataset
    torch.manual_seed(1234)
    module = make_module()
    optimizer, scheduler = _optimizer_and_scheduler(module.configure_optimizers())
    losses = []
    for epoch in range(EPOCHS):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(dataset) - BATCH + 1, BATCH):
            inputs, targets = module.split_batch(torch.stack([dataset[int(i)] for i in order[start:start + BATCH]]))
            loss = module.loss_fn(module(inputs), targets)
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
    # the last validation: Lightning averages the batches' losses weighted by their sizes (4 and 2)
    validation = datamodule.val_dataloader().dataset
    with torch.no_grad():
        val_loss = sum(module.loss_fn(module(inputs), targets).item() * len(inputs) for inputs, targets in (
            module.split_batch(torch.stack([validation[i] for i in range(start, min(start + BATCH, len(validation)))]))
            for start in range(0, len(validation), BATCH))) / len(validation)
    return losses, {name: value.detach().clone() for name, value in module.state_dict().items()}, val_loss


@pytest.mark.parametrize("layout", ["pp2", "hybrid3d-pp2xtp2"])
def test_pipelines_train_through_epochs_whose_last_batch_is_partial(layout: str) -> None:
    """A loader that keeps the short last batch of an epoch (drop_last=False, the datamodules' and Lightning's
    default) trains 3 epochs under a pipeline: the short batch is left out, as a fixed global batch does, and the
    run matches one process fed the same full batches. Validation runs after every epoch over every sample (its short
    batch padded through the stages and cut back), and training after it still matches: the stages are prepared
    again for training after an evaluation."""
    from harness import run_distributed
    from parity import ParityRun

    from lightning_par import Hybrid3DStrategy

    make_layout = (functools.partial(make_strategy, pipeline_parallel_size=2, microbatches=2) if layout == "pp2"
                   else functools.partial(Hybrid3DStrategy, pipeline_parallel_size=2, tensor_parallel_size=2,
                                          microbatches=2))
    world_size = 2 if layout == "pp2" else 4
    ranks = run_distributed(_fit_epochs, world_size, make_layout)
    losses, expected_state, val_loss = _reference_epochs()
    assert len(ranks[0][0]) == EPOCHS * 5 == len(losses)
    actual = ParityRun(torch.tensor([r[0] for r in ranks], dtype=torch.float64).mean(0).tolist(), ranks[0][1])
    loss_error, weight_error = assert_parity(actual, ParityRun(losses, expected_state), rtol=PARITY_RTOL)
    print(f"{layout}, {EPOCHS} epochs of 22 samples in batches of 4: loss {loss_error:.1e}, weights {weight_error:.1e}")
    assert all(abs(r[2] - val_loss) <= PARITY_RTOL * val_loss for r in ranks), ([r[2] for r in ranks], val_loss)


# ------------------------------------------------------------------------------------ bubble
# Each block sleeps a fixed time in forward, in the input-gradient half of backward and in the
# weight-gradient half (the split zero-bubble schedules exploit), so the meter's busy time has a floor.
SLEEP = 0.002  # seconds per block and phase


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_seconds, backward_seconds):
        time.sleep(forward_seconds)
        ctx.backward_seconds = backward_seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_seconds)
        return grad, None, None


class SleepBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        x = _Sleep.apply(x, SLEEP, SLEEP)  # forward, and the input-gradient part of backward
        weight = _Sleep.apply(self.proj.weight, 0.0, SLEEP)  # the weight-gradient part of backward
        return torch.nn.functional.linear(x, weight, self.proj.bias)


class SleepNetwork(torch.nn.Module):
    def __init__(self, n_blocks: int = 4, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(SleepBlock(width) for _ in range(n_blocks))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class SleepModule(torch.nn.Module):  # the model contract, without Lightning
    def __init__(self) -> None:
        super().__init__()
        self.model = SleepNetwork()

    def forward(self, inputs):
        return self.model(inputs)

    def loss_fn(self, logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def _schedule_step(rank: int, world_size: int, schedules: tuple[str, ...], microbatches: int) -> dict:
    """Per schedule, one training step under BubbleMeter: the order in which this rank ran its compute, the
    meter's busy seconds and idle fraction, and the number of blocks this rank holds."""
    import torch.distributed as dist

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.parallel.pipeline.bubble import BubbleMeter
    from lightning_par.parallel.compose import parallelize
    from lightning_par.parallel.pipeline.split import build_schedule
    from lightning_par.parallel.model_map import derive_model_map

    dist.init_process_group("gloo")
    results = {}
    for schedule in schedules:
        config = ParallelConfig(pp=world_size, dp_shard=1, pp_schedule=schedule, microbatches=microbatches)
        mesh = build_mesh(config, "cpu")
        module = SleepModule()
        tokens = torch.randint(0, 16, (microbatches, 5))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        stages = parallelize(module, mesh, config.validate(world_size), derive_model_map(module), training=False,
                             sample_batch=(inputs, targets)).stages
        runner = build_schedule(stages, schedule, microbatches, module.loss_fn)
        meter = BubbleMeter(stages, torch.device("cpu"))
        meter.start()
        runner.step(*((inputs,) if stages[0].is_first else ()), target=targets if stages[-1].is_last else None,
                    tokens=inputs)
        fraction = meter.stop()
        blocks = sum(len([b for b in stage.submod.model.model.blocks if isinstance(b, SleepBlock)]) for stage in stages)
        results[schedule] = {"actions": meter.actions, "n_stages": meter.n_stages, "busy": meter._busy,
                             "fraction": fraction, "blocks": blocks}
    dist.destroy_process_group()
    return results


def test_pipeline_bubble_matches_theory() -> None:
    """Idle fraction per rank, p=2 ranks, m=4 micro-batches, equal costs, from the order in which the ranks
    really ran their compute, for every row of layout.schedules.SCHEDULES: its bubble ``b`` of the compute is an
    idle fraction ``b / (1 + b)`` of the step. GPipe and 1F1B (p-1)/(m+p-1) = 0.20 (Huang et al. 2019; Narayanan
    et al. 2021); interleaved with v=2 stages per rank (p-1)/(v*m+p-1) = 0.11; the schedules that split backward
    fill the bubble with weight-gradient work (Qi et al. 2024) and leave the p - 1 chunk forwards their row counts
    (layout.schedules.ZERO_BUBBLE_RESIDUAL, at these equal costs). Every row's bubble is the order's. Exact,
    whatever the machine's load: the measured figures are a benchmark (benchmarks/pipeline_schedules.py), not a
    test."""
    from harness import run_distributed

    from lightning_par.parallel.pipeline.bubble import simulated_bubble

    p, v = 2, 2
    m = max(4, *(fewest_microbatches(name, p, v) for name in SCHEDULES))
    schedules = tuple(SCHEDULES)
    ranks = run_distributed(_schedule_step, p, schedules, m)
    implied = {name: max(simulated_bubble({r: rank[name]["actions"] for r, rank in enumerate(ranks)},
                                          ranks[0][name]["n_stages"]).values()) for name in schedules}
    print("pipeline bubble implied by the recorded orders:", {k: round(x, 4) for k, x in implied.items()})
    fill_and_drain = (p - 1) / (m + p - 1)
    for name, spec in SCHEDULES.items():
        share = spec.bubble(p, m, v)
        assert implied[name] == pytest.approx(share / (1 + share), abs=1e-9), (name, implied[name], share)
    assert implied["1f1b"] == pytest.approx(fill_and_drain, abs=1e-9)
    assert implied["interleaved_1f1b"] == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
    # DualPipeV (DeepSeek-AI 2024, V-shaped) overlaps one micro-batch's forward with another's backward; with
    # equal costs it leaves the same single unit idle as ZB-V: 1 / (2 stages x m x 3 units + 1) = 1/25.
    assert implied["dualpipev"] == pytest.approx(1 / (2 * m * 3 + 1), abs=1e-9)
    assert implied["zbv"] == pytest.approx(implied["dualpipev"], abs=1e-9)
    for name in schedules:
        for rank in ranks:
            record = rank[name]
            # Every micro-batch went forward and backward (split in input and weight halves where the row says so,
            # beside whole backwards under DualPipeV) on each stage.
            kinds = {kind for _, kind, _ in record["actions"]}
            if SCHEDULES[name].splits_backward:
                assert {"F", "I", "W"} <= kinds <= {"F", "B", "I", "W"}, (name, kinds)
            else:
                assert kinds == {"F", "B"}, (name, kinds)
            # One forward and one backward (whole, or its input and weight halves) per micro-batch and stage.
            backward = sum(1 for _, kind, _ in record["actions"] if kind in ("B", "I"))
            assert backward == sum(1 for _, kind, _ in record["actions"] if kind == "F") == m * record["n_stages"] // p
            count = {kind: sum(1 for _, k, _ in record["actions"] if k == kind) for kind in ("I", "W")}
            assert count["I"] == count["W"], (name, count)
            # The meter timed every compute call: at least the sleeps inside them, whatever the load.
            assert record["busy"] >= m * record["blocks"] * 3 * SLEEP
            assert 0.0 <= record["fraction"] <= 1.0


def _peak_saved_activation_bytes(rank: int, world_size: int, schedule: str, microbatches: int) -> int:
    """Most bytes of saved activations alive at once on this rank during one training step."""
    import torch.distributed as dist

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.parallel.compose import parallelize
    from lightning_par.parallel.pipeline.split import build_schedule
    from lightning_par.parallel.model_map import derive_model_map

    dist.init_process_group("gloo")
    config = ParallelConfig(pp=world_size, dp_shard=1, pp_schedule=schedule, microbatches=microbatches)
    mesh = build_mesh(config, "cpu")
    torch.manual_seed(0)
    module = make_module()
    inputs, targets = module.split_batch(torch.randint(0, 64, (microbatches, 17)))
    stages = parallelize(module, mesh, config.validate(world_size), derive_model_map(module), training=False,
                         sample_batch=(inputs, targets)).stages
    runner = build_schedule(stages, schedule, microbatches, module.loss_fn)
    live = {"now": 0, "peak": 0}

    class Saved:  # released by autograd when the saved tensor is freed after its backward
        def __init__(self, size: int) -> None:
            self.size = size
            live["now"] += size
            live["peak"] = max(live["peak"], live["now"])

        def __del__(self) -> None:
            live["now"] -= self.size

    def pack(t):
        return (None if isinstance(t, torch.nn.Parameter) else Saved(t.numel() * t.element_size())), t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[1]):
        runner.step(*((inputs,) if stages[0].is_first else ()), target=targets if stages[-1].is_last else None,
                    tokens=inputs)
    dist.destroy_process_group()
    return live["peak"]


def test_1f1b_keeps_fewer_activations_than_gpipe() -> None:
    """GPipe keeps the activations of all m micro-batches until backward starts; 1F1B a few, about p - rank
    (Narayanan et al. 2021; PyTorch's 1F1B runs one more forward before the first backward on rank 0).
    p=2, m=8; measured 0.32 and 0.125 of GPipe's."""
    from harness import run_distributed

    gpipe = run_distributed(_peak_saved_activation_bytes, 2, "gpipe", 8)
    one_f_one_b = run_distributed(_peak_saved_activation_bytes, 2, "1f1b", 8)
    ratios = [b / a for a, b in zip(gpipe, one_f_one_b)]
    print(f"peak saved activations per rank, 1F1B / GPipe (p=2, m=8): {[round(r, 3) for r in ratios]}")
    p, m = 2, 8
    for rank, ratio in enumerate(ratios):
        assert ratio <= (p - rank + 1) / m, (rank, ratio)


def test_profile_balancing_beats_parameter_counts_on_uneven_blocks() -> None:
    """A large vocabulary makes the embedding heavy in parameters but cheap to run, and the head expensive
    to run: counting parameters starves the first stage, profiling the blocks does not. The profile's clock counts
    floating-point operations, as seconds on an unloaded machine would, so that the load cannot decide the test."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_par.parallel.pipeline.split import parameter_costs, profile_costs
    from lightning_par.parallel.model_map import derive_model_map

    torch.manual_seed(0)
    module = SGDLlamaLM(**{**MODEL, "n_layers": 24, "vocab_size": 2048})
    model_map = derive_model_map(module)
    inputs, targets = module.split_batch(torch.randint(0, 2048, (4, 17)))
    with FlopCounterMode(display=False) as flops:
        measured = profile_costs(module, model_map, module, module.loss_fn, inputs, targets,
                                 clock=flops.get_total_flops)

    def slowest_stage(sizes: list[int]) -> float:  # in operations
        blocks, first, last = measured
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        return max(sum(blocks[a:a + n]) + (first if s == 0 else 0.0) + (last if s == len(sizes) - 1 else 0.0)
                   for s, (a, n) in enumerate(zip(starts, sizes)))

    counted = parameter_costs(module, model_map)
    by_parameters = balance(counted[0], 4, first=counted[1], last=counted[2])
    by_profile = balance(measured[0], 4, first=measured[1], last=measured[2])
    ratio = slowest_stage(by_profile) / slowest_stage(by_parameters)
    print(f"slowest stage, profile / parameters: {ratio:.2f} ({by_profile} vs {by_parameters} blocks)")
    assert by_profile[0] > 2 * by_parameters[0], (by_profile, by_parameters)
    assert ratio < 0.9  # 0.89: [7, 7, 8, 2] blocks against [3, 9, 9, 3]


def _half_size_validation_batches(datamodule):
    """``datamodule`` with validation batches half the training batch: the micro-batch shape changes between
    evaluation and training, and PyTorch's stages size their buffers at a schedule's first step."""
    datamodule.val_dataloader = lambda: torch.utils.data.DataLoader(datamodule.val_dataset,
                                                                    batch_size=datamodule.batch_size // 2)
    return datamodule


def _validate_after_training(rank: int, world_size: int, schedule: str) -> dict:
    import lightning

    torch.manual_seed(1234)
    module = make_module()
    # A sanity validation before training too, on smaller batches: evaluating must leave the schedule able to
    # train, and training must leave it able to evaluate.
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False,
                                strategy=make_strategy(pipeline_parallel_size=world_size, microbatches=2,
                                                       pipeline_schedule=schedule),
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=1, val_check_interval=2)
    datamodule = make_datamodule(batch_size=4)
    trainer.fit(module, datamodule=_half_size_validation_batches(datamodule))
    validated = trainer.validate(module, datamodule=datamodule, verbose=False)[0]["val_loss"]
    torch.manual_seed(5)
    tokens = torch.utils.data.DataLoader(torch.randint(0, 64, (4, 16)), batch_size=4)
    return {"val_loss": validated, "state": trainer.strategy.consolidated_state_dict(),
            "predicted": trainer.predict(module, dataloaders=tokens)[0]}


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_validation_and_predict_run_forward_only_and_match(schedule: str) -> None:
    """After 4 steps, validation under pp=2 reports the loss one process computes with the same weights,
    and predict returns the same logits (ZB-V: through forward_through_stages)."""
    from harness import run_distributed

    results = run_distributed(_validate_after_training, 2, schedule)
    assert results[0]["val_loss"] == results[1]["val_loss"]  # broadcast from the last stage
    module = make_module()
    module.load_state_dict(results[0]["state"])
    datamodule = make_datamodule(batch_size=4)
    datamodule.setup("validate")
    with torch.no_grad():
        losses = [module.loss_fn(module(x), y) for x, y in map(module.split_batch, datamodule.val_dataloader())]
    assert results[0]["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
    torch.manual_seed(5)
    with torch.no_grad():
        expected = module(torch.randint(0, 64, (4, 16)))
    for result in results:  # every rank returns the last stage's logits
        torch.testing.assert_close(result["predicted"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "batch_size", "message"),
    [
        (dict(pipeline_schedule="1f1b", microbatches=1), 4, "schedule '1f1b' needs at least pipeline_parallel_size=2 micro-batches"),
        (dict(pipeline_schedule="gpipe", microbatches=3), 4, "a batch of 4 samples does not split into microbatches=3"),
        (dict(pipeline_schedule="zbv", microbatches=2, model_map=None), 4, "4 pipeline stages (pipeline_parallel_size=2 x 2 per rank for 'zbv') need "
                                                             "at least 4 blocks, the model has 2"),
    ],
    ids=["too-few-microbatches", "batch", "blocks"],
)
def test_pipelines_that_cannot_run_fail_on_every_rank(kwargs: dict, batch_size: int, message: str) -> None:
    assert_fails_on_every_rank(functools.partial(SGDLlamaLM, **MODEL),  # 2 blocks
                               functools.partial(make_datamodule, batch_size=batch_size),
                               functools.partial(make_strategy, **kwargs), world_size=2, message=message)


class WithoutLossFn(SGDLlamaLM):
    loss_fn = None  # the contract's loss_fn is missing


class WithoutContract(SGDLlamaLM):
    loss_fn = split_batch = None  # neither of the contract's methods


@pytest.mark.parametrize(("module", "missing"), [(WithoutLossFn, "loss_fn()"),
                                                 (WithoutContract, "split_batch() and loss_fn()")])
def test_a_module_outside_the_contract_is_told_what_is_missing(module: type, missing: str) -> None:
    assert_fails_on_every_rank(functools.partial(module, **MODEL), make_datamodule,
                               functools.partial(make_strategy, microbatches=2), world_size=2,
                               message=f"TypeError: pipeline parallel needs {module.__name__} to define {missing};")


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_tied_head_under_multi_stage_schedules_matches_single_process(schedule: str) -> None:
    """The head tied to the embedding under the schedules that give a rank two stages: interleaved puts the
    first and the last stage on different ranks (the copies' gradients are summed), ZB-V on the same rank
    (one tensor, no copy). 20 steps: a tie that comes apart drifts slowly."""
    tied = functools.partial(SGDLlamaLM, **{**MODEL, "n_layers": 4, "tie_embeddings": True, "max_steps": 20})
    assert_layout_matches(tied, functools.partial(make_datamodule, batch_size=4),
                          functools.partial(make_strategy, pipeline_parallel_size=2, pipeline_schedule=schedule, microbatches=2),
                          world_size=2, dp=1, steps=20, rtol=PARITY_RTOL, label=f"tied head, {schedule}")


def test_a_block_list_whose_entries_share_one_module_is_refused_by_name() -> None:
    """ALBERT-style sharing (``nn.ModuleList([block] * 4)``): the list has 4 entries but 1 module; the refusal says so
    rather than counting one block."""
    from types import SimpleNamespace

    from lightning_par.parallel.model_map import ModelMap
    from lightning_par.parallel.pipeline.split import split_pipeline

    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            block = torch.nn.Linear(8, 8)
            self.layers = torch.nn.ModuleList([block] * 4)

    model = Shared()
    model_map = ModelMap(blocks="layers")
    assert model_map.shared_blocks(model) == [["layers.0", "layers.1", "layers.2", "layers.3"]]
    mesh = SimpleNamespace(size=lambda name: 2)
    with pytest.raises(ValueError, match=r"the 4 entries of the block list 'layers' hold only 1 distinct module, "
                                         r"because entries share one module \(layers.0 = layers.1 = layers.2 = layers.3\)"):
        split_pipeline(model, mesh, model_map, schedule="1f1b", virtual_stages=1, balance_by="parameters",
                       device=torch.device("cpu"), sample_batch=(torch.zeros(1, 8), None))


def test_a_stand_in_answers_for_the_tensors_it_does_not_hold_and_refuses_to_compute_with_them() -> None:
    """A later stage's stand-in for the embedding: Llama 4's forward reads ``embed_tokens.weight.device`` on every
    stage. The stand-in gives the weight's shape, dtype and the stage's device; a model's initialisation may write
    into it (dropped); computing with it raises, naming it."""
    from lightning_par.parallel.pipeline.split import StandInModule
    from lightning_par.parallel.pipeline.trace import StandIn

    embedding = torch.nn.Embedding(64, 32)
    stand_in = StandInModule(StandIn("zeros", width=32, dtype=torch.float32), stands_for=embedding,
                             path="model.embed_tokens")
    stand_in.device = torch.device("cpu")
    weight = stand_in.weight
    assert (weight.shape, weight.dtype, weight.device) == ((64, 32), torch.float32, torch.device("cpu"))
    assert stand_in(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 32)
    torch.nn.init.normal_(weight)
    with pytest.raises(RuntimeError, match=r"model\.embed_tokens\.weight is not on this pipeline stage"):
        torch.nn.functional.embedding(torch.zeros(2, dtype=torch.long), weight)
    with pytest.raises(AttributeError):
        stand_in.bias
    assert not list(stand_in.parameters()) and not list(stand_in.buffers())


LLAMA4_TEXT = dict(model_type="llama4_text", intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
                   num_experts_per_tok=1, interleave_moe_layer_step=2, num_key_value_heads=2, attention_chunk_size=8,
                   no_rope_layers=[1, 0], tie_word_embeddings=False)


def _llama4_text() -> torch.nn.Module:
    import zoo

    return zoo.HuggingFaceLM({**zoo._COMMON, **LLAMA4_TEXT})


def test_llama4_text_trains_under_a_pipeline_like_one_process() -> None:
    """Llama 4 (text): its forward reads ``embed_tokens.weight.device`` on every stage, where the second stage holds
    a stand-in for the embedding; chunked attention, a NoPE layer and a routed MoE block with a shared expert.
    20 SGD steps of pp2 1F1B within 1e-5 of one process."""
    import zoo
    from installed import require

    require("transformers")
    from lightning_par import PipelineParallelStrategy

    make_data = functools.partial(_synthetic_data, zoo.VOCAB, zoo.SEQ_LEN)
    assert_layout_matches(_llama4_text, make_data,
                          functools.partial(PipelineParallelStrategy, pipeline_parallel_size=2,
                                            pipeline_schedule="1f1b", microbatches=2),
                          world_size=2, dp=1, steps=20, rtol=1e-5, label="llama4_text pp2")


def _synthetic_data(vocab: int, seq_len: int):
    from lightning_par.data import TokenDataModule

    return TokenDataModule(source="synthetic", vocab_size=vocab, seq_len=seq_len, batch_size=4, num_samples=256,
                           num_val_samples=8)
