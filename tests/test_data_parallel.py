"""data_parallel: parity with one process, gradient accumulation without extra all-reduces, knobs."""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_distributed
from parity import assert_parity, layout_run, max_relative_error, reference_run

from lightning_par.data import TokenDataModule
from lightning_par.models import LlamaLM

# fp32 on CPU: DDP averages bucketed gradients in a different order than one process sums a global
# batch, so results agree to rounding, not bitwise (measured: losses ~1e-7, weights ~1e-6 relative).
PARITY_RTOL = 1e-5
STEPS = 4
MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, warmup_steps=1,
             max_steps=STEPS)


class SGDLlamaLM(LlamaLM):
    """The reference model with SGD + momentum: its update is linear in the gradient, so rounding
    differences in the all-reduce stay rounding-sized in the weights. (Adam divides each gradient by
    its own magnitude, which turns the rounding of a gradient that nearly cancels into a full step;
    it has its own test with a tolerance that says so.)"""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


make_module = functools.partial(SGDLlamaLM, **MODEL)
make_adamw_module = functools.partial(LlamaLM, learning_rate=1e-2, **MODEL)


def make_datamodule(batch_size: int = 2, seq_len: int = 16) -> TokenDataModule:
    return TokenDataModule(source="synthetic", vocab_size=64, seq_len=seq_len, batch_size=batch_size,
                           num_samples=128, num_val_samples=16)


def make_strategy(**knobs):
    from lightning_par import DataParallelStrategy

    return DataParallelStrategy(**knobs)


@pytest.mark.parametrize(
    ("world_size", "accumulate", "knobs"),
    [
        (2, 1, {}),
        (2, 2, {}),
        (4, 1, {"bucket_cap_mb": 0.01}),  # ~40 small buckets instead of one
        (4, 2, {"static_graph": True}),
    ],
)
def test_data_parallel_matches_single_process(world_size: int, accumulate: int, knobs: dict) -> None:
    expected = reference_run(make_module, make_datamodule, dp=world_size, steps=STEPS, accumulate=accumulate)
    actual = layout_run(make_module, make_datamodule, functools.partial(make_strategy, **knobs),
                        world_size=world_size, steps=STEPS, accumulate=accumulate)
    loss_error, weight_error = assert_parity(actual, expected, rtol=PARITY_RTOL)
    print(f"data_parallel ws={world_size} acc={accumulate}: loss rel err {loss_error:.1e}, weights {weight_error:.1e}")
    # The run must have trained: otherwise parity would hold trivially.
    assert expected.losses[-1] < expected.losses[0]


def test_adamw_matches_single_process() -> None:
    """The model's own AdamW: losses agree to rounding; a few weights whose gradient nearly cancels get
    Adam's normalised step from a rounding-sized gradient (measured worst: 3e-4 of the tensor's max)."""
    expected = reference_run(make_adamw_module, make_datamodule, dp=2, steps=STEPS)
    actual = layout_run(make_adamw_module, make_datamodule, make_strategy, world_size=2, steps=STEPS)
    loss_error, weight_error = max_relative_error(actual, expected)
    assert loss_error <= PARITY_RTOL, actual.losses
    assert weight_error <= 1e-3


def test_bf16_gradient_compression_trains_close_to_fp32() -> None:
    """bf16 all-reduce halves the bytes; the result stays within bf16 rounding of the fp32 run."""
    expected = reference_run(make_module, make_datamodule, dp=2, steps=STEPS)
    compressed = functools.partial(make_strategy, gradient_compression="bf16", bucket_cap_mb=1.0)
    actual = layout_run(make_module, make_datamodule, compressed, world_size=2, steps=STEPS)
    loss_error, weight_error = assert_parity(actual, expected, rtol=5e-2)
    # And it really compressed: an exact fp32 reduction would agree to ~1e-7.
    assert weight_error > 1e-6, f"bf16 compression left weights identical to fp32 ({weight_error:.1e})"


def _count_allreduces(rank: int, world_size: int, accumulate: int) -> list[int]:
    """Train with accumulation and count the gradient all-reduces DDP issues per micro-batch."""
    import lightning
    import torch.distributed as dist

    import lightning_par  # noqa: F401

    calls: list[int] = []

    def counting_hook(process_group, bucket):  # a DDP comm hook: average the bucket, but count it
        calls.append(1)
        tensor = bucket.buffer().div_(process_group.size())
        return dist.all_reduce(tensor, group=process_group, async_op=True).get_future().then(lambda f: f.value()[0])

    per_batch: list[int] = []

    class Register(lightning.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.model.register_comm_hook(trainer.strategy.mesh.group("dp"), counting_hook)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            per_batch.append(len(calls))
            calls.clear()

    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy="data_parallel", max_steps=2,
                                accumulate_grad_batches=accumulate, callbacks=[Register()], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(make_module(), datamodule=make_datamodule())
    return per_batch


def test_accumulation_skips_allreduce_on_non_final_micro_batches() -> None:
    per_batch = run_distributed(_count_allreduces, 2, 3)[0]
    # 2 optimizer steps x 3 micro-batches: only the third micro-batch of each step communicates.
    assert len(per_batch) == 6
    assert [n > 0 for n in per_batch] == [False, False, True, False, False, True], per_batch


def _validate_only(rank: int, world_size: int) -> float:
    import lightning

    import lightning_par  # noqa: F401

    torch.manual_seed(rank)  # replicas start different on purpose: the strategy must make them equal
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy="data_parallel", logger=False,
                                enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(make_module(), datamodule=make_datamodule(), verbose=False)
    return metrics[0]["val_loss"]


def test_validate_without_fit_broadcasts_replicas() -> None:
    losses = run_distributed(_validate_only, 2)
    torch.manual_seed(0)
    module = make_module()  # rank 0's weights
    datamodule = make_datamodule()
    datamodule.setup("validate")
    total = 0.0
    batches = list(datamodule.val_dataloader())
    with torch.no_grad():
        for batch in batches:
            total += float(module.loss_fn(module(module.split_batch(batch)[0]), module.split_batch(batch)[1]))
    assert losses[0] == losses[1]
    assert losses[0] == pytest.approx(total / len(batches), rel=1e-5)


class SelfParallelizingLM(SGDLlamaLM):
    """The escape hatch: a module that parallelizes itself; the strategy must apply nothing else."""

    def parallelize(self, mesh, config):
        from lightning_par.parallel import apply_data_parallel

        self.hook_calls = getattr(self, "hook_calls", []) + [(mesh.sizes(), config.dp)]
        return apply_data_parallel(self, mesh, bucket_cap_mb=1.0)


def _fit_self_parallelizing(rank: int, world_size: int) -> dict:
    import lightning

    class InspectWrapper(lightning.Callback):
        def on_train_start(self, trainer, pl_module):
            self.bucket_bytes = getattr(trainer.strategy.model, "bucket_bytes_cap", None)

    module, inspect = SelfParallelizingLM(**MODEL), InspectWrapper()
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy="data_parallel", max_steps=1,
                                callbacks=[inspect], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=make_datamodule())
    return {"calls": module.hook_calls, "bucket_bytes": inspect.bucket_bytes}


def test_model_hook_replaces_the_strategys_own_parallelization() -> None:
    result = run_distributed(_fit_self_parallelizing, 2)[0]
    assert result["calls"] == [({"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}, 2)]
    assert result["bucket_bytes"] == 1024 * 1024  # the hook's DDP (1 MiB buckets), not the strategy's 25 MiB
