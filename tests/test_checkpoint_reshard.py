"""Sharded checkpoints reshard across layouts with the MODEL AND OPTIMIZER state intact.

A run under layout A trains one epoch and saves ``last.ckpt`` (a DCP directory); a run under layout B
resumes from it with ``max_epochs=1``, so nothing is left to train and whatever B holds after ``fit`` is
exactly what it loaded. Both runs then consolidate the weights and the AdamW state (exp_avg, exp_avg_sq,
step per parameter, keyed by fully qualified name, plus every param group's hyper-parameters) and the test
compares them bitwise: resharding only moves bytes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning
import torch
from harness import run_distributed
from parity import RecordLoss
from test_checkpoint import make_datamodule, make_strategy

from lightning_par.models import LlamaLM

# 4 blocks so that pp=4 gives every stage one; AdamW so there are moments to reshard.
make_module = functools.partial(LlamaLM, vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16,
                                learning_rate=1e-2, warmup_steps=2, max_steps=8)


def _strategy(name: str):
    from lightning_par import PipelineParallelStrategy

    if name == "pp4":  # GPipe: 1F1B would need microbatches >= pp
        return PipelineParallelStrategy(pipeline_parallel_size=4, schedule="gpipe", microbatches=2)
    if name == "pp2":
        return PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2)
    return make_strategy(name, True)


def _whole(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()  # collective over the tensor's mesh: same key order on every rank
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _optimizer_state(strategy: Any, module: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's view of the consolidated optimizer state: {"state": {fqn: {...}}, "param_groups": [...]}.

    Without pipeline stages the library consolidates (``full=True``: whole tensors on rank 0, empty
    elsewhere). With stages every rank holds only its own parameters' states, so each rank returns its
    stage (DTensors made whole) and the test merges the ranks.
    """
    from lightning_par.checkpoint import optimizer_state_dict

    if strategy.mesh.size("pp") == 1:
        full = optimizer_state_dict(module, optimizer, full=True)
    else:
        local = optimizer_state_dict(module, optimizer, full=False)
        full = {"state": {name: {key: _whole(v) for key, v in sorted(entry.items())}
                          for name, entry in sorted(local["state"].items())},
                "param_groups": local["param_groups"]}
    # full=True leaves the ranks other than 0 an empty dict.
    groups = [{key: value for key, value in group.items() if key != "params"} for group in full.get("param_groups", [])]
    state = {name: {key: _whole(v) for key, v in entry.items()} for name, entry in full.get("state", {}).items()}
    return {"state": state, "param_groups": groups}


def _fit(rank: int, world_size: int, directory: str, strategy: str, seed: int, ckpt_path: str | None) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(seed)
    recorder = RecordLoss()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=world_size, strategy=_strategy(strategy), max_epochs=1,
        callbacks=[recorder, ModelCheckpoint(dirpath=directory, save_top_k=0, save_last=True)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(make_module(), datamodule=make_datamodule(), ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "step": trainer.global_step,
            "weights": trainer.strategy.consolidated_state_dict(),
            "optimizer": _optimizer_state(trainer.strategy, trainer.lightning_module, trainer.optimizers[0])}


def _merge(results: list[dict]) -> dict[str, Any]:
    """One {fqn: {state key: tensor}} from every rank's part; a parameter held by several ranks must agree."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for result in results:
        for name, entry in result["optimizer"]["state"].items():
            if name in state:
                assert state[name].keys() == entry.keys(), name
                for key, value in entry.items():
                    assert torch.equal(state[name][key], value), (name, key)
            else:
                state[name] = entry
    groups = [r["optimizer"]["param_groups"] for r in results if r["optimizer"]["param_groups"]]
    assert groups and all(g == groups[0] for g in groups), groups  # hyper-parameters are the same everywhere
    return {"state": state, "param_groups": groups[0]}


def _assert_resharded(saved: list[dict], loaded: list[dict]) -> None:
    assert saved[0]["step"] == loaded[0]["step"] > 0
    assert all(r["losses"] == [] for r in loaded)  # restored at the end of epoch 0: nothing left to train

    weights_a, weights_b = saved[0]["weights"], loaded[0]["weights"]
    assert weights_a and weights_a.keys() == weights_b.keys()
    for name, tensor in weights_a.items():
        assert torch.equal(weights_b[name], tensor), name

    optim_a, optim_b = _merge(saved), _merge(loaded)
    trainable = {name for name, p in make_module().named_parameters() if p.requires_grad}
    assert optim_a["state"].keys() == optim_b["state"].keys() == trainable
    for name, entry in optim_a["state"].items():
        assert entry.keys() == optim_b["state"][name].keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for key, tensor in entry.items():
            other = optim_b["state"][name][key]
            assert other.shape == tensor.shape and torch.equal(other, tensor), (name, key)
        assert entry["exp_avg"].shape == weights_a[name].shape, name
        assert float(entry["step"]) == saved[0]["step"], name
    assert len(optim_a["param_groups"]) == 2  # decayed matrices, undecayed gains
    assert optim_a["param_groups"] == optim_b["param_groups"]  # lr (scheduled), betas, weight decay, ...


def test_zero3_checkpoint_reshards_into_tensor_parallel(tmp_path: Path) -> None:
    """FSDP2 dp_shard DTensors on 2 ranks -> tensor-parallel (colwise/rowwise) DTensors on 2 ranks."""
    saved = run_distributed(_fit, 2, str(tmp_path / "a"), "zero3", 0, None)
    loaded = run_distributed(_fit, 2, str(tmp_path / "b"), "tensor_parallel", 1, str(tmp_path / "a" / "last.ckpt"))
    _assert_resharded(saved, loaded)


def test_pipeline_checkpoint_reshards_into_fewer_stages(tmp_path: Path) -> None:
    """pp=4 (one block per rank) -> pp=2 (two blocks per rank): every stage's states find their new rank."""
    saved = run_distributed(_fit, 4, str(tmp_path / "a"), "pp4", 0, None)
    loaded = run_distributed(_fit, 2, str(tmp_path / "b"), "pp2", 1, str(tmp_path / "a" / "last.ckpt"))
    _assert_resharded(saved, loaded)
