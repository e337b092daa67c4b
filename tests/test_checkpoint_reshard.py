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
import zoo
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
        return PipelineParallelStrategy(pipeline_parallel_size=4, pipeline_schedule="gpipe", microbatches=2)
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
    from lightning_par.checkpoint.format import optimizer_state_dict

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


def _module(model: str, tied: bool) -> Any:
    return make_module(tie_embeddings=tied) if model == "llama" else zoo.make_model(model)


def _fit(rank: int, world_size: int, directory: str, strategy: str, seed: int, ckpt_path: str | None,
         max_epochs: int = 1, tied: bool = False, model: str = "llama") -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_par.parallel.modules import clean_name

    torch.manual_seed(seed)
    recorder = RecordLoss()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=world_size, strategy=_strategy(strategy), max_epochs=max_epochs,
        callbacks=[recorder, ModelCheckpoint(dirpath=directory, save_top_k=-1, save_last=True)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    module = _module(model, tied)
    trainer.fit(module, datamodule=make_datamodule(), ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "step": trainer.global_step,
            "weights": trainer.strategy.consolidated_state_dict(),
            "optimizer": _optimizer_state(trainer.strategy, trainer.lightning_module, trainer.optimizers[0]),
            # every distinct parameter under its first name, at its whole size
            "sizes": {clean_name(n): p.numel() for n, p in module.named_parameters()}}


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


def _assert_resharded(saved: list[dict], loaded: list[dict], tied: bool = False, model: str = "llama") -> None:
    assert saved[0]["step"] == loaded[0]["step"] > 0
    assert all(r["losses"] == [] for r in loaded)  # restored at the end of the run: nothing left to train

    weights_a, weights_b = saved[0]["weights"], loaded[0]["weights"]
    assert weights_a and weights_a.keys() == weights_b.keys()
    for name, tensor in weights_a.items():
        assert torch.equal(weights_b[name], tensor), name

    optim_a, optim_b = _merge(saved), _merge(loaded)
    trainable = {name for name, p in _module(model, tied).named_parameters() if p.requires_grad}
    assert optim_a["state"].keys() == optim_b["state"].keys() == trainable
    # AdamW's moments (the reference model), SGD's momentum (the zoo's)
    kinds = {"step", "exp_avg", "exp_avg_sq"} if model == "llama" else {"momentum_buffer"}
    for name, entry in optim_a["state"].items():
        assert entry.keys() == optim_b["state"][name].keys() == kinds, name
        for key, tensor in entry.items():
            other = optim_b["state"][name][key]
            assert other.shape == tensor.shape and torch.equal(other, tensor), (name, key)
        moment = entry.get("exp_avg", entry.get("momentum_buffer"))
        assert moment.shape == weights_a[name].shape, name
        assert "step" not in entry or float(entry["step"]) == saved[0]["step"], name
    assert len(optim_a["param_groups"]) == (2 if model == "llama" else 1)  # AdamW: decayed matrices, undecayed gains
    assert optim_a["param_groups"] == optim_b["param_groups"]  # lr (scheduled), betas, weight decay, ...


def test_zero3_checkpoint_reshards_into_tensor_parallel(tmp_path: Path) -> None:
    """FSDP2 dp_shard DTensors on 2 ranks -> tensor-parallel (colwise/rowwise) DTensors on 2 ranks."""
    saved = run_distributed(_fit, 2, str(tmp_path / "a"), "zero3", 0, None)
    loaded = run_distributed(_fit, 2, str(tmp_path / "b"), "tensor_parallel", 1, str(tmp_path / "a" / "last.ckpt"))
    _assert_resharded(saved, loaded)


def test_fused_qkv_regrouped_for_tensor_parallel_is_saved_and_loaded_in_the_models_order(tmp_path: Path) -> None:
    """litgpt's [q | k | v] of 2 query groups trains under tp2 with its rows regrouped (each rank: the q, k, v of its
    group). The checkpoint holds the model's own order: ZeRO-3, which does not regroup, loads the same weights and
    momenta, and tp2 loading it regroups them again (a load that did not would consolidate to other rows)."""
    saved = run_distributed(_fit, 2, str(tmp_path / "a"), "tensor_parallel", 0, None, model="litgpt_llama")
    checkpoint = str(tmp_path / "a" / "last.ckpt")
    for layout in ("zero3", "tensor_parallel"):
        loaded = run_distributed(_fit, 2, str(tmp_path / layout), layout, 1, checkpoint, model="litgpt_llama")
        _assert_resharded(saved, loaded, model="litgpt_llama")


def test_pipeline_checkpoint_reshards_into_fewer_stages(tmp_path: Path) -> None:
    """pp=4 (one block per rank) -> pp=2 (two blocks per rank): every stage's states find their new rank."""
    saved = run_distributed(_fit, 4, str(tmp_path / "a"), "pp4", 0, None)
    loaded = run_distributed(_fit, 2, str(tmp_path / "b"), "pp2", 1, str(tmp_path / "a" / "last.ckpt"))
    _assert_resharded(saved, loaded)


def test_tied_head_stays_one_tensor_through_save_resume_reshard_and_export(tmp_path: Path) -> None:
    """A head tied to the embedding (tie_embeddings=True) under tensor parallel: one DTensor for both, saved
    once; the run resumed from its epoch-0 checkpoint finishes bitwise like the uninterrupted one; the last
    checkpoint loads into pipeline stages (the embedding on stage 0, the head on stage 1: one copy each, equal,
    the parameter count one process's) with weights and AdamW states unchanged; and it exports as one plain
    file in which both names share one tensor and that loads strictly into the tied model."""
    import torch.distributed.checkpoint as dcp

    from lightning_par.checkpoint.format import export_consolidated

    saved = run_distributed(_fit, 2, str(tmp_path / "a"), "tensor_parallel", 0, None, 2, True)
    single = sum(p.numel() for p in make_module(tie_embeddings=True).parameters())
    assert sum(saved[0]["sizes"].values()) == single
    last = tmp_path / "a" / "last.ckpt"
    stored = set(dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata)
    assert "state_dict.model.embed_tokens.weight" in stored and "state_dict.model.lm_head.weight" not in stored

    epoch0 = next((tmp_path / "a").glob("epoch=0-*.ckpt"))
    resumed = run_distributed(_fit, 2, str(tmp_path / "r"), "tensor_parallel", 1, str(epoch0), 2, True)
    assert resumed[0]["losses"] == saved[0]["losses"][len(saved[0]["losses"]) - len(resumed[0]["losses"]):]
    for name, tensor in saved[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], tensor), name

    loaded = run_distributed(_fit, 2, str(tmp_path / "b"), "pp2", 1, str(last), 2, True)
    _assert_resharded(saved, loaded, tied=True)
    assert sum({n: size for r in loaded for n, size in r["sizes"].items()}.values()) == single

    weights = export_consolidated(last, tmp_path / "model.pt")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported["model.lm_head.weight"].data_ptr() == exported["model.embed_tokens.weight"].data_ptr()
    module = make_module(tie_embeddings=True)
    module.load_state_dict(exported)
    assert module.model.lm_head.weight is module.model.embed_tokens.weight
    assert torch.equal(module.model.lm_head.weight, saved[0]["weights"]["model.lm_head.weight"])
    assert weights.keys() == module.state_dict().keys()
