"""Muon for a model's hidden matrices and AdamW for the rest, as one optimizer that any layout can shard.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; Liu et al. 2025, "Muon is
Scalable for LLM Training") steps a matrix by the orthogonalised (Newton-Schulz) Nesterov momentum of its gradient.
It suits the blocks' matrices; embeddings, the output head and gains train with AdamW (Loshchilov & Hutter 2019).
Lightning's automatic optimization takes one optimizer, so :class:`MuonWithAdamW` holds both kinds of parameter
groups (``use_muon`` per group, as Jordan's ``MuonWithAuxAdam``) and steps each as torch's own optimizers do:
``torch.optim.Muon``'s update and learning-rate adjustment, ``torch.optim.adamw``'s kernel. The Newton-Schulz
iteration is torch's with the precision as a setting: ``ns_dtype="bfloat16"`` (torch's, bit for bit) or
``"float32"``, for runs that must match another layout closely: in bf16 a gradient's last-bit difference (a sum
over ranks in another order) can move an element across a bf16 rounding boundary, a relative 4e-3 of that element.

The orthogonalisation needs each whole matrix, whatever the layout keeps of it:

* ZeRO-1/2 give each rank whole parameters to step (``ZeroRedundancyOptimizer``'s partition), so each matrix is
  orthogonalised once, by its owner: the distributed Muon of Liu et al. (sec. 2.3) without its gathers.
* Where a rank holds a shard (ZeRO-3/FSDP2's ``Shard(0)``, tensor parallel's rows or columns), the momentum stays
  sharded and its update is all-gathered (``DTensor.full_tensor``), orthogonalised on every rank of the shard's
  mesh, and each rank keeps its own shard of the result. Every rank then computes what one process computes from the
  same matrix (no partial sums in another order), at the price of the iteration's FLOPs on every rank of the mesh and
  one all-gather of the matrix per step: the gather Liu et al. (sec. 2.3) describe, without spreading the iteration
  over ranks.
* A stack of matrices (grouped experts' ``(experts, in, out)`` weights) is orthogonalised matrix by matrix; expert
  parallel splits the stack by whole experts, so each rank orthogonalises its own experts without gathering.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_par.optim.low_precision import adamw_step, loss_of


def _torch_muon() -> Any:
    try:
        from torch.optim import _muon
    except ImportError as error:  # torch.optim.Muon arrived in torch 2.9
        raise ImportError(f"optimizer muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}") \
            from error
    return _muon


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the parameter groups with ``use_muon=True`` (matrices, or stacks of matrices), AdamW on the others.

    ``lr`` and ``weight_decay`` are both kinds'; with ``adjust_lr_fn="match_rms_adamw"`` (the default) Muon's update
    is scaled to AdamW's RMS (Liu et al. 2025), so one learning rate and weight decay tuned for AdamW serve both.
    """

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] | None = None,
                 adjust_lr_fn: str | None = "match_rms_adamw", ns_dtype: str = "bfloat16",
                 use_muon: bool = False) -> None:
        muon = _torch_muon()
        if not 0.0 < lr:
            raise ValueError(f"lr={lr!r} must be a positive number")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum!r} must be in [0, 1) (Muon's momentum, e.g. 0.95)")
        if ns_dtype not in ("bfloat16", "float32"):  # a name: checkpoints hold the groups' settings, not torch objects
            raise ValueError(f"ns_dtype={ns_dtype!r} is not 'bfloat16' or 'float32'")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} is not one of None, 'original', 'match_rms_adamw'")
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=tuple(ns_coefficients or (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)),
                        adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, use_muon=use_muon)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if group["use_muon"] and p.ndim not in (2, 3):
                    raise ValueError(f"Muon steps matrices (or stacks of them); a parameter of shape {tuple(p.shape)} "
                                     "belongs in a group with use_muon=False (AdamW)")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = loss_of(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                for p in params:
                    self._muon_step(p, group)
            else:
                adamw_step(self, params, group)
        return loss

    def _muon_step(self, param: Tensor, group: dict[str, Any]) -> None:
        muon = _torch_muon()
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
        buffer, grad, momentum = state["momentum_buffer"], param.grad, group["momentum"]
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        orthogonal = _orthogonalized(update, lambda matrix: newton_schulz(
            matrix, group["ns_coefficients"], group["ns_steps"], getattr(torch, group["ns_dtype"])))
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(orthogonal.to(param.dtype), alpha=-muon._adjust_lr(lr, group["adjust_lr_fn"], param.shape[-2:]))


def newton_schulz(matrix: Tensor, coefficients: tuple[float, float, float], steps: int, dtype: torch.dtype,
                  eps: float = 1e-7) -> Tensor:
    """``torch.optim.Muon``'s quintic Newton-Schulz iteration (Jordan et al. 2024), computed in ``dtype``: the
    matrix scaled to spectral norm at most 1, then ``X <- aX + (bA + cA^2)X`` with ``A = XX^T``, on the wide side."""
    a, b, c = coefficients
    x = matrix.to(dtype, copy=True)  # scaled in place below: never the caller's tensor (a momentum buffer)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _orthogonalized(update: Tensor, orthogonalize: Any) -> Tensor:
    """``orthogonalize`` applied to each whole matrix of ``update`` (a matrix or a stack), returned as ``update`` is
    laid out: a DTensor's shards are gathered first, unless they are whole matrices of a stack (split along dim 0)."""
    if isinstance(update, DTensor):
        whole_matrices = update.ndim == 3 and all(
            isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0)
            for placement in update.placements)
        if whole_matrices:
            local = _orthogonalized(update.to_local(), orthogonalize)
            return DTensor.from_local(local, update.device_mesh, update.placements, shape=update.shape,
                                      stride=update.stride())
        whole = _orthogonalized(update.full_tensor(), orthogonalize)
        replicated = DTensor.from_local(whole, update.device_mesh, [Replicate()] * update.device_mesh.ndim)
        return replicated.redistribute(update.device_mesh, update.placements)
    if update.ndim == 3:
        return torch.stack([orthogonalize(matrix) for matrix in update])
    return orthogonalize(update)


def muon_parameter_groups(matrices: list[Tensor], others: list[Tensor], *, weight_decay: float) -> list[dict]:
    """Parameter groups for :class:`MuonWithAdamW`: ``matrices`` with Muon, ``others`` with AdamW (matrices among
    them, the embedding and head, decayed; vectors, the gains, not)."""
    groups = [
        {"params": matrices, "use_muon": True, "weight_decay": weight_decay},
        {"params": [p for p in others if p.dim() >= 2], "use_muon": False, "weight_decay": weight_decay},
        {"params": [p for p in others if p.dim() < 2], "use_muon": False, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


__all__ = ["MuonWithAdamW", "muon_parameter_groups", "newton_schulz"]
