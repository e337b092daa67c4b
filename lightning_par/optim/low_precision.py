"""AdamW with its moments stored in bfloat16 beside the fp32 weights the layout keeps.

AdamW (Loshchilov & Hutter 2019) keeps two moments per parameter, 8 of the 16 bytes of fp32 model states. Storing them
in bf16 (Megatron-Core's precision-aware optimizer, ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``) leaves
``4 + 4 + 4 = 12`` bytes a parameter before ZeRO divides them. Each step reads the moments into fp32, runs
``torch.optim.adamw``'s own kernel on them and the fp32 weights, and rounds the new moments to bf16 (to nearest).
Every element is stepped on its own, so a layout's shards (ZeRO-3, tensor parallel) and partitions (ZeRO-1/2) step
as one process steps the same elements. A moment whose fp32 value lies at a bf16 rounding boundary is rounded to
either side by a last-bit difference of its gradient (a sum over ranks in another order): a relative 4e-3 of that
moment, where fp32 moments differ by 1e-7.

For 8-bit and 4-bit moments (block-wise quantised, Dettmers et al. 2022), torchao's ``AdamW8bit`` and ``AdamW4bit``
are used as they are (``lightning_par.models.lightning_module.warmup_cosine_optimizer``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw


class AdamWBF16States(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with ``exp_avg`` and ``exp_avg_sq`` held in bfloat16."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        if not 0.0 < lr:
            raise ValueError(f"lr={lr!r} must be a positive number")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        # torch's load_state_dict casts every state tensor to its parameter's dtype: back to bf16 (exactly: the
        # values were bf16).
        self.register_load_state_dict_post_hook(_moments_in_bf16)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = loss_of(closure)
        for group in self.param_groups:
            adamw_step(self, [p for p in group["params"] if p.grad is not None], group, torch.bfloat16)
        return loss


def loss_of(closure: Any) -> Any:
    """What an optimizer's ``step(closure)`` returns: the closure's loss, computed with gradients on, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def adamw_step(optimizer: torch.optim.Optimizer, params: list[Tensor], group: dict[str, Any],
               moment_dtype: torch.dtype | None = None) -> None:
    """One AdamW step of ``params`` (one of ``optimizer``'s groups) with torch's single-tensor kernel, its moments
    kept in ``optimizer.state``: in the parameters' dtype, as ``torch.optim.AdamW`` keeps them, or in
    ``moment_dtype``, read into fp32 for the step and rounded back (to nearest)."""
    if not params:
        return
    for p in params:
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
    stored = [(optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]) for p in params]
    moments = stored if moment_dtype is None else [(m.float(), v.float()) for m, v in stored]
    beta1, beta2 = group["betas"]
    # foreach=False: the single-tensor kernel runs on any device and on DTensor shards alike.
    adamw(params, [p.grad for p in params], [m for m, _ in moments], [v for _, v in moments], [],
          [optimizer.state[p]["step"] for p in params], foreach=False, amsgrad=False, beta1=beta1, beta2=beta2,
          lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
    for pair, fp32 in zip(stored, moments):
        for tensor, value in zip(pair, fp32):
            if tensor is not value:
                tensor.copy_(value)


def _moments_in_bf16(optimizer: torch.optim.Optimizer) -> None:
    for state in optimizer.state.values():
        for name in ("exp_avg", "exp_avg_sq"):
            if name in state:
                state[name] = state[name].to(torch.bfloat16)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors ``optimizer`` keeps in its state on this rank (a DTensor's local shard; a quantised
    tensor subclass's codes and scales), counting each storage once."""
    storages: dict[int, int] = {}

    def visit(tensor: Tensor) -> None:
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        if hasattr(tensor, "__tensor_flatten__"):  # torchao's OptimState8bit / 4bit: codes, scales, a code book
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                visit(getattr(tensor, name))
            return
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor) and value.dim() > 0:
                visit(value)
    return sum(storages.values())


__all__ = ["AdamWBF16States", "adamw_step", "loss_of", "state_bytes"]
