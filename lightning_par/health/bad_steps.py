"""Steps whose update would harm the model, found before the optimizer applies it, alike on every rank.

A non-finite loss or gradient on one rank (an overflow, a corrupt sample, a faulty device) reaches every replica
through the gradient reduction, or, under tensor or pipeline parallel, only the ranks that hold that piece: the
other ranks would step with good gradients and the model's pieces would stop fitting together. :class:`BadStepGuard`
looks at the step once the gradients are reduced: each rank checks its own loss and gradient pieces, and one
all-reduce of three numbers gives every rank the same verdict. A bad step is skipped (the gradients are dropped, so
no optimizer moves and its states stay as they were), counted, and after ``max_in_a_row`` bad steps in a row the
run stops, naming the step, the first rank that saw a non-finite value and the parameter. Megatron-LM skips an
iteration whose gradients overflowed in the same way (Shoeybi et al. 2019, mixed precision's loss scaling), and so
does DeepSpeed; OPT's logbook (Zhang et al. 2022) and PaLM (Chowdhery et al. 2022, section 5.1) describe loss spikes
handled by skipping batches, which :attr:`BadSteps.loss_spike_factor` does by rule: a step whose loss, averaged over
the ranks, exceeds that many times the median of the last ``spike_window`` good steps is skipped too.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["BadSteps", "BadStepGuard", "BadStepsError"]


@dataclass(frozen=True)
class BadSteps:
    """What counts as a bad step, and how many in a row a run survives.

    Args:
        skip_nonfinite: skip a step whose loss or gradient is NaN or infinite on any rank (False: step anyway).
        max_in_a_row: stop the run after this many bad steps in a row (0: never stop).
        loss_spike_factor: also skip a step whose loss exceeds this many times the median loss of the last
            ``spike_window`` good steps (None: no spike rule); the rule waits for ``spike_window // 2`` steps.
        spike_window: how many recent good steps' losses the median is taken over.
    """

    skip_nonfinite: bool = True
    max_in_a_row: int = 3
    loss_spike_factor: float | None = None
    spike_window: int = 50

    def __post_init__(self) -> None:
        if self.max_in_a_row < 0:
            raise ValueError(f"bad_steps.max_in_a_row={self.max_in_a_row}: a count of steps, 0 (never stop) or more")
        if self.loss_spike_factor is not None and not self.loss_spike_factor > 1:
            raise ValueError(f"bad_steps.loss_spike_factor={self.loss_spike_factor}: a factor above 1 (a loss that "
                             "many times the recent median is a spike), or None for no spike rule")
        if self.spike_window < 2:
            raise ValueError(f"bad_steps.spike_window={self.spike_window}: at least 2 steps to take a median over")

    @classmethod
    def of(cls, value: BadSteps | dict[str, Any] | None) -> BadSteps:
        """The rule a strategy argument gives: itself, its fields as a dict (YAML), or the default for None."""
        if value is None:
            return cls()
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"bad_steps has no field {', '.join(map(repr, unknown))}: its fields are "
                                 f"{', '.join(cls.__dataclass_fields__)}")
            return cls(**value)
        return value

    @property
    def checks(self) -> bool:
        return self.skip_nonfinite or self.loss_spike_factor is not None


class BadStepsError(RuntimeError):
    """Raised alike on every rank when ``max_in_a_row`` steps in a row were bad."""


@dataclass
class Verdict:
    """Why a step is skipped, the same on every rank."""

    reason: str
    loss: float | None


class BadStepGuard:
    """Judges each step before the optimizer applies it (see the module docstring); keeps the count."""

    def __init__(self, rule: BadSteps) -> None:
        self.rule = rule
        self.skipped = 0
        self.in_a_row = 0
        self.recent_losses: deque[float] = deque(maxlen=rule.spike_window)

    def judge(self, loss: Tensor | None, named_grads: Iterable[tuple[str, Tensor]], step: int, *,
              device: torch.device, group: dist.ProcessGroup | None = None,
              last_checkpoint: str | None = None) -> Verdict | None:
        """None when the step may be applied; else the verdict, counted. Collective over ``group`` (every rank of
        the run by default): one all-reduce, and on a non-finite step a second one and a broadcast to name where.
        Raises :class:`BadStepsError` at the ``max_in_a_row``-th bad step in a row."""
        named_grads = [(name, g.to_local() if isinstance(g, DTensor) else g) for name, g in named_grads]
        nonfinite = torch.zeros((), device=device)
        if self.rule.skip_nonfinite and named_grads:
            norms = torch._foreach_norm([g for _, g in named_grads])
            nonfinite = (~torch.isfinite(torch.stack([n.to(device, torch.float32) for n in norms]).sum())).float()
        if isinstance(loss, DTensor):  # a loss computed on sharded logits (loss parallel)
            loss = loss.full_tensor()
        has_loss = loss is not None and loss.numel() > 0
        loss_value = loss.detach().float().mean().to(device) if has_loss else torch.zeros((), device=device)
        if self.rule.skip_nonfinite and has_loss:
            nonfinite = torch.maximum(nonfinite, (~torch.isfinite(loss_value)).float())
        totals = torch.stack([nonfinite, torch.nan_to_num(loss_value, nan=0.0, posinf=0.0, neginf=0.0),
                              torch.tensor(float(has_loss), device=device)])
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.all_reduce(totals, group=group)
        bad_ranks, loss_sum, ranks_with_loss = totals.tolist()
        mean_loss = loss_sum / ranks_with_loss if ranks_with_loss else None
        verdict = None
        if bad_ranks:
            verdict = Verdict(self._where(float(nonfinite), named_grads, loss_value, device, group, distributed),
                              mean_loss)
        elif self._spikes(mean_loss):
            median = statistics.median(self.recent_losses)
            verdict = Verdict(f"its loss {mean_loss:.4g} is {mean_loss / median:.3g} times the median "
                              f"{median:.4g} of the last {len(self.recent_losses)} steps "
                              f"(loss_spike_factor={self.rule.loss_spike_factor})", mean_loss)
        if verdict is None:
            self.in_a_row = 0
            if mean_loss is not None:
                self.recent_losses.append(mean_loss)
            return None
        self.skipped += 1
        self.in_a_row += 1
        if self.rule.max_in_a_row and self.in_a_row >= self.rule.max_in_a_row:
            where = (f"the last complete checkpoint is {last_checkpoint}" if last_checkpoint
                     else "no checkpoint was written in this run")
            raise BadStepsError(f"{self.in_a_row} bad steps in a row (bad_steps.max_in_a_row="
                                f"{self.rule.max_in_a_row}), the last at step {step}: {verdict.reason}. Training "
                                f"stopped; {where}")
        return verdict

    def _spikes(self, mean_loss: float | None) -> bool:
        factor = self.rule.loss_spike_factor
        if factor is None or mean_loss is None or len(self.recent_losses) < max(2, self.rule.spike_window // 2):
            return False
        return mean_loss > factor * statistics.median(self.recent_losses)

    def _where(self, nonfinite: float, named_grads: list[tuple[str, Tensor]], loss: Tensor, device: torch.device,
               group: dist.ProcessGroup | None, distributed: bool) -> str:
        """Where the first rank with a non-finite value saw it (a second all-reduce and a broadcast; bad steps only)."""
        mine = _first_nonfinite(named_grads, loss) if nonfinite else None
        if not distributed:
            return mine or "a non-finite value"
        rank = dist.get_rank()
        first = torch.tensor(float(rank if mine else dist.get_world_size()), device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        box = [mine]
        dist.broadcast_object_list(box, src=int(first.item()), group=group)
        return f"rank {int(first.item())}: {box[0]}"

    def state_dict(self) -> dict[str, Any]:
        return {"rule": asdict(self.rule), "skipped": self.skipped, "in_a_row": self.in_a_row,
                "recent_losses": list(self.recent_losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped, self.in_a_row = int(state["skipped"]), int(state["in_a_row"])
        self.recent_losses.clear()
        self.recent_losses.extend(float(x) for x in state["recent_losses"])


def _first_nonfinite(named_grads: list[tuple[str, Tensor]], loss: Tensor) -> str:
    if not math.isfinite(float(loss)):
        return f"the loss is {float(loss)}"
    for name, grad in named_grads:
        if not bool(torch.isfinite(grad).all()):
            return f"the gradient of {name} holds {_kind(grad)}"
    return "the gradient norm overflows"


def _kind(tensor: Tensor) -> str:
    return "NaN" if bool(torch.isnan(tensor).any()) else "an infinite value"
