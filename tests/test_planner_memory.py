"""The planner's model-state memory against measurement for the compositions the strategies run.

Acceptance: "The planner's memory model matches measurement within 5% for the new compositions on CPU ranks":
pipeline x ZeRO-1, pipeline x ZeRO-3 (each stage an FSDP2 root), experts x ZeRO-3 (experts split over ``ep`` and
sharded over the ranks of ``dp_shard x cp`` that hold the same experts), experts x pipeline, and sharded
accumulation, ZeRO-1/2 with experts. Each layout trains a small reference model for a few AdamW steps through the ``parallelize`` handle
(what the strategies drive) and counts, per rank, the bytes of its parameter shards, of the gradients it holds and of
its optimizer states. Every pipeline rank (the largest count over the data-parallel ranks of its stage) is compared
with the planner's breakdown of that rank (``memory.rank_memory``), and the largest count over all ranks with the
planner's answer (``estimate_memory``: its heaviest pipeline rank).

Activations are not compared here: they are not the same at every step on CPU ranks (an MoE's tokens per expert) and
``tests/test_planner.py`` checks their derivation. Counts only: nothing here depends on how long a step takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lightning_par.parallel.mesh import build_mesh
from lightning_par.layout.config import ParallelConfig
from lightning_par.planner import ModelSpec
from lightning_par.planner.memory import MemoryBreakdown, estimate_memory, rank_memory

MODEL = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16)
MOE = dict(moe_experts=4, moe_top_k=2)
SEQ_LEN, BATCH = 16, 4  # BATCH: samples per data-parallel rank and optimizer step
STEPS = 2  # the optimizer creates its states on the first step; counted after the second
TOLERANCE = 0.05  # the bound, per term and per pipeline rank
TERMS = ("parameters", "gradients", "optimizer_states")


@dataclasses.dataclass(frozen=True)
class Case:
    """A layout of ``world_size`` ranks: ParallelConfig arguments, the model's extra arguments, and the batches
    accumulated per optimizer step (pipeline layouts cut each batch into ``microbatches`` instead)."""

    world_size: int
    config: dict
    model: dict = dataclasses.field(default_factory=dict)
    accumulate: int = 1


CASES = {
    # Megatron's distributed optimizer: each stage's AdamW states over the stage's data-parallel ranks.
    "pp2 x dp2 zero1": Case(4, dict(pp=2, dp_shard=2, zero_stage=1, microbatches=2)),
    # torchtitan's PP x FSDP: every stage an FSDP2 root over its embedding or norm and head; tied: the last stage
    # holds (a shard of) its own copy of the embedding for the head.
    "pp2 x dp2 zero3": Case(4, dict(pp=2, dp_shard=2, zero_stage=3, microbatches=2)),
    "pp2 x dp2 zero3 tied": Case(4, dict(pp=2, dp_shard=2, zero_stage=3, microbatches=2),
                                 dict(tie_embeddings=True)),
    # torchtitan's EP x FSDP: at dp2 x ep2 nothing shards the experts, at dp4 x ep2 two ranks hold each half.
    "ep2 x dp2 zero3": Case(2, dict(dp_shard=2, ep=2, zero_stage=3), MOE),
    "ep2 x dp4 zero3": Case(4, dict(dp_shard=4, ep=2, zero_stage=3), MOE),
    # Experts inside pipeline stages (gradients averaged after the schedule).
    "pp2 x ep2 x dp2": Case(4, dict(pp=2, dp_shard=2, ep=2, microbatches=2), MOE),
    # ZeRO-1/2 with experts: their states (and stage 2's gradients) over the 2 ranks holding each half, the rest
    # over all 4.
    "ep2 x dp4 zero1": Case(4, dict(dp_shard=4, ep=2, zero_stage=1), MOE),
    "ep2 x dp4 zero2": Case(4, dict(dp_shard=4, ep=2, zero_stage=2), MOE),
    # Gradients reduced on every accumulated batch: between batches each rank holds its part only. (Without
    # sharded_accumulation they stay whole until the last: the control.)
    "dp2 zero2 sharded acc3": Case(2, dict(dp_shard=2, zero_stage=2, sharded_accumulation=True), accumulate=3),
    "dp2 zero3 sharded acc3": Case(2, dict(dp_shard=2, zero_stage=3, sharded_accumulation=True), accumulate=3),
    "dp2 zero3 acc3": Case(2, dict(dp_shard=2, zero_stage=3), accumulate=3),
}


def _local_bytes(tensor: Any) -> int:
    """Bytes of ``tensor`` this rank holds (its shard of a DTensor; 0 for None)."""
    if tensor is None:
        return 0
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def _gradient_bytes(modules: list) -> int:
    """Gradient bytes this rank holds for ``modules`` (the model, and its pipeline stages, which are FSDP2 roots of
    their own): the parameters' ``.grad`` (this rank's shard of a DTensor), the whole gradients FSDP2 accumulates
    inside its units, and ZeRO-2's reduced running sums (as tests/test_zero.py counts them). Each storage once: while
    an FSDP2 unit is gathered its module's parameters are the unsharded ones, whose ``.grad`` FSDP2 also holds."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_par.parallel.record import layout_record

    grads = [p.grad for module in modules for p in module.parameters()]
    units = {id(unit): unit for module in modules for unit in module.modules() if isinstance(unit, FSDPModule)}
    for unit in units.values():
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                grads += [param.unsharded_accumulated_grad,
                          getattr(getattr(param, "_unsharded_param", None), "grad", None)]
    for module in modules:
        record = layout_record(module)
        if record is not None and record.gradient_reducer is not None:
            grads += record.gradient_reducer._accumulated.values()
    storages = {}
    for grad in grads:
        if grad is not None:
            storage = (grad.to_local() if hasattr(grad, "to_local") else grad).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class _GradientPeak:
    """Called at the moments gradients are counted; keeps the most gradient bytes ``modules`` held at any of them."""

    def __init__(self, modules: list) -> None:
        self.modules, self.peak = modules, 0

    def __call__(self) -> None:
        self.peak = max(self.peak, _gradient_bytes(self.modules))


def _when_each_block_starts_backward(module: Any, model_map: Any, record: Callable[[], None]) -> list:
    """Call ``record()`` as the backward of every block of ``module`` begins: inside a pipeline schedule, between the
    backwards of its micro-batches, is when a stage holds the most gradient. (A hook on the block's output gradient,
    added before the pipeline's own forward hooks, one of which ends a stage's forward by raising.)"""
    import torch

    def attach(block: Any, args: Any, output: Any) -> None:
        tensor = output if torch.is_tensor(output) else next(t for t in output if torch.is_tensor(t))
        if tensor.requires_grad:
            tensor.register_hook(lambda grad: record())

    return [module.get_submodule(name).register_forward_hook(attach, prepend=True) for name in model_map.block_names(module)]


def _measure(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, int]]:
    """Train every case of ``names`` in turn on these ranks; per case, this rank's pipeline coordinate and the bytes
    it holds: parameter shards, the most gradient bytes held at any point counted (after each accumulated batch and
    each step; under a pipeline also inside the schedule), and AdamW's states after the last step."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_par.models import LlamaLM
    from lightning_par.parallel.compose import parallelize
    from lightning_par.parallel.model_map import resolve_model_map

    dist.init_process_group("gloo")
    results = {}
    for name in names:
        case = CASES[name]
        config = ParallelConfig(**case.config).validate(world_size)
        torch.manual_seed(0)
        module = LlamaLM(**MODEL, **case.model)
        mesh = build_mesh(config, "cpu")
        generator = torch.Generator().manual_seed(mesh.local_rank("dp"))  # ranks of one pipeline read alike
        batches = [torch.randint(0, MODEL["vocab_size"], (BATCH // case.accumulate, SEQ_LEN + 1), generator=generator)
                   for _ in range(STEPS * case.accumulate)]
        sample = module.split_batch(batches[0][: BATCH // config.microbatches])
        model_map = resolve_model_map(None, module)
        handle = parallelize(module, mesh, config, model_map, sample_batch=sample, loss_fn=module.loss_fn,
                             accumulate=case.accumulate)
        inner = handle.inner
        modules = [inner, *(stage.submod for stage in handle.stages)]
        parameters = list(inner.parameters())
        optimizer = handle.shard_optimizer(torch.optim.AdamW(parameters, lr=1e-3))
        record = _GradientPeak(modules)
        # Outside a pipeline a step's gradients are counted between its batches: what a rank holds from one to the
        # next. Inside a backward FSDP2 holds one more unit whole until its reduce-scatter, a transient the planner
        # counts among its communication buffers, not its gradients. A pipeline schedule runs all micro-batches of a
        # batch at once: it is looked inside, as each block's backward begins.
        hooks = _when_each_block_starts_backward(inner, model_map, record) if handle.pipeline is not None else []
        for step in range(STEPS):
            for micro in range(case.accumulate):
                inputs, targets = module.split_batch(batches[step * case.accumulate + micro])
                last = micro == case.accumulate - 1
                if handle.pipeline is not None:
                    handle.pipeline.train_step(inputs, targets, parameters)
                    handle.pipeline.take_gradients()
                else:
                    with contextlib.nullcontext() if last else handle.no_sync(), handle.loss_context():
                        (module.loss_fn(handle.module(inputs), targets) / case.accumulate).backward()
                handle.after_backward()
                record()
            optimizer.step()
            record()
            if step < STEPS - 1:
                optimizer.zero_grad(set_to_none=True)
        for hook in hooks:
            hook.remove()
        local_optimizers = [part.optim for part in getattr(optimizer, "parts", [optimizer])
                 if isinstance(part, ZeroRedundancyOptimizer)] or [optimizer]
        states = sum(_local_bytes(v) for local in local_optimizers for state in local.state.values() for v in state.values()
                     if torch.is_tensor(v) and v.dim() > 0)  # AdamW's step counts are 0-d
        results[name] = {"pp_rank": mesh.local_rank("pp"), "parameters": sum(_local_bytes(p) for p in parameters),
                         "gradients": record.peak, "optimizer_states": states}
        dist.barrier()
    dist.destroy_process_group()
    return results


def _predict(name: str) -> tuple[MemoryBreakdown, tuple[MemoryBreakdown, ...]]:
    """The planner's answer for ``name`` and its breakdown of every pipeline rank."""
    from lightning_par.models.llama import LlamaConfig

    case = CASES[name]
    config = ParallelConfig(**case.config).validate(case.world_size)
    spec = ModelSpec.from_llama_config(LlamaConfig(**MODEL, **case.model))
    microbatches = config.microbatches if config.pp > 1 else case.accumulate
    knobs = dict(seq_len=SEQ_LEN, microbatch_size=BATCH // microbatches, precision="32-true",
                 microbatches=microbatches)
    return estimate_memory(spec, config, **knobs), rank_memory(spec, config, **knobs)


def test_planner_model_states_match_measurement_for_the_new_compositions() -> None:
    """Parameters, gradients and optimizer states within 5% of the planner's, for each
    composition: on every pipeline rank (the most any of its data-parallel ranks holds against the planner's breakdown
    of that pipeline rank), and on the most loaded rank (the most any rank holds against the planner's answer, its
    heaviest pipeline rank). Measured: every term within 0.2%."""
    from harness import run_distributed

    by_size: dict[int, list[str]] = {}
    for name, case in CASES.items():
        by_size.setdefault(case.world_size, []).append(name)
    measured = {world_size: run_distributed(_measure, world_size, names, timeout=240)  # one launch per world size
                for world_size, names in by_size.items()}
    rows, failures = [], []
    for name, case in CASES.items():
        answer, per_stage = _predict(name)
        ranks = [r[name] for r in measured[case.world_size]]
        compared = [(f"pp rank {stage}", predicted, [r for r in ranks if r["pp_rank"] == stage])
                    for stage, predicted in enumerate(per_stage)] if len(per_stage) > 1 else []
        compared.append(("most loaded", answer, ranks))
        for where, predicted, held in compared:
            for term in TERMS:
                value = max(r[term] for r in held)
                ratio = getattr(predicted, term) / value
                rows.append(f"{name:<24} {where:<12} {term:<16} {value:>8d} {getattr(predicted, term):>10.0f} "
                            f"{ratio:6.3f}")
                if abs(ratio - 1) > TOLERANCE:
                    failures.append(rows[-1])
    print("\ncomposition              rank         term             measured  predicted  ratio (bytes)\n"
          + "\n".join(rows))
    assert not failures, "\n".join(failures)
