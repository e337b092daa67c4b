"""The automatic planner: its memory model against measurement, its choices against practice, its errors, its CLI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lightning_par.config import ParallelConfig
from lightning_par.planner import (
    ClusterSpec,
    ModelSpec,
    TrainingSpec,
    calibrate,
    estimate_memory,
    estimate_step_time,
    explain,
    format_table,
    plan_layouts,
)
from lightning_par.planner.cluster import GiB
from lightning_par.planner.report import layout_name
from lightning_par.planner.time import spans

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ memory vs measurement
MODEL = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)
SEQ_LEN, GLOBAL_BATCH = 64, 4
LAYOUTS = {  # name: ParallelConfig arguments (world size 2)
    "dp2 zero0": dict(dp_shard=2, zero_stage=0),
    "dp2 zero1": dict(dp_shard=2, zero_stage=1),
    "dp2 zero2": dict(dp_shard=2, zero_stage=2),
    "dp2 zero3": dict(dp_shard=2, zero_stage=3),
    "tp2": dict(tp=2, dp_shard=1),
    "tp2 sp": dict(tp=2, dp_shard=1, sequence_parallel=True),
    "tp2 sp lp": dict(tp=2, dp_shard=1, sequence_parallel=True, loss_parallel=True),
    "cp2 ulysses": dict(cp=2, dp_shard=1, cp_method="ulysses"),
    "cp2 ring": dict(cp=2, dp_shard=1, cp_method="ring"),
    "dp2 zero0 full-AC": dict(dp_shard=2, activation_checkpointing="full"),
    "dp2 zero3 full-AC": dict(dp_shard=2, zero_stage=3, activation_checkpointing="full"),
}
TOLERANCE = 0.15  # the acceptance bound on the per-rank total


def _measure_layouts(rank: int, world_size: int, layouts: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Bytes this rank holds for each layout: parameter shards, gradients after backward, AdamW states after a
    step, and the activations one forward + loss saves for backward (each storage once, weights excluded)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from lightning_par.models.llama import LlamaConfig, Transformer
    from lightning_par.parallel.compose import parallelize, parallelize_optimizer
    from lightning_par.parallel.data import unwrap
    from lightning_par.parallel.plan import derive_plan
    from lightning_par.parallel.tensor import vocab_parallel_loss

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    def nbytes(tensors) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)

    dist.init_process_group("gloo")
    results = {}
    for name, kwargs in layouts.items():
        config = ParallelConfig(**kwargs).validate(world_size)
        torch.manual_seed(0)
        model = Transformer(LlamaConfig(**MODEL))
        module = parallelize(model, config.build_mesh("cpu"), config, derive_plan(model))
        mesh = config.build_mesh("cpu")
        inner = unwrap(module)
        optimizer = parallelize_optimizer(torch.optim.AdamW(inner.parameters(), lr=1e-3), module, mesh, config)
        batch = GLOBAL_BATCH // config.dp
        tokens = torch.randint(0, MODEL["vocab_size"], (batch, SEQ_LEN + 1), generator=torch.Generator().manual_seed(rank))

        def weights() -> set[int]:
            tensors = [*inner.parameters(), *inner.buffers()]
            return {local(t).untyped_storage().data_ptr() for t in tensors}

        saved = []
        resident = weights()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with vocab_parallel_loss(config.loss_parallel):
                logits = module(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
        resident |= weights()  # FSDP2's root unit stays gathered after forward: weights, not activations
        storages = {}
        for t in saved:
            storage = local(t).untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in resident:  # FSDP2 frees its gathers: 0 bytes
                storages[storage.data_ptr()] = storage.nbytes()
        with vocab_parallel_loss(config.loss_parallel):
            loss.backward()
        gradients = nbytes(p.grad for p in inner.parameters())
        optimizer.step()
        inner_optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the real one
        states = nbytes(v for state in inner_optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.dim() > 0)
        results[name] = {"parameters": nbytes(inner.parameters()), "gradients": gradients,
                         "optimizer_states": states, "activations": sum(storages.values())}
        del saved, logits, loss
    dist.destroy_process_group()
    return results


def _predict(name: str, world_size: int) -> dict[str, float]:
    from lightning_par.models.llama import LlamaConfig

    config = ParallelConfig(**LAYOUTS[name]).validate(world_size)
    memory = estimate_memory(ModelSpec.from_llama_config(LlamaConfig(**MODEL)), config, seq_len=SEQ_LEN,
                             micro_batch_size=GLOBAL_BATCH // config.dp, precision="32-true")
    return {"parameters": memory.parameters, "gradients": memory.gradients,
            "optimizer_states": memory.optimizer_states, "activations": memory.activations + memory.logits,
            "total": memory.resident}


def test_memory_model_matches_measured_bytes_per_rank() -> None:
    """ACCEPTANCE: the predicted per-rank total (model states + saved activations) within 15% of the measured
    one for every layout (fp32, no communication buffers or transients: those are not saved tensors)."""
    from harness import run_distributed

    per_rank = run_distributed(_measure_layouts, 2, LAYOUTS, timeout=240)
    rows, failures = [], []
    for name in LAYOUTS:
        predicted = _predict(name, 2)
        for rank, measured_all in enumerate(per_rank):
            measured = dict(measured_all[name])
            measured["total"] = sum(measured.values())
            error = predicted["total"] / measured["total"] - 1
            rows.append(f"{name:<20} rank {rank}  " + "  ".join(
                f"{k[:6]} {measured[k] / 1e6:6.3f}/{predicted[k] / 1e6:6.3f}" for k in predicted) + f"  {error:+.1%}")
            if abs(error) > TOLERANCE:
                failures.append(rows[-1])
    print("\nmeasured/predicted MB per rank:\n" + "\n".join(rows))
    assert not failures, failures
