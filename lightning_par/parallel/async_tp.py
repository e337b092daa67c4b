"""Async tensor parallel: sequence parallel's collectives cut into pieces that overlap the matmuls beside them
(Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models"; torch's micro-pipelined TP, as torchtitan enables it).

Under sequence parallel each column-parallel matmul waits for an all-gather of the sequence and each
row-parallel one is followed by a reduce-scatter. Inductor's ``_micro_pipeline_tp`` pass finds these pairs in a
compiled block and replaces each by a fused op that moves one rank's piece over symmetric memory while the
previous piece is multiplied. Symmetric memory is CUDA's (peer-to-peer device memory within a node): on any
other device the run is refused with that reason, not trained without the overlap it asked for.
"""

from __future__ import annotations

import torch


def enable_async_tensor_parallel(device: torch.device) -> None:
    """Turn on inductor's micro-pipelined tensor parallel for the blocks this process compiles; raise
    ``ValueError`` where symmetric memory does not exist. (Inductor's setting is per process: every block this
    process compiles afterwards is rewritten.)"""
    if device.type != "cuda":
        raise ValueError(f"async_tp=True overlaps collectives through CUDA symmetric memory (NCCL ranks on one node "
                         f"reading each other's device memory), which a {device.type} device does not have; set "
                         "async_tp=False (sequence parallel then waits for each collective)")
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True


__all__ = ["enable_async_tensor_parallel"]
