"""Bad steps: a NaN in one rank's gradients is caught on every rank before the optimizer moves, the step is skipped
(weights equal to a run without that batch), counted, and too many in a row stop the run naming where."""

from __future__ import annotations

import functools
import math

import lightning
import pytest
import torch
import zoo
from harness import run_distributed
from parity import ParityRun, _layout_ranks, assert_parity, reference_run
from test_zoo import make_datamodule

from lightning_par.health.bad_steps import BadStepGuard, BadSteps, BadStepsError
from lightning_par.callbacks import GradientNormMonitor

STEPS = 20
BAD_STEP = 3
# One launch of 2 ranks runs every layout: DDP (the NaN reaches only rank 1, after the all-reduce), FSDP2 and a
# two-stage pipeline (only the second stage sees it), each on another architecture.
LAYOUTS = {"ddp": ("llama", 2), "zero3": ("qwen2", 2), "pp2": ("nanogpt", 1)}  # layout: (model, data-parallel size)


def make_strategy(layout: str, **knobs):
    import lightning_par

    if layout == "ddp":
        return lightning_par.DataParallelStrategy(**knobs)
    if layout == "zero3":
        return lightning_par.ZeroStrategy(zero_stage=3, **knobs)
    return lightning_par.PipelineParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="1f1b", microbatches=2,
                                                  **knobs)


class NaNInGradients(lightning.Callback):
    """Rank ``rank`` puts a NaN into its gradients once they are final (reduced, taken from the pipeline) at the
    given steps, where the strategy's check comes next."""

    def __init__(self, steps: set[int], rank: int = 1) -> None:
        self.steps, self.rank = steps, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step not in self.steps or trainer.global_rank != self.rank:
            return
        parallelized = trainer.strategy.parallelized
        final = parallelized.after_backward

        def poisoned() -> None:
            final()
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.nan
            del parallelized.after_backward  # this step only

        parallelized.after_backward = poisoned


def _stops_after(rank: int, world_size: int) -> str:
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, max_steps=10, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                strategy=make_strategy("ddp", bad_steps={"max_in_a_row": 3}),
                                callbacks=[NaNInGradients({4, 5, 6})])
    try:
        trainer.fit(zoo.make_model("llama"), datamodule=make_datamodule())
    except BadStepsError as error:
        return str(error)
    raise AssertionError("no BadStepsError")


def _ranks(rank: int, world_size: int) -> tuple[dict, str]:
    runs = {layout: (zoo.factory(model), make_datamodule, functools.partial(make_strategy, layout))
            for layout, (model, _) in LAYOUTS.items()}
    # The gradient norm monitor runs after the check: on the skipped step it sees no gradients, on every rank alike.
    callbacks = [NaNInGradients({BAD_STEP}), GradientNormMonitor()]
    trained = _layout_ranks(rank, world_size, runs, STEPS, 1, 1234, {"callbacks": callbacks})
    return trained, _stops_after(rank, world_size)


def test_nan_step_is_skipped_on_every_rank() -> None:
    per_rank = run_distributed(_ranks, 2, timeout=400)
    for layout, (model, dp) in LAYOUTS.items():
        losses = torch.tensor([ranks[0][layout][0] for ranks in per_rank], dtype=torch.float64).mean(0).tolist()
        actual = ParityRun(losses[:BAD_STEP] + losses[BAD_STEP + 1:], per_rank[0][0][layout][1])
        expected = reference_run(zoo.factory(model), make_datamodule, dp=dp, steps=STEPS,
                                 skipped_steps=frozenset({BAD_STEP}))
        errors = assert_parity(actual, expected, rtol=1e-5)
        print(f"{layout} ({model}): a run without batch {BAD_STEP} within {errors}")
    messages = [message for _, message in per_rank]
    assert messages[0] == messages[1], messages
    assert "3 bad steps in a row (bad_steps.max_in_a_row=3), the last at step 6: rank 1: the gradient of" in messages[0]
    assert "holds NaN. Training stopped; no checkpoint was written in this run" in messages[0]


def test_verdicts_on_one_process() -> None:
    guard = BadStepGuard(BadSteps())
    grads = [("w", torch.tensor([1.0, math.nan]))]
    verdict = guard.judge(torch.tensor(2.0), grads, 3, device=torch.device("cpu"))
    assert verdict is not None and verdict.reason == "the gradient of w holds NaN" and guard.skipped == 1
    assert guard.judge(torch.tensor(2.0), [("w", torch.ones(2))], 4, device=torch.device("cpu")) is None
    assert guard.in_a_row == 0 and guard.skipped == 1
    assert guard.judge(torch.tensor(math.inf), [("w", torch.ones(2))], 5, device=torch.device("cpu")).reason == \
        "the loss is inf"
    off = BadStepGuard(BadSteps(skip_nonfinite=False))
    assert off.judge(torch.tensor(2.0), grads, 3, device=torch.device("cpu")) is None


def test_loss_spike_rule() -> None:
    guard = BadStepGuard(BadSteps(loss_spike_factor=2.0, spike_window=4, max_in_a_row=2))
    cpu = torch.device("cpu")
    grads = [("w", torch.ones(2))]
    assert guard.judge(torch.tensor(9.0), grads, 0, device=cpu) is None  # no median yet: the rule waits
    for step, loss in enumerate([3.0, 2.5, 2.0], start=1):
        assert guard.judge(torch.tensor(loss), grads, step, device=cpu) is None
    verdict = guard.judge(torch.tensor(6.0), grads, 4, device=cpu)  # median of 9, 3, 2.5, 2 is 2.75
    assert verdict is not None and "is 2.18 times the median 2.75 of the last 4 steps" in verdict.reason
    assert list(guard.recent_losses) == [9.0, 3.0, 2.5, 2.0]  # a skipped loss does not join the median
    with pytest.raises(BadStepsError, match="2 bad steps in a row .* the last at step 5: its loss 7"):
        guard.judge(torch.tensor(7.0), grads, 5, device=cpu, last_checkpoint="ckpt/last.ckpt")
    restored = BadStepGuard(guard.rule)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_in_a_row", -1, "bad_steps.max_in_a_row=-1: a count of steps"),
    ("loss_spike_factor", 0.5, "bad_steps.loss_spike_factor=0.5: a factor above 1"),
    ("spike_window", 1, "bad_steps.spike_window=1: at least 2"),
    ("max_in_row", 2, "bad_steps has no field 'max_in_row': its fields are skip_nonfinite, max_in_a_row"),
])
def test_bad_rules_are_refused(field: str, value, message: str) -> None:
    from lightning_par import DataParallelStrategy

    with pytest.raises(ValueError, match=message):
        DataParallelStrategy(bad_steps={field: value})
