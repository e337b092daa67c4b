"""Optimizers step DTensor parameters with their foreach implementation on a CPU.

torch picks an optimizer's foreach implementation by itself only for accelerator tensors; on a CPU it steps one
parameter at a time. With DTensor parameters (ZeRO-3's shards, tensor parallel) every elementwise op of every
parameter then goes through DTensor's Python dispatch: AdamW made 600 of them per step on an 8-block model, and its
step took about 1.3x as long as DDP's on plain tensors (45 ms against 35; with foreach 21 ms). The foreach
implementation dispatches each op once for a whole group of tensors: the same arithmetic, grouped (torchtitan's
default for the same reason).
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def foreach_over_dtensors(optimizer: Optimizer) -> None:
    """Set ``foreach=True`` on each parameter group that left the choice to torch (``None``) and holds only CPU
    DTensors on one mesh (DTensor ops do not mix meshes, nor DTensors with plain tensors)."""
    for group in optimizer.param_groups:
        params = group["params"]
        if "foreach" not in group or group["foreach"] is not None or group.get("fused") or group.get("differentiable"):
            continue
        if params and all(isinstance(p, DTensor) and p.device.type == "cpu" and p.device_mesh == params[0].device_mesh
                          for p in params):
            group["foreach"] = True


__all__ = ["foreach_over_dtensors"]
