"""Data parallelism: replicate the model, average gradients over the data-parallel ranks.

Built on PyTorch's ``DistributedDataParallel`` (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB): gradients are all-reduced in buckets that overlap with the
backward pass. Optional gradient compression casts each bucket to bf16/fp16 before the all-reduce and
back afterwards, halving the bytes on the wire at a small cost in precision.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_par.parallel.buckets import all_reduce_in_buckets, local_tensor
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.modules import is_expert

# The group that averages gradients: every rank that trains on different tokens. Context-parallel
# ranks hold different chunks of the same sequences, so their gradients are summed in too.
GRADIENT_GROUP = "dp_cp"

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's own default for the initial broadcast

_COMPRESSION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compressed_allreduce_hook(dtype: torch.dtype) -> Callable[[dist.ProcessGroup, dist.GradBucket], Future]:
    """A DDP comm hook that averages each gradient bucket in ``dtype`` (half the bytes of fp32).

    PyTorch's own bf16 hook refuses anything but NCCL/XCCL; this one runs on gloo too. The division by
    the group size happens before the cast so that the sum cannot overflow fp16's range.
    """

    # No annotations on purpose: DDP checks them against the real classes, and this module's postponed
    # annotations would be strings.
    def hook(group, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        compressed = buffer.div(group.size()).to(dtype)
        reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(future: Future) -> torch.Tensor:
            buffer.copy_(future.value()[0])
            return buffer

        return reduced.then(decompress)

    return hook


def apply_data_parallel(
    module: nn.Module,
    mesh: ParallelMesh,
    *,
    bucket_cap_mb: float = 25.0,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    gradient_compression: str = "none",
    device_ids: list[int] | None = None,
) -> nn.Module:
    """Wrap ``module`` in DDP over the data-parallel ranks of ``mesh``.

    Returns ``module`` unchanged when there is a single data-parallel rank: there is nothing to average
    and DDP's bucketing would only cost memory.
    """
    if mesh.size(GRADIENT_GROUP) == 1:
        return module
    group = mesh.group(GRADIENT_GROUP)
    # DTensor parameters (experts split over ranks) are reduced by the technique that split them.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, _dtensor_names(module))
    ddp = DistributedDataParallel(
        module,
        device_ids=device_ids,
        process_group=group,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
    )
    if gradient_compression != "none":
        if gradient_compression not in _COMPRESSION_DTYPES:
            raise ValueError(
                f"gradient_compression={gradient_compression!r} is not one of {('none', *_COMPRESSION_DTYPES)}"
            )
        ddp.register_comm_hook(group, compressed_allreduce_hook(_COMPRESSION_DTYPES[gradient_compression]))
    return ddp


def token_share(count: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """``count`` (the loss-taking tokens of this data-parallel rank's batch) x dp / their sum over the dp ranks: the
    factor that turns this rank's mean loss into its part of the mean over the global batch's tokens, once gradients
    are averaged over dp. Under prompt masking or packed documents the ranks' batches take their loss on different
    numbers of tokens; a plain average of their means would weigh a token of a short-answer batch more than one of a
    long-answer batch, unlike one process on the whole batch (the normalisation Megatron-LM and torchtitan apply).
    Collective over the ``dp`` ranks."""
    return (count.to(torch.float64) * mesh.size("dp") / global_tokens(count, mesh)).to(torch.float32)


def global_tokens(count: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """The sum of ``count`` over the data-parallel ranks (at least 1, so that dividing by it is safe), in float64.
    Collective over the ``dp`` ranks."""
    total = count.detach().to(torch.float64).clone()
    if mesh.size("dp") > 1:
        dist.all_reduce(total, group=mesh.group("dp"))
    return total.clamp(min=1)


def broadcast_replicas(module: nn.Module, mesh: ParallelMesh) -> None:
    """Copy parameters and buffers from data-parallel rank 0 to the other replicas.

    DDP does this when it wraps a module; evaluation without the wrapper, and layouts whose gradients are
    reduced by :func:`reduce_gradients`, need it too, or replicas that were initialised differently would
    drift apart. Tensor-parallel shards are copied shard by shard; experts are left to their own ranks.
    """
    if mesh.size(GRADIENT_GROUP) == 1:
        return
    with torch.no_grad():
        tensors = [local_tensor(t) for t in [*module.parameters(), *module.buffers()] if not is_expert(t)]
        dist._broadcast_coalesced(mesh.group(GRADIENT_GROUP), tensors, _BROADCAST_BUCKET_BYTES, 0)


@torch.no_grad()
def reduce_gradients(module: nn.Module, mesh: ParallelMesh, *, bucket_cap_mb: float = 25.0) -> None:
    """Average the gradients of ``module`` over the data-parallel (x context-parallel) ranks, in place.

    For layouts DDP cannot wrap: pipeline stages (DDP's hooks sit on the whole module, which a schedule
    never calls) and tensor-parallel DTensors. Called once after the last backward of an optimizer step,
    as Megatron-LM does under pipeline parallelism (Narayanan et al. 2021): the gradients of all micro-
    batches are reduced together, flattened into buckets of at most ``bucket_cap_mb`` MiB per dtype (one
    larger gradient makes a bucket of its own), so the ranks exchange few large messages and the copy a bucket
    needs stays that small. Expert gradients are left alone: expert parallel reduces them over its own
    replicas.
    """
    if mesh.size(GRADIENT_GROUP) == 1:
        return
    grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None and not is_expert(p)]
    all_reduce_in_buckets(grads, mesh.group(GRADIENT_GROUP), bucket_cap_mb=bucket_cap_mb,
                          divide_by=mesh.size(GRADIENT_GROUP))


def _dtensor_names(module: nn.Module) -> list[str]:
    return [name for name, tensor in [*module.named_parameters(), *module.named_buffers()]
            if isinstance(tensor, DTensor)]


def no_allreduce(module: nn.Module) -> AbstractContextManager:
    """Skip the gradient all-reduce for backward passes inside the context (gradient accumulation).

    Gradients accumulate locally and are averaged once, on the last micro-batch before the optimizer
    step: the same result as averaging every micro-batch, at 1/k of the communication.
    """
    if isinstance(module, DistributedDataParallel):
        if module.static_graph:
            # PyTorch's DDP asserts on the first backward when a static graph meets no_sync(), and once
            # past that stops averaging gradients (pytorch/pytorch#143580, #187732). Synchronising
            # every micro-batch gives the same gradients at k times the traffic.
            return nullcontext()
        return module.no_sync()
    return nullcontext()


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (identity for anything else)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


__all__ = ["apply_data_parallel", "broadcast_replicas", "compressed_allreduce_hook", "no_allreduce", "reduce_gradients",
           "unwrap", "GRADIENT_GROUP"]
