"""Code written for Lightning's own strategies trains the same when only the strategy name changes, or is refused
before step 0 with the line to add.

Each client of ``tests/clients.py`` (Lightning's demos as shipped, a step that calls ``self.model``, a two-input
forward, litgpt's pretraining flow under Fabric with ``empty_init=True``) trains 20 steps under lightning_par's
strategies and under Lightning's own ``ddp`` at the same data-parallel degree (Lightning's ``fsdp`` and
``ModelParallelStrategy`` need CUDA; ZeRO and tensor parallel compute what ``ddp`` computes), same seed, same data:
per-step losses and final weights agree within 1e-5 relative, or within 3x the distance between Lightning's own ddp on
2 ranks and on 1 where that is larger (each test prints which). Dropout is on where the layout keeps every rank's
activations whole (data parallel, ZeRO 1-3: the masks are Lightning's own, and the bound is 1e-5). Under tensor and context parallel a
rank holds part of an activation and draws its own mask for it (docs/tensor_parallel.md, "Dropout"), which one
process cannot draw, so those clients run without dropout. Every other outcome is a refusal on every rank before step
0 whose message holds the code to add.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_distributed
from parity import ParityRun, max_relative_error

STEPS = 20
GLOBAL_BATCH = 8
RTOL = 1e-5

# Layouts by name: (world size, data-parallel degree, strategy).
LAYOUTS = {
    "data_parallel": (2, 2, "data_parallel"), "zero1": (2, 2, "zero1"), "zero2": (2, 2, "zero2"),
    "zero3": (2, 2, "zero3"), "tensor_parallel": (2, 1, "tensor_parallel"),
    "context_parallel": (2, 1, dict(context_parallel_size=2)), "pipeline_parallel": (2, 1, "pipeline_parallel"),
    "expert_parallel": (2, 2, "expert_parallel"),
    "hybrid3d": (4, 2, dict(tensor_parallel_size=2, zero_stage=3)),
    "pp2xtp2": (4, 1, dict(pipeline_parallel_size=2, tensor_parallel_size=2)),
    "pp2xzero3": (4, 2, dict(pipeline_parallel_size=2, zero_stage=3)),
}
WITH_DROPOUT = ("demo_transformer", "demo_lstm")
DATA_PARALLEL = ("data_parallel", "zero1", "zero2", "zero3")
MODEL_PARALLEL = ("tensor_parallel", "context_parallel", "hybrid3d")
TRAINS = {  # client -> the layouts it trains in like Lightning's ddp
    "demo_transformer": DATA_PARALLEL, "demo_lstm": DATA_PARALLEL, "demo_boring": DATA_PARALLEL,
    "demo_transformer_without_dropout": ("tensor_parallel", "hybrid3d"),
    "calls_its_model": DATA_PARALLEL + MODEL_PARALLEL, "two_inputs": DATA_PARALLEL + MODEL_PARALLEL,
    # its split, forward and loss (the model's own, from its labels) derived under pipeline parallel
    "hf_by_hand": ("zero3", "tensor_parallel", "hybrid3d", "pipeline_parallel", "pp2xtp2"),
    "hf_dict_batches": ("pipeline_parallel", "pp2xzero3"),  # padded, masked: a loss over each rank's tokens
    # its split and loss derived under pipeline parallel, alone and beside tensor parallel or ZeRO-3
    "plain_pairs": ("data_parallel", "pipeline_parallel", "pp2xtp2", "pp2xzero3"),
}
REFUSED = {  # (client, layout) -> what the refusal shows
    ("demo_boring", "tensor_parallel"): "model_map: {blocks: ..., styles: {...}}",
    ("demo_lstm", "tensor_parallel"): "model_map: {blocks: ..., styles: {...}}",
    ("demo_lstm", "context_parallel"): "model_map: {blocks: ...}",
    ("demo_boring", "pipeline_parallel"): "def split_batch(self, batch): return batch[:, :-1], batch[:, 1:]",
    ("demo_transformer_without_dropout", "pipeline_parallel"): "def forward(self, inputs): return self.model(inputs)",
    ("demo_transformer_without_dropout", "context_parallel"): "context_parallel_size=1",
    ("calls_its_model", "pipeline_parallel"): "def loss_fn(self, logits, targets): return F.cross_entropy(",
    ("two_inputs", "pipeline_parallel"): "def forward(self, inputs): return self.model(inputs)",
    ("calls_its_model", "expert_parallel"): "Use expert_parallel_size=1 for this model",
    ("hf_cuts_its_batch", "pipeline_parallel"): "computes the model's input_ids from the batch",
    # The step hands the model all 17 tokens of a sample (the model shifts its labels itself).
    ("hf_by_hand", "context_parallel"): "sequence length 17 is not divisible by 2",
}


def _strategy(layout: str, *, fabric: bool = False) -> Any:
    """The strategy of ``layout`` by name, or built from its arguments (Fabric's counterpart with ``fabric``)."""
    if layout == "lightning":
        return "ddp"
    strategy = LAYOUTS[layout][2]
    if isinstance(strategy, dict):
        from lightning_par import strategies
        from lightning_par.strategies import fabric as fabric_strategies

        kind = "ContextParallelStrategy" if "context_parallel_size" in strategy else "Hybrid3DStrategy"
        return getattr(fabric_strategies if fabric else strategies, kind)(**strategy)
    return strategy


def _trainer_run(client: str, layout: str, dp: int, world_size: int) -> tuple[list[float], dict | None]:
    """``client`` trained for STEPS steps by a Trainer in ``layout`` (``lightning``: Lightning's ddp); this rank's
    losses and, on rank 0, the whole weights."""
    import lightning as L
    from clients import TRAINER_CLIENTS, client_data

    import lightning_par  # noqa: F401 - registers the strategy names

    L.seed_everything(0, verbose=False)
    module = TRAINER_CLIENTS[client]()
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=_strategy(layout), max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Record()])
    trainer.fit(module, client_data(client, GLOBAL_BATCH // dp))
    consolidated = getattr(trainer.strategy, "consolidated_state_dict", None)
    state = consolidated() if consolidated is not None else {k: v.detach().clone() for k, v in
                                                             module.state_dict().items()}
    return losses, (state if trainer.global_rank == 0 else None)


def _runs(rank: int, world_size: int, cases: list[tuple[str, str, int]]) -> dict[tuple[str, str], tuple]:
    return {(client, layout): _trainer_run(client, layout, dp, world_size) for client, layout, dp in cases}


def _refusals(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    import lightning as L
    import torch.distributed as dist
    from clients import TRAINER_CLIENTS, client_data

    import lightning_par  # noqa: F401

    refusals = {}
    for client, layout in cases:
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=_strategy(layout), max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False)
        try:
            trainer.fit(TRAINER_CLIENTS[client](), client_data(client, GLOBAL_BATCH))
        except (ValueError, TypeError) as error:
            refusals[(client, layout)] = f"{type(error).__name__}: {error}"
            if trainer.global_step != 0:
                refusals[(client, layout)] = f"after {trainer.global_step} steps: {error}"
        else:
            refusals[(client, layout)] = "trained"
        if dist.is_initialized():
            dist.barrier()  # every rank got here: nobody is left waiting in a collective
    return refusals


def _mean_losses(per_rank: list[dict], key: tuple[str, str]) -> torch.Tensor:
    # Ranks that read the same samples (a tensor-parallel group) report the same loss: the mean over every rank is the
    # mean over the data-parallel ranks.
    return torch.tensor([ranks[key][0] for ranks in per_rank], dtype=torch.float64).mean(0)


def _errors(actual: tuple[torch.Tensor, dict], expected: tuple[torch.Tensor, dict]) -> tuple[float, float]:
    """(largest loss error, largest weight error), relative (parity.max_relative_error)."""
    return max_relative_error(ParityRun(actual[0].tolist(), actual[1]), ParityRun(expected[0].tolist(), expected[1]))


@pytest.fixture(scope="module")
def trainer_runs() -> dict[tuple[str, str], tuple[torch.Tensor, dict]]:
    """Every case of TRAINS, and Lightning's ddp for each client on 1 and 2 ranks, one launch per world size: (mean
    loss of each step, rank 0's weights)."""
    cases: dict[int, list[tuple[str, str, int]]] = {dp: [(client, "lightning", dp) for client in TRAINS]
                                                     for dp in (1, 2)}
    for client, layouts in TRAINS.items():
        for layout in layouts:
            world_size, dp, _ = LAYOUTS[layout]
            cases.setdefault(world_size, []).append((client, layout, dp))
    results = {}
    for world_size, listed in sorted(cases.items()):
        per_rank = run_distributed(_runs, world_size, listed, timeout=540)
        for client, layout, dp in listed:
            key = (client, layout)
            results[key if layout != "lightning" else (client, f"lightning dp{world_size}")] = (
                _mean_losses(per_rank, key), per_rank[0][key][1])
    return results


@pytest.mark.parametrize(("client", "layout"), [(c, la) for c, layouts in TRAINS.items() for la in layouts])
def test_a_client_trains_as_under_lightnings_ddp(trainer_runs: dict, client: str, layout: str) -> None:
    """Within 1e-5 of Lightning's ddp at the same data-parallel degree, or within 3x Lightning's own distance between
    ddp on 2 ranks and on 1 (the same global batches, summed in another order) where that is larger: the rounding this
    client's training amplifies in 20 steps. The test prints which bound held."""
    assert len(trainer_runs[(client, layout)][0]) == STEPS
    loss_error, weight_error = _errors(trainer_runs[(client, layout)],
                                       trainer_runs[(client, f"lightning dp{LAYOUTS[layout][1]}")])
    lightnings = ((0.0, 0.0) if client in WITH_DROPOUT else  # ddp on 2 ranks draws other masks than on 1
                  _errors(trainer_runs[(client, "lightning dp2")], trainer_runs[(client, "lightning dp1")]))
    loss_bound, weight_bound = (max(RTOL, 3 * distance) for distance in lightnings)
    print(f"{client} under {layout}: losses {loss_error:.1e}, weights {weight_error:.1e} relative to Lightning's ddp; "
          f"bounds {loss_bound:.1e}, {weight_bound:.1e} ({'1e-5' if max(lightnings) * 3 <= RTOL else '3x Lightning'}"
          f"'s own {lightnings[0]:.1e}, {lightnings[1]:.1e})")
    assert loss_error <= loss_bound and weight_error <= weight_bound, (loss_error, weight_error)


def test_a_client_a_layout_cannot_train_is_refused_before_step_0_with_the_line_to_add() -> None:
    per_rank = run_distributed(_refusals, 2, list(REFUSED), timeout=540)
    for case, shown in REFUSED.items():
        messages = {ranks[case] for ranks in per_rank}
        assert len(messages) == 1, (case, messages)  # the same refusal on every rank
        message = messages.pop()
        assert message != "trained" and not message.startswith("after"), (case, message)
        assert shown in message, (case, message)


# ------------------------------------------------------------------------------------------ Fabric
FABRIC_TRAINS = {"litgpt": ("data_parallel", "zero3", "tensor_parallel", "hybrid3d"),
                 "two_inputs": ("tensor_parallel", "hybrid3d")}


def _fabric_runs(rank: int, world_size: int, cases: list[tuple[str, str, int]]) -> dict[tuple[str, str], tuple]:
    import lightning as L
    from clients import FABRIC_CLIENTS

    import lightning_par  # noqa: F401

    results = {}
    for client, layout, dp in cases:
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=_strategy(layout, fabric=True))
        fabric.launch()
        losses, model = FABRIC_CLIENTS[client](fabric, STEPS, GLOBAL_BATCH // dp, example_input=layout != "lightning")
        if layout == "lightning":
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            from lightning_par.checkpoint.format import model_state_dict

            state = model_state_dict(fabric.strategy.parallelized.inner, full=True)
        key = (client, layout if layout != "lightning" else f"lightning dp{dp}")
        results[key] = (losses, state if rank == 0 else None)
    return results


def _fabric_refusal(rank: int, world_size: int) -> str:
    import lightning as L
    from clients import litgpt_pretraining

    import lightning_par  # noqa: F401

    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="tensor_parallel")
    fabric.launch()
    try:
        litgpt_pretraining(fabric, 1, GLOBAL_BATCH, example_input=False)
    except ValueError as error:
        return str(error)
    return "trained"


@pytest.fixture(scope="module")
def fabric_runs() -> dict[tuple[str, str], tuple[torch.Tensor, dict]]:
    cases: dict[int, list[tuple[str, str, int]]] = {}
    for client, layouts in FABRIC_TRAINS.items():
        for layout in layouts:
            world_size, dp, _ = LAYOUTS[layout]
            cases.setdefault(world_size, []).append((client, layout, dp))
            if (client, "lightning", dp) not in cases.setdefault(dp, []):
                cases[dp].append((client, "lightning", dp))
    results = {}
    for world_size, listed in sorted(cases.items()):
        per_rank = run_distributed(_fabric_runs, world_size, listed, timeout=540)
        for key in per_rank[0]:
            results[key] = (torch.tensor([ranks[key][0] for ranks in per_rank], dtype=torch.float64).mean(0),
                            per_rank[0][key][1])
    return results


@pytest.mark.parametrize(("client", "layout"), [(c, la) for c, layouts in FABRIC_TRAINS.items() for la in layouts])
def test_a_fabric_loop_trains_as_under_lightnings_ddp(fabric_runs: dict, client: str, layout: str) -> None:
    """litgpt's pretraining flow (``empty_init=True``, litgpt's own initialisation: every layout starts from the weights
    ddp starts from, each rank's part of one draw) and a two-input model (``example_input_array`` a tuple of both):
    20 steps as under Lightning's ddp."""
    assert len(fabric_runs[(client, layout)][0]) == STEPS
    loss_error, weight_error = _errors(fabric_runs[(client, layout)],
                                       fabric_runs[(client, f"lightning dp{LAYOUTS[layout][1]}")])
    print(f"{client} under Fabric, {layout}: losses {loss_error:.1e}, weights {weight_error:.1e}")
    assert loss_error <= RTOL and weight_error <= RTOL, (loss_error, weight_error)


def test_fabric_asks_for_its_one_line_before_step_0() -> None:
    messages = set(run_distributed(_fabric_refusal, 2))
    assert len(messages) == 1, messages
    assert "model.example_input_array = " in messages.pop()


def _state_dict_read_directly(rank: int, world_size: int) -> tuple[dict, dict]:
    """litgpt's GPT (q, k and v fused in one projection, which tensor parallel regroups by rank) set up under tp2 by
    Fabric, its ``state_dict()`` read as user code reads it; and the state dict of the model as built."""
    import lightning as L
    from clients import LITGPT_CONFIG
    from litgpt import GPT, Config

    import lightning_par  # noqa: F401

    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="tensor_parallel")
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(Config(**LITGPT_CONFIG))
    built = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.example_input_array = torch.randint(0, 64, (2, 16))
    model = fabric.setup(model)
    read = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return read, built


def test_state_dict_under_tensor_parallel_is_in_the_models_own_order() -> None:
    """Anything that reads ``model.state_dict()`` (and gathers its DTensors) gets the weights as the model stores them,
    not in the order tensor parallel trains a fused projection's rows in."""
    for read, built in run_distributed(_state_dict_read_directly, 2):
        fused = [name for name in built if "attn.qkv.weight" in name]
        assert fused and read.keys() >= built.keys()
        for name, value in built.items():
            assert torch.equal(read[name], value), name
