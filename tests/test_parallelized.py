"""parallelize() keeps what it did beside the module (lightning_par.parallel.record), never on it, and hands the
training loop a handle (lightning_par.parallel.parallelized) that answers for it."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed


def _lightning_par_state_on(module: torch.nn.Module) -> list[str]:
    """Attributes of ``module`` and its submodules (the user's: not the stand-ins a pipeline stage puts in place
    of the parts it does not run) that hold lightning_par's parallel or strategy objects."""
    found = []
    for name, sub in module.named_modules():
        if type(sub).__module__.startswith("lightning_par.parallel"):
            continue
        for attribute, value in vars(sub).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            kinds = {type(v).__module__ for v in values}
            if "lightning_par" in attribute or any(k.startswith(("lightning_par.parallel", "lightning_par.strategies"))
                                                   for k in kinds):
                found.append(f"{name or type(module).__name__}.{attribute}")
    return found


def _fit(rank: int, world_size: int, strategy: str) -> dict:
    import lightning

    from lightning_par import Hybrid3DStrategy, ZeroStrategy
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM
    from lightning_par.parallel.record import layout_record

    make = {"pp2xtp2": lambda: Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2),
            "zero2": lambda: ZeroStrategy(zero_stage=2)}[strategy]
    module = LlamaLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=True)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=make(), max_steps=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0)
    trainer.fit(module, datamodule=TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=4,
                                                   num_samples=32))
    handle = trainer.strategy.parallelized
    return {"on_module": _lightning_par_state_on(module), "layout": layout_record(module).layout is not None,
            "stages": len(handle.stages), "ties": handle.ties is not None, "inner": handle.inner is module}


@pytest.mark.parametrize(("layout", "world_size"), [("pp2xtp2", 4), ("zero2", 2)])
def test_nothing_of_lightning_par_is_set_on_the_users_module(layout: str, world_size: int) -> None:
    for result in run_distributed(_fit, world_size, layout):
        assert result["on_module"] == []
        assert result["layout"] and result["inner"]
        if layout == "pp2xtp2":  # stages and the tied embedding's copies are found through the record
            assert result["stages"] == 1 and result["ties"]


# Layouts the handle drives by hand, one of each way of reducing gradients: DDP's hooks, ZeRO-2's reducer,
# after_backward's average (tensor parallel without ZeRO-3; pipeline stages, whose tied copies it also sums).
HAND_LAYOUTS = {
    "dp4 (DDP)": dict(dp_shard=4),
    "dp4 zero2": dict(dp_shard=4, zero_stage=2),
    "dp2 x tp2": dict(dp_shard=2, tp=2),
    "dp2 x pp2, tied": dict(dp_shard=2, pp=2, pp_schedule="gpipe", microbatches=2),
    "dp2 x pp2 zero3, tied": dict(dp_shard=2, pp=2, zero_stage=3, microbatches=2),  # FSDP2 roots per stage
}


def _train_by_hand(rank: int, world_size: int) -> dict:
    """One optimizer step of two accumulated batches, in every layout, driven through the handle alone (no
    Lightning): the loss, the gradient norm and this rank's weights after the step, and the same for one process
    on the whole batch."""
    import copy
    from contextlib import nullcontext

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.models.llama import LlamaConfig, Transformer
    from lightning_par.parallel import derive_model_map, parallelize
    from lightning_par.parallel.modules import clean_name

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()

    dist.init_process_group("gloo")
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))  # the global batch
    results = {}
    for name, sizes in HAND_LAYOUTS.items():
        config = ParallelConfig(**sizes).validate(world_size)
        from lightning_par.parallel.mesh import build_mesh
        mesh = build_mesh(config, "cpu")
        torch.manual_seed(0)
        model = Transformer(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                        tie_embeddings=config.pp > 1))
        reference = copy.deepcopy(model)
        mine = tokens.chunk(config.dp)[mesh.local_rank("dp")]
        halves = mine.chunk(2)  # two accumulated batches of this rank's share
        sample = (halves[0][:, :-1], halves[0][:, 1:])
        handle = parallelize(model, mesh, config, derive_model_map(model), sample_batch=sample, loss_fn=loss_fn,
                             accumulate=2)
        parameters = list(handle.inner.parameters())
        optimizer = handle.shard_optimizer(torch.optim.SGD(parameters, lr=0.5))
        losses = []
        for index, half in enumerate(halves):
            inputs, targets = half[:, :-1], half[:, 1:]
            with handle.no_sync() if index == 0 else nullcontext():
                if handle.pipeline is not None:
                    losses.append(float(handle.pipeline.train_step(inputs, targets, parameters)))
                    handle.pipeline.take_gradients()
                else:
                    with handle.loss_context():
                        loss = loss_fn(handle.module(inputs), targets)
                        (loss / 2).backward()
                    losses.append(float(loss.detach()))
                handle.after_backward()
        norm = handle.gradient_norm(parameters)
        optimizer.step()
        # The share of this rank's parameters it holds at rest: 1/dp of them under ZeRO-3.
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in parameters)
        share = held / sum(p.numel() for p in parameters)
        weights = {clean_name(n): whole(p) for n, p in handle.inner.named_parameters()}

        loss = loss_fn(reference(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        expected_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])))
        torch.optim.SGD(reference.parameters(), lr=0.5).step()
        expected = {clean_name(n): p.detach() for n, p in reference.named_parameters()}
        mean_loss = torch.tensor(sum(losses) / 2)
        dist.all_reduce(mean_loss, group=mesh.group("dp"))
        results[name] = {"loss": float(mean_loss) / config.dp, "expected_loss": float(loss), "norm": norm,
                         "expected_norm": expected_norm, "share": share, "zero_stage": config.zero_stage,
                         "weight_error": max(float((weights[n] - expected[n]).abs().max()) for n in weights)}
    return results


def test_the_handle_trains_every_way_of_reducing_gradients_without_lightning() -> None:
    for by_layout in run_distributed(_train_by_hand, 4):
        for name, result in by_layout.items():
            assert result["loss"] == pytest.approx(result["expected_loss"], abs=1e-5), name
            assert result["norm"] == pytest.approx(result["expected_norm"], rel=1e-5), name
            assert result["weight_error"] < 1e-5, name
            if result["zero_stage"] == 3:
                assert result["share"] == pytest.approx(0.5, abs=0.01), name  # dp2: half of every tensor, at rest


def _after_backward_messages(rank: int, world_size: int, cap_mb: float) -> dict:
    """The all-reduces after_backward sends under dp2 x tp2 (no DDP: the handle averages), with buckets of at most
    ``cap_mb`` MiB, and the gradient bytes they carry."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.models.llama import LlamaConfig, Transformer
    from lightning_par.parallel import derive_model_map, parallelize

    dist.init_process_group("gloo")
    config = ParallelConfig(dp_shard=2, tp=2, ddp_bucket_cap_mb=cap_mb).validate(world_size)
    from lightning_par.parallel.mesh import build_mesh
    mesh = build_mesh(config, "cpu")
    torch.manual_seed(0)
    model = Transformer(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))  # one batch: tp ranks agree
    handle = parallelize(model, mesh, config, derive_model_map(model), sample_batch=(tokens[:, :-1], tokens[:, 1:]))
    with handle.loss_context():
        F.cross_entropy(handle.module(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    sent, original = [], dist.all_reduce
    dist.all_reduce = lambda tensor, *args, **kwargs: sent.append(tensor.numel() * tensor.element_size()) or \
        original(tensor, *args, **kwargs)
    try:
        handle.after_backward()
    finally:
        dist.all_reduce = original
    grads = [p.grad for p in handle.inner.parameters() if p.grad is not None]
    local = [(g.to_local() if hasattr(g, "to_local") else g) for g in grads]
    return {"sent": sent, "gradient_bytes": sum(g.numel() * g.element_size() for g in local),
            "largest_gradient": max(g.numel() * g.element_size() for g in local)}


def test_gradients_averaged_after_backward_go_in_buckets() -> None:
    """Every gradient byte goes once, in messages no larger than the bucket unless one gradient is larger alone:
    the flat copy the reduction needs is one bucket, not the whole gradient."""
    cap = 0.01  # MiB: this model's 62 KB of gradients per tp rank in 7 buckets
    for result in run_distributed(_after_backward_messages, 4, cap):
        assert sum(result["sent"]) == result["gradient_bytes"]
        assert len(result["sent"]) > 5
        assert max(result["sent"]) <= max(cap * 2**20, result["largest_gradient"])
    whole = run_distributed(_after_backward_messages, 4, 25.0)[0]
    assert len(whole["sent"]) == 1 and whole["sent"][0] == whole["gradient_bytes"]
