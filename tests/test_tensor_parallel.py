"""tensor_parallel: parity with one process at tp=2 and tp=4, with FSDP2 over the data-parallel ranks."""

from __future__ import annotations

import functools

import pytest
from parity import assert_parity, layout_run, reference_run
from test_data_parallel import MODEL, STEPS, SGDLlamaLM, make_datamodule

PARITY_RTOL = 1e-5
# 4 query and 4 key/value heads, 64-token vocabulary: splits 2 and 4 ways.
make_module = functools.partial(SGDLlamaLM, **{**MODEL, "n_kv_heads": 4})


def make_strategy(**kwargs):
    from lightning_par import TensorParallelStrategy

    return TensorParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("world_size", "kwargs", "accumulate", "clip"),
    [
        (2, dict(tensor_parallel_size=2), 1, None),
        (4, dict(tensor_parallel_size=4), 1, None),
        (4, dict(tensor_parallel_size=2), 2, 0.05),  # dp2 (FSDP2) x tp2, accumulation, global-norm clipping
        (2, dict(tensor_parallel_size=2, sequence_parallel=True), 1, None),
        (4, dict(tensor_parallel_size=4, sequence_parallel=True), 1, 0.05),
        (4, dict(tensor_parallel_size=2, sequence_parallel=True), 2, 0.05),
        (2, dict(tensor_parallel_size=2, loss_parallel=True), 1, None),
        (4, dict(tensor_parallel_size=4, sequence_parallel=True, loss_parallel=True), 2, 0.05),
    ],
    ids=["tp2", "tp4", "dp2xtp2-acc2-clip", "tp2-sp", "tp4-sp-clip", "dp2xtp2-sp-acc2-clip", "tp2-loss",
         "tp4-sp-loss-acc2-clip"],
)
def test_tensor_parallel_matches_single_process(world_size: int, kwargs: dict, accumulate: int, clip) -> None:
    dp = world_size // kwargs["tensor_parallel_size"]
    expected = reference_run(make_module, make_datamodule, dp=dp, steps=STEPS, accumulate=accumulate,
                             gradient_clip_val=clip)
    actual = layout_run(make_module, make_datamodule, functools.partial(make_strategy, **kwargs),
                        world_size=world_size, steps=STEPS, accumulate=accumulate,
                        trainer_kwargs={"gradient_clip_val": clip})
    loss_error, weight_error = assert_parity(actual, expected, rtol=PARITY_RTOL)
    print(f"tensor_parallel {kwargs} ws={world_size}: loss rel err {loss_error:.1e}, weights {weight_error:.1e}")


def _bad_split(rank: int, world_size: int) -> str:
    import lightning
    import torch.distributed as dist

    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                                strategy=make_strategy(tensor_parallel_size=4), max_steps=1)
    try:
        trainer.fit(SGDLlamaLM(**{**MODEL, "n_heads": 2, "n_kv_heads": 2}), datamodule=make_datamodule())
    except ValueError as error:
        dist.barrier()  # every rank got here: nobody is left waiting in a collective
        return str(error)
    raise AssertionError("no ValueError")


def test_heads_that_do_not_split_are_a_clear_error_on_every_rank() -> None:
    from harness import run_distributed

    messages = run_distributed(_bad_split, 4)
    assert len(set(messages)) == 1
    assert "tp=4 does not divide the 2 heads of 'model.layers.0.attention.q_proj'" in messages[0]


def _block_input_lengths(rank: int, world_size: int, sequence_parallel: bool) -> dict:
    import lightning

    module = make_module()
    seen: dict[str, int] = {}

    def record(name):
        def hook(module, args, output) -> None:  # returns None: the output stays as it is
            seen.setdefault(name, args[0].shape[1])

        return hook

    module.model.layers["0"].register_forward_hook(record("block"))
    module.model.layers["0"].attention.q_proj.register_forward_hook(record("q_proj"))
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                                strategy=make_strategy(tensor_parallel_size=world_size,
                                                       sequence_parallel=sequence_parallel),
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=make_datamodule())
    return seen


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_sequence_parallel_splits_the_activations_between_regions(sequence_parallel: bool) -> None:
    """With sequence parallelism a block sees 1/tp of the 16 tokens; attention still sees all of them."""
    from harness import run_distributed

    seen = run_distributed(_block_input_lengths, 2, sequence_parallel)[0]
    assert seen == {"block": 8 if sequence_parallel else 16, "q_proj": 16}


def _logits_and_loss(rank: int, world_size: int) -> dict:
    import lightning
    import torch

    module = make_module()
    seen: dict[str, object] = {}

    def record(module, args, output) -> None:
        seen.setdefault("local_vocab", output.to_local().shape[-1])

    module.model.lm_head.register_forward_hook(record)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                                strategy=make_strategy(tensor_parallel_size=world_size, loss_parallel=True),
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    trainer.fit(module, datamodule=make_datamodule())
    trainer.validate(module, datamodule=make_datamodule())
    seen["logged"] = {k: type(v).__name__ for k, v in trainer.callback_metrics.items()}
    tokens = torch.utils.data.DataLoader(torch.randint(0, 64, (4, 16)), batch_size=2)
    predictions = trainer.predict(module, dataloaders=tokens)
    seen["predicted"] = (type(predictions[0]).__name__, predictions[0].shape[-1])
    return seen


def test_loss_parallel_never_gathers_the_vocabulary() -> None:
    """The head hands each of 2 ranks 32 of the 64 vocabulary logits; logged losses are plain tensors and
    predictions come back whole."""
    from harness import run_distributed

    for seen in run_distributed(_logits_and_loss, 2):
        assert seen["local_vocab"] == 32
        assert seen["logged"] == {"val_loss": "Tensor"}
        assert seen["predicted"] == ("Tensor", 64)
