"""Gradients reduced in flat buckets: few large messages instead of one per tensor, with a copy per bucket no larger
than its cap (the bucketing of PyTorch's DDP, Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training"). Shared by the data-parallel average (``ddp.py``), ZeRO's reduction to owners (``zero.py``) and
tensor parallel's replicated gradients (``tensor.py``).

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def all_reduce_in_buckets(grads: list[torch.Tensor], group: dist.ProcessGroup, *, bucket_cap_mb: float = 25.0,
                          divide_by: int = 1) -> None:
    """All-reduce ``grads`` (plain tensors) over ``group`` in place, flattened into buckets of at most
    ``bucket_cap_mb`` MiB per dtype, the sums divided by ``divide_by``."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)

    def all_reduce(flat: torch.Tensor) -> bool:
        dist.all_reduce(flat, group=group)
        return True

    for same in by_dtype.values():
        average_in_buckets(same, bucket_cap_mb, all_reduce, divide_by)


def average_in_buckets(grads: list[torch.Tensor], bucket_cap_mb: float, reduce: Callable[[torch.Tensor], bool],
                       ranks: int) -> None:
    """Flatten ``grads`` (one dtype) into buckets of at most ``bucket_cap_mb`` MiB, ``reduce`` each flat bucket
    (it returns whether this rank holds the sum), and give the sum divided by ``ranks`` back to the gradients."""
    for bucket in buckets_of(grads, bucket_cap_mb * 1024 * 1024):
        flat = torch._utils._flatten_dense_tensors(bucket)
        if reduce(flat):
            flat.div_(ranks)
            for grad, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                grad.copy_(reduced)


def buckets_of(tensors: list[torch.Tensor], cap_bytes: float) -> list[list[torch.Tensor]]:
    """``tensors`` in order, in consecutive groups of at most ``cap_bytes`` (a larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return [bucket for bucket in buckets if bucket]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local part if it is a DTensor, else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


__all__ = ["all_reduce_in_buckets", "average_in_buckets", "buckets_of", "local_tensor"]
