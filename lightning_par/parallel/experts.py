"""Mixture-of-experts feed-forward: a router sends each token to ``top_k`` of ``n_experts`` SwiGLU experts.

Routing follows the sparsely-gated MoE (Shazeer et al. 2017) as used in GShard (Lepikhin et al. 2021),
Switch Transformer (Fedus et al. 2022) and Mixtral (Jiang et al. 2024): a linear router scores the
experts, a softmax (in fp32) turns scores into probabilities, each token goes to its ``top_k`` experts
and their outputs are summed with the (renormalised, for ``top_k > 1``) probabilities as weights.

Capacity (GShard, Switch): with ``capacity_factor`` set, each expert takes at most
``ceil(capacity_factor * T * top_k / n_experts)`` assignments from each sequence of ``T`` tokens; later
ones are dropped (the token's residual connection carries it on). Assignments are served in priority
order — every token's first choice before any second choice, then by position — as in GShard.
``capacity_factor=None`` is dropless: every assignment is computed. Capacity is counted per sequence
(GShard's groups), so which tokens are dropped does not depend on how the batch is spread over ranks.

Auxiliary losses, added to the training loss by the model with their weights:

- load balancing (Switch, eq. 4): ``n_experts * sum_e f_e * P_e`` per sequence, averaged over sequences,
  where ``f_e`` is the fraction of the sequence's assignments routed to expert ``e`` and ``P_e`` its mean
  router probability; 1 when the load is uniform;
- router z-loss (Zoph et al. 2022, "ST-MoE"): the mean of ``logsumexp(router logits)^2``, which keeps the
  router's logits small and its softmax stable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_par.config import divisors
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.plan import ModelPlan


@dataclass
class RoutingStats:
    """What the last forward did, for monitoring: assignments per expert and the fraction dropped."""

    tokens_per_expert: Tensor  # (n_experts,) assignments routed to each expert, before dropping
    dropped_fraction: Tensor  # () fraction of assignments over capacity
    aux_loss: Tensor  # () load-balancing loss (unweighted)
    z_loss: Tensor  # () router z-loss (unweighted)


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU feed-forwards stored as stacked weights, so expert parallel can shard dim 0."""

    def __init__(self, n_experts: int, dim: int, hidden_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_size, dim))

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_proj, mean=0.0, std=init_std)
        nn.init.normal_(self.up_proj, mean=0.0, std=init_std)
        nn.init.normal_(self.down_proj, mean=0.0, std=out_std)

    def forward(self, tokens: Tensor, expert: int) -> Tensor:
        """The ``expert``-th (local) expert on ``tokens`` (n, dim) -> (n, dim)."""
        gate, up, down = (_local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        hidden = F.silu(tokens @ gate[expert]) * (tokens @ up[expert])
        return hidden @ down[expert]


def _local(weight: Tensor) -> Tensor:
    # Under expert parallel the stacked weights are DTensors split by expert: this rank computes its own.
    return weight.to_local() if isinstance(weight, DTensor) else weight


class MoEFeedForward(nn.Module):
    """Top-k routed mixture of SwiGLU experts in place of a block's feed-forward: (B, T, C) -> (B, T, C).

    After each forward, :attr:`stats` holds the routing statistics and the unweighted auxiliary losses;
    the model adds ``aux_loss_weight * aux_loss + z_loss_weight * z_loss`` to its loss.
    """

    def __init__(self, dim: int, hidden_size: int, n_experts: int, top_k: int = 2,
                 capacity_factor: float | None = None) -> None:
        super().__init__()
        check_moe(n_experts, top_k, capacity_factor)
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden_size)
        self.stats: RoutingStats | None = None
        self.expert_group: dist.ProcessGroup | None = None  # set by apply_expert_parallel

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=init_std)
        self.experts.init_weights(init_std, out_std)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        logits = self.router(x).float()  # (B, T, E): fp32 so the softmax and the z-loss stay exact
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (B, T, k)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        keep = self._within_capacity(chosen)  # (B, T, k)
        self.stats = self._statistics(logits, probs, chosen, keep)

        tokens = x.reshape(B * T, C)
        flat_expert, flat_keep = chosen.reshape(-1), keep.reshape(-1)  # (B*T*k,)
        flat_token = torch.arange(B * T, device=x.device).repeat_interleave(self.top_k)
        flat_weight = weights.reshape(-1)
        out = torch.zeros_like(tokens, dtype=torch.float32)
        if self.expert_group is not None:  # expert parallel: the experts live on other ranks too
            index = flat_token[flat_keep]
            per_rank = _local(self.experts.gate_proj).shape[0]
            y = dispatch_and_combine(tokens[index], flat_expert[flat_keep], self.experts, per_rank, self.expert_group)
            out.index_add_(0, index, y.float() * flat_weight[flat_keep, None])
            return out.to(x.dtype).view(B, T, C)
        for expert in range(self.n_experts):
            mask = (flat_expert == expert) & flat_keep
            index = flat_token[mask]
            if index.numel() == 0:
                continue
            y = self.experts(tokens[index], expert)  # (n_e, C)
            out.index_add_(0, index, y.float() * flat_weight[mask, None])
        return out.to(x.dtype).view(B, T, C)

    def _within_capacity(self, chosen: Tensor) -> Tensor:
        """(B, T, k) booleans: the assignment fits its expert's capacity in its sequence."""
        if self.capacity_factor is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        B, T, k = chosen.shape
        capacity = math.ceil(self.capacity_factor * T * k / self.n_experts)
        # Priority order inside a sequence: all first choices (by position), then all second choices, ...
        ordered = chosen.transpose(1, 2).reshape(B, k * T)  # (B, k*T)
        one_hot = F.one_hot(ordered, self.n_experts)  # (B, k*T, E)
        position = (one_hot.cumsum(1) * one_hot).sum(-1) - 1  # (B, k*T): place in its expert's queue
        return (position < capacity).view(B, k, T).transpose(1, 2)

    def _statistics(self, logits: Tensor, probs: Tensor, chosen: Tensor, keep: Tensor) -> RoutingStats:
        B, T, k = chosen.shape
        counts = F.one_hot(chosen, self.n_experts).sum(2)  # (B, T, E): 1 where the token chose e
        fraction = counts.float().sum(1) / (T * k)  # (B, E): f_e per sequence
        mean_prob = probs.mean(1)  # (B, E): P_e per sequence
        aux = (self.n_experts * (fraction * mean_prob).sum(-1)).mean()
        z = logits.logsumexp(-1).pow(2).mean()
        return RoutingStats(tokens_per_expert=counts.sum((0, 1)).detach(),
                            dropped_fraction=(~keep).float().mean().detach(), aux_loss=aux, z_loss=z)


def dispatch_and_combine(tokens: Tensor, experts_of_tokens: Tensor, expert: Callable[[Tensor, int], Tensor],
                         per_rank: int, group: dist.ProcessGroup) -> Tensor:
    """Send each token to the rank holding its expert, run the local experts, send the results back.

    ``tokens`` (n, C) with ``experts_of_tokens`` (n,) global expert ids; rank ``r`` of ``group`` holds
    experts ``[r * per_rank, (r + 1) * per_rank)`` and ``expert(tokens, local_index)`` runs one of them.
    The numbers of tokens per destination are exchanged first (an all-to-all of ``ep`` integers), then the
    tokens themselves with uneven splits, forward and back (GShard's dispatch and combine).
    Differentiable: backward runs the same two all-to-alls reversed.
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    destination = experts_of_tokens // per_rank
    order = torch.argsort(destination, stable=True)
    send_counts = torch.bincount(destination, minlength=ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    received_ids = experts_of_tokens.new_empty(sum(recv))
    dist.all_to_all_single(received_ids, experts_of_tokens[order].contiguous(), recv, send, group=group)
    received = all_to_all_single(tokens.new_empty(sum(recv), tokens.shape[1]), tokens[order].contiguous(),
                                 recv, send, group=group)
    local_ids = received_ids - rank * per_rank
    computed = torch.zeros_like(received)
    for local in range(per_rank):
        index = (local_ids == local).nonzero().squeeze(1)
        if index.numel():
            computed = computed.index_add(0, index, expert(received[index], local))
    returned = all_to_all_single(tokens.new_empty(tokens.shape), computed, send, recv, group=group)
    return torch.zeros_like(returned).index_add(0, order, returned)  # back into the tokens' order


def apply_expert_parallel(module: nn.Module, mesh: ParallelMesh, ep: int, plan: ModelPlan | None = None) -> nn.Module:
    """Split the experts of every MoE layer in ``module`` over ``ep`` ranks (in place).

    MoE layers are this project's :class:`MoEFeedForward`, and the modules ``plan`` marks ``experts`` that
    hold their experts as stacked 3-D weights and are called as ``experts(hidden_states, top_k_index,
    top_k_weights)`` (Hugging Face's Mixtral, Qwen-MoE, OLMoE in transformers 5).

    Expert parallel borrows its ranks from ``dp_shard x cp`` (DESIGN.md): consecutive groups of ``ep``
    ranks hold one copy of all experts between them, and the groups replicate each other. Expert weights
    become DTensors split along the expert dimension (so checkpoints reshard), ignored by DDP; their
    gradients, which the all-to-alls already summed over the tokens of the ``ep`` group, are summed over
    the replicas and divided by the number of data-parallel ranks, as DDP's average would.
    """
    ours = [m for m in module.modules() if isinstance(m, MoEFeedForward)]
    theirs = [m for name, m in module.named_modules()
              if plan is not None and plan.style_of(name) == "experts" and not isinstance(m, GroupedExperts)
              and _stacked_experts(m) is not None]
    if ep == 1 or not (ours or theirs):
        return module
    for n_experts in [layer.n_experts for layer in ours] + [_stacked_experts(m) for m in theirs]:
        if n_experts % ep != 0:
            raise ValueError(f"ep={ep} does not divide the {n_experts} experts of an MoE layer; use an ep in "
                             f"{divisors(n_experts)}")
    host = mesh["dp_shard_cp"]
    expert_mesh = host._unflatten(0, (host.size() // ep, ep), ("ep_replicate", "ep"))
    replicas = expert_mesh["ep_replicate"].get_group() if host.size() > ep else None
    gradient = _ExpertGradient(replicas, mesh.size("dp_cp"))
    for layer in ours:
        layer.expert_group = expert_mesh["ep"].get_group()
        _split_weights(layer.experts, expert_mesh["ep"], gradient)
    for experts in theirs:
        n_experts = _stacked_experts(experts)
        _split_weights(experts, expert_mesh["ep"], gradient)
        experts.forward = _RoutedExperts(experts, n_experts, expert_mesh["ep"].get_group())
    return module


def _stacked_experts(module: nn.Module) -> int | None:
    """The number of experts of a module holding only 3-D weights stacked by expert, else None."""
    weights = list(module.parameters(recurse=False))
    if not weights or any(w.dim() != 3 for w in weights) or len({w.shape[0] for w in weights}) != 1:
        return None
    return weights[0].shape[0]


def _split_weights(experts: nn.Module, ep_mesh: Any, gradient: Callable[[Tensor], Tensor]) -> None:
    for name, weight in list(experts.named_parameters(recurse=False)):
        split = nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)]))
        split.register_hook(gradient)  # on each backward's contribution
        setattr(experts, name, split)


class _RoutedExperts:
    """The forward of a Hugging Face-style experts module under expert parallel.

    Tokens go to the ranks of their experts (:func:`dispatch_and_combine`); there, the module's own
    forward runs one local expert at a time on its local weights, so the expert's math stays the model's.
    """

    def __init__(self, experts: nn.Module, n_experts: int, group: dist.ProcessGroup) -> None:
        self.experts, self.original, self.group = experts, experts.forward, group
        self.per_rank = n_experts // dist.get_world_size(group)

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        n, k = top_k_index.shape
        token = torch.arange(n, device=hidden_states.device).repeat_interleave(k)
        chosen = top_k_index.reshape(-1)
        y = dispatch_and_combine(hidden_states[token], chosen, self._one_expert, self.per_rank, self.group)
        weighted = y * top_k_weights.reshape(-1, 1).to(y.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))

    def _one_expert(self, tokens: Tensor, local: int) -> Tensor:
        names = [name for name, _ in self.experts.named_parameters(recurse=False)]
        saved = {name: self.experts._parameters[name] for name in names}
        saved_count = getattr(self.experts, "num_experts", None)
        try:
            for name in names:  # the module's own forward sees this rank's experts as plain tensors
                self.experts._parameters[name] = _local(saved[name])
            if saved_count is not None:
                self.experts.num_experts = self.per_rank
            index = torch.full((tokens.shape[0], 1), local, dtype=torch.long, device=tokens.device)
            return self.original(tokens, index, torch.ones(tokens.shape[0], 1, dtype=tokens.dtype,
                                                           device=tokens.device))
        finally:
            self.experts._parameters.update(saved)
            if saved_count is not None:
                self.experts.num_experts = saved_count


class _ExpertGradient:
    def __init__(self, replicas: dist.ProcessGroup | None, average_over: int) -> None:
        self.replicas, self.average_over = replicas, average_over

    def __call__(self, grad: Tensor) -> Tensor:
        local = _local(grad).clone()
        if self.replicas is not None:
            dist.all_reduce(local, group=self.replicas)
        local.div_(self.average_over)
        return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)


def check_moe(n_experts: int, top_k: int, capacity_factor: float | None) -> None:
    """Raise ``ValueError`` naming the values when the routing cannot work."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive integer, got {n_experts!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k!r} must be between 1 and the number of experts ({n_experts})")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive, or None for dropless routing; got {capacity_factor!r}")


__all__ = ["GroupedExperts", "MoEFeedForward", "RoutingStats", "apply_expert_parallel", "check_moe",
           "dispatch_and_combine"]
