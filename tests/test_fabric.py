"""Every layout under Lightning Fabric trains what a one-process Fabric loop trains, and Fabric's checkpoints and the
Trainer's load into each other under other layouts.

A hand-written Fabric loop (``fabric.setup(model, optimizer)``, ``fabric.backward``, ``fabric.no_backward_sync``,
``fabric.clip_gradients``; under pipeline parallel ``fabric.strategy.pipeline_step``) trains the project's Llama for
20 AdamW steps on the same global batches as one process; so does litgpt's GPT (Lightning's own LLM library,
written on Fabric) under tp2 and pp2. Each layout saves a sharded checkpoint with ``fabric.save``,
whose consolidated weights are compared with the one-process run's. Then a Trainer under tp2 resumes from the
Fabric zero3 checkpoint for step 21 and saves; a Fabric pp2 loop loads that Trainer checkpoint for step 22: each
step matches one process, which needs both the weights and the AdamW moments to have moved across."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_distributed

from lightning_par.checkpoint.format import consolidated_weights

STEPS = 20
GLOBAL_BATCH = 4
SEQ = 16
VOCAB = 64
LEARNING_RATE = 1e-3
CLIP = 0.5  # below the gradient's norm at the start: clipping acts, so its norm over every shard is checked
PARITY_RTOL = 1e-5
WEIGHT_ATOL = 1e-3 * LEARNING_RATE * STEPS  # AdamW: see parity.assert_parity

# name -> (strategy name or arguments of Hybrid3DStrategy, batches accumulated per step, model)
# zero3 saves in the background (async_save); its checkpoint is then loaded by the Trainer (_checkpoints_across).
TWO_RANKS = {"dp2": ("data_parallel", 2, "llama"), "zero3": (dict(zero_stage=3, async_save=True), 1, "llama"),
             "tp2": ("tensor_parallel", 1, "llama"), "pp2": ("pipeline_parallel", 1, "llama")}
FOUR_RANKS = {"dp2xtp2": (dict(data_parallel_size=2, tensor_parallel_size=2), 2, "llama"),
              "pp2xtp2": (dict(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2), 2, "llama")}
if importlib.util.find_spec("litgpt"):  # Lightning's own LLM library, written on Fabric
    TWO_RANKS.update({"litgpt-tp2": ("tensor_parallel", 1, "litgpt"), "litgpt-pp2": ("pipeline_parallel", 1, "litgpt")})


def _batches() -> torch.Tensor:
    """(STEPS + 2, GLOBAL_BATCH, SEQ + 1) token ids: the global batch of every step."""
    return torch.randint(0, VOCAB, (STEPS + 2, GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))


def _module(model: str = "llama") -> Any:
    """The project's Llama, or litgpt's GPT (LLaMA-style, grouped queries) with the same optimizer."""
    from lightning_par.models import LlamaLM

    torch.manual_seed(1234)
    if model == "litgpt":
        import zoo

        module = zoo.LitGPTLM(**zoo.LITGPT_CONFIGS["litgpt_llama"])
        module.configure_optimizers = lambda: {"optimizer": torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE,
                                                                              weight_decay=0.1)}
    else:
        module = LlamaLM(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                         learning_rate=LEARNING_RATE, weight_decay=0.1, max_steps=10**9)  # the Trainer's LR stays
    module.example_input_array = _batches()[0, :1, :-1]
    return module


def _fabric_loop(strategy: Any, devices: int, steps: range, *, accumulate: int = 1, save: str | None = None,
                 load: str | None = None, model: str = "llama") -> list[float]:
    """Train ``steps`` of the global batches with a hand-written Fabric loop (loading ``load`` first, saving to
    ``save`` at the end); returns each step's loss over the global batch."""
    import lightning as L

    from lightning_par.strategies.fabric import MeshFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    module = _module(model)
    model, optimizer = fabric.setup(module, module.configure_optimizers()["optimizer"])
    laid_out = isinstance(fabric.strategy, MeshFabricStrategy)
    mesh = fabric.strategy.mesh if laid_out else None
    pipelined = laid_out and fabric.strategy.parallel_config.pp > 1
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": optimizer})
    losses = []
    batches = _batches()
    for step in steps:
        batch = batches[step]
        if mesh is not None:  # this rank's share of the global batch
            batch = batch.chunk(mesh.size("dp"))[mesh.local_rank("dp")]
        loss = torch.zeros(())
        for index, micro in enumerate(batch.chunk(accumulate)):
            with fabric.no_backward_sync(model, enabled=index < accumulate - 1):
                if pipelined:
                    part = fabric.strategy.pipeline_step(model, micro, accumulate=accumulate)
                else:
                    inputs, targets = module.split_batch(micro)
                    part = module.loss_fn(model(inputs), targets)
                    fabric.backward(part / accumulate)
            loss += part.detach() / accumulate
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss, reduce_op="mean")))  # dp ranks' means; the others agree
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer, "step": steps.stop})
        fabric.barrier()  # an asynchronous save is in place once every rank is past it
    return losses


def _trainer_step(strategy: Any, devices: int, step: int, *, load: str, save: str) -> float:
    """One Trainer step on global batch ``step``, resumed from ``load``; saves to ``save``."""
    import lightning as L
    from torch.utils.data import DataLoader

    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(trainer.strategy.reduce(outputs["loss"].detach())))

    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=CLIP, callbacks=[Record()])
    rows = DataLoader(list(_batches()[step]), batch_size=GLOBAL_BATCH)
    trainer.fit(_module(), train_dataloaders=rows, ckpt_path=load)
    trainer.save_checkpoint(save)
    return losses[0]


def _layouts(rank: int, world_size: int, layouts: dict[str, tuple[Any, int]], folder: str) -> dict[str, Any]:
    from lightning_par.strategies.fabric import Hybrid3DStrategy

    results: dict[str, Any] = {}
    for name, (strategy, accumulate, model) in layouts.items():
        strategy = Hybrid3DStrategy(**strategy) if isinstance(strategy, dict) else strategy
        results[name] = _fabric_loop(strategy, world_size, range(STEPS), accumulate=accumulate,
                                     save=f"{folder}/{name}", model=model)
    return results


def _checkpoints_across(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from lightning_par.strategies import TensorParallelStrategy
    from lightning_par.strategies.fabric import PipelineParallelStrategy

    trainer = _trainer_step(TensorParallelStrategy(tensor_parallel_size=2), world_size, STEPS,
                            load=f"{folder}/zero3", save=f"{folder}/trainer-tp2")
    fabric = _fabric_loop(PipelineParallelStrategy(microbatches=2), world_size, range(STEPS + 1, STEPS + 2),
                          load=f"{folder}/trainer-tp2", save=f"{folder}/fabric-pp2")
    refused = None
    try:
        import lightning as L

        pipeline = L.Fabric(accelerator="cpu", devices=world_size, strategy="pipeline_parallel")
        pipeline.launch()
        module = _module()
        model = pipeline.setup(module)
        model(_batches()[0, :, :-1])
    except RuntimeError as error:
        refused = str(error)
    return {"trainer": trainer, "fabric": fabric, "refused": refused}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, one Fabric loop: the losses of steps 0..21 and the weights after steps 20, 21 and 22."""
    folder = tmp_path_factory.mktemp("one_process")
    losses = _fabric_loop("auto", 1, range(STEPS), save=str(folder / "20"))
    losses += _fabric_loop("auto", 1, range(STEPS, STEPS + 1), load=str(folder / "20"), save=str(folder / "21"))
    losses += _fabric_loop("auto", 1, range(STEPS + 1, STEPS + 2), load=str(folder / "21"), save=str(folder / "22"))
    weights = {step: torch.load(folder / str(step), weights_only=True)["model"] for step in (20, 21, 22)}
    litgpt = {}
    if importlib.util.find_spec("litgpt"):
        litgpt["losses"] = _fabric_loop("auto", 1, range(STEPS), save=str(folder / "litgpt"), model="litgpt")
        litgpt["weights"] = torch.load(folder / "litgpt", weights_only=True)["model"]
    return {"losses": losses, "weights": weights, "litgpt": litgpt}


def _assert_matches(losses: list[float], weights: dict[str, torch.Tensor], expected_losses: list[float],
                    expected_weights: dict[str, torch.Tensor], label: str) -> None:
    loss_error = max(abs(a - e) / abs(e) for a, e in zip(losses, expected_losses, strict=True))
    assert weights.keys() == expected_weights.keys(), f"{label}: {sorted(weights.keys() ^ expected_weights.keys())}"
    weight_error = max(float((weights[name] - tensor).abs().max()) for name, tensor in expected_weights.items())
    print(f"{label}: loss {loss_error:.1e} relative, weights {weight_error:.1e}")
    assert loss_error <= PARITY_RTOL, f"{label}: losses {losses} against one process's {expected_losses}"
    assert weight_error <= WEIGHT_ATOL, f"{label}: weights differ by {weight_error:.1e}"


def test_every_layout_under_fabric_trains_like_one_process(one_process: dict[str, Any], tmp_path: Path) -> None:
    results = run_distributed(_layouts, 2, TWO_RANKS, str(tmp_path), timeout=300)[0]
    results.update(run_distributed(_layouts, 4, FOUR_RANKS, str(tmp_path), timeout=300)[0])
    for name in (*TWO_RANKS, *FOUR_RANKS):
        weights, rest = consolidated_weights(tmp_path / name)
        assert rest["step"] == STEPS
        expected = (one_process["litgpt"] if name.startswith("litgpt")
                    else {"losses": one_process["losses"], "weights": one_process["weights"][20]})
        _assert_matches(results[name], weights, expected["losses"][:STEPS], expected["weights"], name)
    # The checkpoints move between Fabric and the Trainer, under other layouts (zero3 -> tp2 -> pp2).
    across = run_distributed(_checkpoints_across, 2, str(tmp_path), timeout=300)[0]
    _assert_matches([across["trainer"]], consolidated_weights(tmp_path / "trainer-tp2")[0],
                    one_process["losses"][STEPS:STEPS + 1], one_process["weights"][21], "Fabric zero3 -> Trainer tp2")
    _assert_matches(across["fabric"], consolidated_weights(tmp_path / "fabric-pp2")[0],
                    one_process["losses"][STEPS + 1:], one_process["weights"][22], "Trainer tp2 -> Fabric pp2")
    assert "pipeline_step(model, batch, loss_fn)" in across["refused"]


def test_every_strategy_name_resolves_in_fabric_with_the_trainers_arguments() -> None:
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_par.strategies import STRATEGIES
    from lightning_par.strategies.fabric import MeshFabricStrategy

    names = [name for name, entry in StrategyRegistry.items() if entry["strategy"] in STRATEGIES]
    assert {"data_parallel", "zero1", "zero2", "zero3", "fsdp2", "tensor_parallel", "context_parallel",
            "pipeline_parallel", "expert_parallel", "hybrid3d", "auto_parallel"} <= set(names)
    for name in names:
        strategy = L.Fabric(accelerator="cpu", devices=2, strategy=name).strategy
        assert isinstance(strategy, MeshFabricStrategy), name
        trainer_strategy = StrategyRegistry.get(name)
        assert type(strategy.trainer_strategy) is type(trainer_strategy), name
        assert strategy.parallel_config == trainer_strategy.parallel_config, name
    # The planner reads the model and its data, which Fabric has not seen when it starts the processes.
    with pytest.raises(ValueError, match=r"AutoParallelStrategy: activation_checkpointing, .*, zero_stage left "
                                         r"'auto', and under Fabric the layout is fixed when the processes start"):
        L.Fabric(accelerator="cpu", devices=1, strategy="auto_parallel").launch()


# ------------------------------------------------------------------------------------------ set-up checks
# The checks parallelize() runs on a sample at set-up (lightning_par/parallel/compose.py), by the name it calls them.
SET_UP_CHECKS = ("blocks_used_outside", "check_model_map", "head_follows_last_block", "_check_layout")
# layout -> (Trainer strategy name, mixture-of-experts model)
CHECKED_LAYOUTS = {"zero3": ("zero3", False), "tp2": ("tensor_parallel", False),
                   "cp2": ("context_parallel", False), "pp2": ("pipeline_parallel", False),
                   "ep2": ("expert_parallel", True), "moe-dp2": ("data_parallel", True)}


def _set_up_checks(rank: int, world_size: int, layouts: dict[str, tuple[str, bool]]) -> dict[str, dict[str, list]]:
    """Per layout, the set-up checks parallelize() ran when a Trainer set the model up, and when Fabric did."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_par.models import LlamaLM
    from lightning_par.parallel import compose

    ran: list[str] = []
    for name in SET_UP_CHECKS:
        def spy(*args: Any, _check: Any = getattr(compose, name), _name: str = name, **kwargs: Any) -> Any:
            ran.append(_name)
            return _check(*args, **kwargs)

        setattr(compose, name, spy)

    def module(moe: bool) -> Any:
        torch.manual_seed(0)
        return LlamaLM(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                       **(dict(moe_experts=4, moe_top_k=2) if moe else {}))

    results: dict[str, dict[str, list]] = {}
    for layout, (strategy, moe) in layouts.items():
        ran.clear()
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module(moe), train_dataloaders=DataLoader(list(_batches()[0]), batch_size=GLOBAL_BATCH))
        under_trainer = sorted(set(ran))
        ran.clear()
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        model = module(moe)
        model.example_input_array = _batches()[0][:, :-1]
        fabric.setup(model)
        results[layout] = {"trainer": under_trainer, "fabric": sorted(set(ran))}
    return results


def test_fabric_runs_the_set_up_checks_the_trainer_runs() -> None:
    """The same layout, under the Trainer (the first batch of its data) and under Fabric (the model's
    ``example_input_array``), runs the same set-up checks: ZeRO-3's blocks used outside them and its units, a mixture
    of experts' routing, tensor parallel's split, context parallel's head."""
    results = run_distributed(_set_up_checks, 2, CHECKED_LAYOUTS, timeout=300)[0]
    for layout, checks in results.items():
        assert checks["trainer"] == checks["fabric"] and checks["trainer"], (layout, checks)
