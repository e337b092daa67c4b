"""Every zoo architecture under tp2, pp2 and hybrid3d dp2 x tp2: 20 steps equal to one process, or refused
before the first step with the module and the reason (tests/zoo.py lists what each covers). Under float8 the one
process is a float8 one multiplying the same pieces as the ranks (tests/test_float8.py says why).

One launch per layout trains every model in turn on the same ranks, so the zoo costs one process start-up per
layout, not one per cell.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any

import pytest
from installed import require
import torch
import zoo
from harness import run_distributed
from parity import RecordLoss, assert_parity, reference_run

transformers = require("transformers")

STEPS = 20
PARITY_RTOL = 1e-5


def make_datamodule():
    from lightning_par.data import TokenDataModule

    return TokenDataModule(source="synthetic", vocab_size=zoo.VOCAB, seq_len=zoo.SEQ_LEN, batch_size=4,
                           num_samples=256, num_val_samples=8)


def make_strategy(layout: str, model_map: dict | None = None):
    import lightning_par

    if layout == "tp2":
        return lightning_par.TensorParallelStrategy(tensor_parallel_size=2, model_map=model_map)
    if layout == "tp2-sp":
        return lightning_par.TensorParallelStrategy(tensor_parallel_size=2, sequence_parallel=True, loss_parallel=True,
                                                    model_map=model_map)
    if layout == "pp2":
        return lightning_par.PipelineParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="1f1b", microbatches=2,
                                                      model_map=model_map)
    if layout == "dp2xtp2":
        return lightning_par.Hybrid3DStrategy(data_parallel_size=2, tensor_parallel_size=2, model_map=model_map)
    if layout == "pp2xdp2-zero3":
        return lightning_par.Hybrid3DStrategy(pipeline_parallel_size=2, data_parallel_size=2, zero_stage=3,
                                              microbatches=2, model_map=model_map)
    if layout == "dp2-zero3-float8":  # FSDP2 gathers float8 weights, scales from one amax all-reduce
        return lightning_par.Hybrid3DStrategy(data_parallel_size=2, zero_stage=3, float8="tensorwise",
                                              float8_emulate=True, model_map=model_map)
    if layout == "dp2-zero2":  # gradients reduced to owners in buckets; parameters in one flat bucket per owner
        return lightning_par.ZeroStrategy(zero_stage=2, model_map=model_map)
    if layout == "ep2-zero3":  # both blocks one FSDP2 unit, around the experts' own units
        return lightning_par.Hybrid3DStrategy(expert_parallel_size=2, zero_stage=3, blocks_per_unit=2, model_map=model_map)
    if layout == "pp2xtp2-sp":
        return lightning_par.Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                                              microbatches=2, model_map=model_map)
    if layout == "ep2xtp2-sp":  # routers on each rank's piece of the sequence, experts split over the dp ranks
        return lightning_par.Hybrid3DStrategy(expert_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                                              model_map=model_map)
    if layout == "cp2xtp2-sp":
        return lightning_par.Hybrid3DStrategy(context_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                                              model_map=model_map)
    raise ValueError(layout)


# world size, data-parallel size. tp2, pp2 and dp2 x tp2 are the layouts a user tries first; tp2 with sequence
# and loss parallel and pp2 x tp2 (+SP) compose the techniques.
LAYOUTS = {"tp2": (2, 1), "pp2": (2, 1), "dp2xtp2": (4, 2), "tp2-sp": (2, 1), "pp2xtp2-sp": (4, 1),
           "pp2xdp2-zero3": (4, 2), "ep2-zero3": (2, 2), "dp2-zero3-float8": (2, 2),
           "dp2-zero2": (2, 2),
           # only for the families of tests/zoo.py: TRAIT_CELLS
           "ep2xtp2-sp": (4, 2), "cp2xtp2-sp": (4, 1)}

# Cells refused before the first step, and a fragment of the reason they give; every other cell trains exactly.
REFUSED: dict[tuple[str, str], str] = {
    # Sequence parallel hands the modules it does not split (nn.MultiheadAttention, MLA's low-rank projections)
    # sequence-split DTensors they cannot compute with. (MoE layers route each rank's piece of the sequence.)
    **{(name, layout): "set sequence_parallel=False for this model"
       for name in ("mha", "custom_names", "deepseek_v3") for layout in ("tp2-sp", "pp2xtp2-sp")},
    ("gpt2", "dp2-zero3-float8"): "found no linear layer to convert",  # its projections are all Conv1D
    # Expert parallel on a dense model would split nothing and train as plain data parallel.
    **{(name, "ep2-zero3"): "expert parallel found no experts to split" for name in zoo.MODELS
       if name not in zoo.MOE_MODELS},
    # Eager attention (a sliding-window mask of the whole sequence, attention sinks) sees one rank's chunk.
    **{(name, "cp2xtp2-sp"): "mixes the sequence without F.scaled_dot_product_attention (attn_implementation='eager')"
       for name in ("exaone4_eager", "gpt_oss")},
    # Sampled routing (sparsemixer) draws from each rank's own stream where ranks route different tokens.
    ("phimoe", "ep2-zero3"): "draws random numbers in training",
}


# Models whose attention output tensor parallel gathers (weights split, attention computed whole on each rank),
# because their code cuts the heads by the input's whole width (nanoGPT: C // n_head), or their config's plan says
# so (Phi-3's and OLMo 2's Hugging Face plans), or because a parameter holds one value per head of the whole model
# (GPT-OSS's attention sinks). Every other model's heads are split, fused q/k/v included (litgpt, GPT-2: rows
# regrouped per rank, head counts per rank).
GATHERED = ("nanogpt", "phi3", "olmo2", "gpt_oss")


def float8_model(name: str) -> torch.nn.Module:
    """Zoo model ``name`` with the layers of its blocks in float8, as the strategy converts them, in one process."""
    from lightning_par.parallel.float8 import apply_float8
    from lightning_par.parallel.model_map import ModelMap, resolve_model_map

    model = zoo.make_model(name)
    given = zoo.PLANS.get(name)
    apply_float8(model, ModelMap.from_dict(given) if given else resolve_model_map(None, model), "tensorwise", emulate=True)
    return model


def _train_every_model(rank: int, world_size: int, layout: str, models: tuple[str, ...]) -> dict:
    import logging

    import lightning

    from lightning_par.parallel.modules import clean_name

    class Messages(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    log = Messages()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(log)
    results = {}
    for name in models:
        log.lines.clear()
        torch.manual_seed(1234)
        module = zoo.make_model(name)
        recorder = RecordLoss()
        trainer = lightning.Trainer(accelerator="cpu", devices=world_size,
                                    strategy=make_strategy(layout, zoo.PLANS.get(name)),
                                    max_steps=STEPS, callbacks=[recorder], logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                    limit_val_batches=0)
        try:
            trainer.fit(module, datamodule=make_datamodule())
        except (ValueError, TypeError) as error:
            results[name] = ("refused", f"{type(error).__name__}: {error}", len(recorder.losses))
            continue
        except Exception:  # noqa: BLE001 - reported as a failed cell
            results[name] = ("crashed", traceback.format_exc(), len(recorder.losses))
            continue
        state = trainer.strategy.consolidated_state_dict()
        # Each distinct parameter under its first name, at its whole size: a tie lost would add a name.
        sizes = {clean_name(n): p.numel() for n, p in module.named_parameters()}
        plan_lines = [line for line in log.lines if "tensor-parallel split" in line or "tensor parallel (tp=" in line]
        results[name] = ("trained", recorder.losses, state if rank == 0 else None, sizes, plan_lines)
    return results


def rank_zero_plan(outcomes: list) -> str | None:
    """The map's source and split, as rank 0 logged them: ``huggingface: colwise 11, rowwise 4, vocab 1``."""
    import re

    lines = outcomes[0][4]
    source = next((m.group(1) for line in lines if (m := re.search(r"split \((\w+)\) checked", line))), None)
    split = next((line.split("on this rank: ")[1] for line in lines if "on this rank: " in line), None)
    return f"{source}: {split}" if source and split else None


@functools.cache
def _reference(name: str, dp: int, float8: bool) -> Any:
    """The one-process run zoo model ``name`` must match over ``dp`` data-parallel ranks (layouts with the same data
    split share it)."""
    return reference_run(functools.partial(float8_model, name) if float8 else zoo.factory(name), make_datamodule,
                         dp=dp, steps=STEPS, pieces_like_ranks=float8)


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout not in ("ep2xtp2-sp", "cp2xtp2-sp")])
def test_zoo_trains_like_one_process_or_is_refused(layout: str) -> None:
    _assert_cells(layout, zoo.MODELS)


@pytest.mark.parametrize("layout", list(zoo.TRAIT_CELLS))
def test_families_with_their_own_traits_train_like_one_process_or_are_refused(layout: str) -> None:
    """Families each checked in the layouts their traits meet (tests/zoo.py: TRAIT_CELLS): experts stacked in fused
    3-D weights with biases, in a child, or called on every token expert by expert, under expert parallel; their
    routers on each rank's piece of the sequence under sequence parallel; eager attention with a sliding window or
    attention sinks refused under context parallel, SDPA trained; sampled routing refused where ranks route apart."""
    _assert_cells(layout, zoo.TRAIT_CELLS[layout])


def _assert_cells(layout: str, models: tuple[str, ...]) -> None:
    world_size, dp = LAYOUTS[layout]
    per_rank = run_distributed(_train_every_model, world_size, layout, models, timeout=540)
    failures, table = [], []
    for name in models:
        outcomes = [rank[name] for rank in per_rank]
        kind = outcomes[0][0]
        expected_refusal = REFUSED.get((name, layout))
        if kind == "refused":
            messages = {o[1] for o in outcomes}
            steps = max(o[2] for o in outcomes)
            table.append(f"{name:12s} refused: {outcomes[0][1][:160]}")
            if expected_refusal is None or expected_refusal not in outcomes[0][1]:
                failures.append(f"{name}: refused unexpectedly: {outcomes[0][1]}")
            elif len(messages) != 1 or steps:
                failures.append(f"{name}: refused differently across ranks or after {steps} steps: {messages}")
            continue
        if kind == "crashed" or any(o[0] != kind for o in outcomes):
            failures.append(f"{name}: {[o[0] for o in outcomes]}\n{next(o[1] for o in outcomes if o[0] != 'trained')}")
            table.append(f"{name:12s} CRASHED")
            continue
        if expected_refusal is not None:
            failures.append(f"{name}: trained, but this cell should be refused ({expected_refusal!r})")
        losses = torch.tensor([o[1] for o in outcomes], dtype=torch.float64).mean(0).tolist()
        from parity import ParityRun

        actual = ParityRun(losses, outcomes[0][2])
        float8 = "float8" in layout
        expected = _reference(name, dp, float8)
        sizes = {n: size for o in outcomes for n, size in o[3].items()}
        single = sum(p.numel() for p in zoo.make_model(name).parameters())
        if sum(sizes.values()) != single:
            failures.append(f"{name}: {sum(sizes.values())} parameters under {layout}, {single} in one process")
        if "tp" in layout and rank_zero_plan(outcomes) is None:
            failures.append(f"{name}: no log line says where the tensor-parallel split came from and what it split")
        elif "tp" in layout and ("colwise_gather" in rank_zero_plan(outcomes)) != (name in GATHERED):
            failures.append(f"{name}: attention {'not ' if name in GATHERED else ''}gathered under {layout}: "
                            f"{rank_zero_plan(outcomes)}")
        try:
            loss_error, weight_error = assert_parity(actual, expected, rtol=PARITY_RTOL)
            model_map = rank_zero_plan(outcomes) or ""
            table.append(f"{name:12s} loss {loss_error:.1e}  weights {weight_error:.1e}  {model_map}")
        except AssertionError as error:
            failures.append(f"{name}: {error}")
            table.append(f"{name:12s} DIFFERS: {str(error)[:120]}")
    print(f"\nzoo under {layout}:\n" + "\n".join(table))
    assert not failures, "\n\n".join(failures)


def _built_on_meta(rank: int, world_size: int, layout: str, models: tuple[str, ...]) -> dict:
    import lightning

    from lightning_par.parallel.modules import clean_name

    results = {}
    for name in models:
        trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=make_strategy(layout),
                                    max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, limit_val_batches=0)
        with trainer.init_module(empty_init=True):
            module = zoo.make_model(name)
        on_meta = all(p.is_meta for p in module.parameters())
        recorder = RecordLoss()
        trainer.callbacks.append(recorder)
        trainer.fit(module, datamodule=make_datamodule())
        state = trainer.strategy.consolidated_state_dict()
        sizes = {clean_name(n): p.numel() for n, p in module.named_parameters()}
        results[name] = (on_meta, recorder.losses, {k: bool(torch.isfinite(v).all()) for k, v in state.items()}, sizes)
    return results


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_models_built_on_the_meta_device(layout: str) -> None:
    """Trainer.init_module(empty_init=True): the tensor-parallel check and the pipeline trace run on a small replica, the
    model's own initialisation runs after the split, and a tied head stays tied (on the last stage too)."""
    import math

    models = ("qwen2", "gpt2")  # tied heads; GPT-2 with learned positions
    ranks = run_distributed(_built_on_meta, LAYOUTS[layout][0], layout, models)
    for name in models:
        on_meta, losses, finite, _ = ranks[0][name]
        assert on_meta and all(finite.values()), (name, finite)
        assert all(abs(loss - math.log(zoo.VOCAB)) < 0.5 for loss in losses), (name, losses)  # a fresh model
        # Each distinct parameter under its first name across the ranks: a head untied by the allocation would
        # appear under a name of its own.
        sizes = {n: size for rank in ranks for n, size in rank[name][3].items()}
        assert sum(sizes.values()) == sum(p.numel() for p in zoo.make_model(name).parameters()), name
