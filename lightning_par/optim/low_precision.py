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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                           memory_format=torch.preserve_format)
                moments = [state["exp_avg"].float(), state["exp_avg_sq"].float()]
                adamw([p], [p.grad], moments[:1], moments[1:], [], [state["step"]], foreach=False, amsgrad=False,
                      beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                      eps=group["eps"], maximize=False)
                for stored, moment in zip((state["exp_avg"], state["exp_avg_sq"]), moments):
                    stored.copy_(moment)
        return loss


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


__all__ = ["AdamWBF16States", "state_bytes"]
