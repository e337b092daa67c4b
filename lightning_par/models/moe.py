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
(GShard's groups), so which tokens are dropped does not depend on how the batch is spread over ranks; under context
parallel, where a rank holds part of each sequence, over the whole sequence (``sequence_split``).

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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_par.parallel.experts import dispatch_and_combine, local_part


@dataclass
class RoutingStats:
    """What the last forward did, for monitoring: assignments per expert and the fraction dropped."""

    tokens_per_expert: Tensor  # (n_experts,) assignments routed to each expert, before dropping
    dropped_fraction: Tensor  # () fraction of assignments over capacity
    aux_loss: Tensor  # () load-balancing loss (unweighted)
    z_loss: Tensor  # () router z-loss (unweighted)


def grouped_matmul(tokens: Tensor, weights: Tensor, counts: list[int]) -> Tensor:
    """``tokens`` (n, a) sorted by group times each group's matrix ``weights[g]`` (G, a, b), ``counts[g]`` rows per
    group -> (n, b): one grouped GEMM (``torch._grouped_mm``, as torchtitan's and Megatron-Core's MoE layers use)
    where this PyTorch runs it, on CPU and on Hopper-class GPUs in bf16, else a matmul per group."""
    device = tokens.device.type
    # Autocast would cast a matmul's operands, and _grouped_mm is not on its lists: cast them as it would.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tokens.dtype
    if _grouped_mm_runs(tokens, weights, dtype):
        offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(tokens.to(dtype), weights.to(dtype), offs=offsets)
    return torch.cat([part @ weights[g] for g, part in enumerate(tokens.split(counts))])


def _grouped_mm_runs(tokens: Tensor, weights: Tensor, dtype: torch.dtype) -> bool:
    if not GROUPED_MM or not hasattr(torch, "_grouped_mm") or tokens.shape[0] == 0:
        return False
    if any(width * dtype.itemsize % 16 for width in (tokens.shape[1], weights.shape[2])):
        return False  # its kernels need rows of 16-byte multiples
    if tokens.device.type == "cuda":  # sm90+ kernels, bf16
        return torch.cuda.get_device_capability(tokens.device) >= (9, 0) and dtype == torch.bfloat16
    return tokens.device.type == "cpu"


#: Whether experts run as one grouped GEMM where torch can (set False to compare with the per-expert loop).
GROUPED_MM = True


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

    def forward(self, tokens: Tensor, counts: list[int]) -> Tensor:
        """Every (local) expert on its tokens: ``tokens`` (n, dim) sorted by expert, ``counts[e]`` of them for
        expert ``e``; -> (n, dim) in the same order."""
        gate, up, down = (local_part(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        hidden = F.silu(grouped_matmul(tokens, gate, counts)) * grouped_matmul(tokens, up, counts)
        return grouped_matmul(hidden, down, counts)


class MoEFeedForward(nn.Module):
    """Top-k routed mixture of SwiGLU experts in place of a block's feed-forward: (B, T, C) -> (B, T, C).

    After each forward, :attr:`stats` holds the routing statistics and the unweighted auxiliary losses;
    the model adds :meth:`weighted_auxiliary_loss` (``aux_loss_weight * aux_loss + z_loss_weight * z_loss``) to
    its loss. Under pipeline parallel the loss function sees only the last stage's output; there a runner sets
    :attr:`loss_scale_in_backward` (the factor its loss function applies to a micro-batch's loss), and the layer
    adds the gradient of its weighted losses in backward itself and appends their values to
    :attr:`losses_in_backward` (the pipeline-runner protocol, ``parallel/pipeline/runner.py``).
    """

    def __init__(self, dim: int, hidden_size: int, n_experts: int, top_k: int = 2,
                 capacity_factor: float | None = None, *, aux_loss_weight: float = 0.01,
                 z_loss_weight: float = 0.001) -> None:
        super().__init__()
        check_moe(n_experts, top_k, capacity_factor)
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        # Set by a pipeline runner: the layer then adds its weighted auxiliary losses to training itself, scaled
        # so (see AuxiliaryLossInBackward), and records their values for the runner to report.
        self.loss_scale_in_backward: float | None = None
        self.losses_in_backward: list[Tensor] = []
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden_size)
        self.stats: RoutingStats | None = None
        self.expert_group: dist.ProcessGroup | None = None  # set by apply_expert_parallel
        # Set by apply_context_parallel when each rank holds part of every sequence (SequenceSplit): capacity and
        # the statistics are then computed over the whole sequence.
        self.sequence_split = None

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=init_std)
        self.experts.init_weights(init_std, out_std)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.router(x).float()  # (B, T, E): fp32 so the softmax and the z-loss stay exact
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (B, T, k)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        keep = self._within_capacity(chosen)  # (B, T, k)
        self.stats = self._statistics(logits, probs, chosen, keep)
        return self._with_auxiliary_loss(self._routed(x, chosen, keep, weights))

    def weighted_auxiliary_loss(self) -> Tensor:
        """``aux_loss_weight * aux_loss + z_loss_weight * z_loss`` of the last forward."""
        return self.aux_loss_weight * self.stats.aux_loss + self.z_loss_weight * self.stats.z_loss

    def _with_auxiliary_loss(self, out: Tensor) -> Tensor:
        if self.loss_scale_in_backward is None:
            return out
        weighted = self.weighted_auxiliary_loss()
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward (checkpointing)
            self.losses_in_backward.append(weighted.detach())
        return AuxiliaryLossInBackward.apply(out, weighted, self.loss_scale_in_backward)

    # Runs eagerly inside a compiled block (torch.compile splits the block's graph around it): every size in here
    # follows the routing (tokens per expert, per rank) and changes each step, and the token exchange takes its
    # split sizes on the host. Traced, each step's new sizes would make dynamo recompile with symbolic shapes, and
    # torch 2.13 keeps those compilations' fake tensors alive (in ShapeEnv._inner_evaluate_expr's class-wide LRU
    # cache) with weak references to the expert weights: torch.utils.swap_tensors then refuses to swap them, which
    # moving a module whose expert weights are DTensors (expert parallel) does. (Before that, tracing grouped_matmul
    # fails outright in fp32: torch 2.13's meta kernel of _grouped_mm, which tracing runs, accepts bf16 only.) The
    # router before, and the block's attention and norms, stay compiled: their shapes are the batch's.
    @torch.compiler.disable
    def _routed(self, x: Tensor, chosen: Tensor, keep: Tensor, weights: Tensor) -> Tensor:
        """The weighted sum of the kept assignments' expert outputs: (B, T, C) -> (B, T, C)."""
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)
        flat_expert, flat_keep = chosen.reshape(-1), keep.reshape(-1)  # (B*T*k,)
        flat_token = torch.arange(B * T, device=x.device).repeat_interleave(self.top_k)
        flat_weight = weights.reshape(-1)
        out = torch.zeros_like(tokens, dtype=torch.float32)
        if self.expert_group is not None:  # expert parallel: the experts live on other ranks too
            index = flat_token[flat_keep]
            per_rank = self.n_experts // dist.get_world_size(self.expert_group)
            y = dispatch_and_combine(tokens[index], flat_expert[flat_keep], self.experts, per_rank, self.expert_group)
            out.index_add_(0, index, y.float() * flat_weight[flat_keep, None])
            return out.to(x.dtype).view(B, T, C)
        kept = flat_keep.nonzero().squeeze(1)
        by_expert = kept[torch.argsort(flat_expert[kept], stable=True)]
        counts = torch.bincount(flat_expert[by_expert], minlength=self.n_experts).tolist()
        y = self.experts(tokens[flat_token[by_expert]], counts)  # (kept assignments, C), sorted by expert
        out.index_add_(0, flat_token[by_expert], y.float() * flat_weight[by_expert, None])
        return out.to(x.dtype).view(B, T, C)

    def _within_capacity(self, chosen: Tensor) -> Tensor:
        """(B, T, k) booleans: the assignment fits its expert's capacity in its sequence."""
        if self.capacity_factor is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        split = self.sequence_split
        if split is not None:  # this rank's tokens' places in the whole sequence's queues
            keep = self._within_capacity_of_sequence(split.whole(chosen))
            return keep[:, split.positions(keep.shape[1], keep.device)]
        return self._within_capacity_of_sequence(chosen)

    def _within_capacity_of_sequence(self, chosen: Tensor) -> Tensor:
        B, T, k = chosen.shape
        capacity = math.ceil(self.capacity_factor * T * k / self.n_experts)
        # Priority order inside a sequence: all first choices (by position), then all second choices, ...
        ordered = chosen.transpose(1, 2).reshape(B, k * T)  # (B, k*T)
        one_hot = F.one_hot(ordered, self.n_experts)  # (B, k*T, E)
        position = (one_hot.cumsum(1) * one_hot).sum(-1) - 1  # (B, k*T): place in its expert's queue
        return (position < capacity).view(B, k, T).transpose(1, 2)

    def _statistics(self, logits: Tensor, probs: Tensor, chosen: Tensor, keep: Tensor) -> RoutingStats:
        B, T, k = chosen.shape
        # Sums over this rank's tokens; under context parallel, totalled over the sequence's ranks.
        total = (lambda x: x) if self.sequence_split is None else self.sequence_split.total
        T = T if self.sequence_split is None else T * dist.get_world_size(self.sequence_split.group)
        counts = F.one_hot(chosen, self.n_experts).sum(2)  # (B, T, E): 1 where the token chose e
        chosen_per_expert = total(counts.float().sum(1).detach())  # (B, E)
        fraction = chosen_per_expert / (T * k)  # f_e per sequence
        mean_prob = total(probs.sum(1)) / T  # (B, E): P_e per sequence
        aux = (self.n_experts * (fraction * mean_prob).sum(-1)).mean()
        z = total(logits.logsumexp(-1).pow(2).sum()) / (B * T)
        dropped = total((~keep).float().sum().detach()) / (B * T * k)
        return RoutingStats(tokens_per_expert=chosen_per_expert.sum(0).long(), dropped_fraction=dropped,
                            aux_loss=aux, z_loss=z)


class AuxiliaryLossInBackward(torch.autograd.Function):
    """``output`` unchanged; in backward, ``loss`` receives the gradient ``scale`` as if ``scale * loss`` had been
    added to the loss being minimised (Megatron-Core's MoEAuxLossAutoScaler, Shoeybi et al.). Lets a layer add a
    loss of its own where the loss function never sees it: a pipeline's last stage computes the loss from its
    output alone."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, output: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


def check_moe(n_experts: int, top_k: int, capacity_factor: float | None) -> None:
    """Raise ``ValueError`` naming the values when the routing cannot work."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive integer, got {n_experts!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k!r} must be between 1 and the number of experts ({n_experts})")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive, or None for dropless routing; got {capacity_factor!r}")


__all__ = ["AuxiliaryLossInBackward", "GroupedExperts", "grouped_matmul", "MoEFeedForward", "RoutingStats", "check_moe"]
