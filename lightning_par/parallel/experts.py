"""Expert parallelism (GShard, Lepikhin et al. 2021): the experts of every mixture-of-experts layer split over
``ep`` ranks, and each token sent to the rank of its expert and back (:func:`dispatch_and_combine`).

Two kinds of MoE layer are split: those that route their own tokens once they are given an expert group (an
``expert_group`` attribute, ``n_experts`` and stacked ``experts``: ``lightning_par.models.moe.MoEFeedForward``),
and the modules a model map marks ``experts`` that hold their experts' weights stacked along the first dimension
(:func:`stacked_experts`: Hugging Face's Mixtral, Qwen-MoE, OLMoE, GPT-OSS, DBRX, Llama 4), whose forward is
wrapped (:class:`_RoutedExperts`). The layer itself (router, capacity, auxiliary losses) is a
model's part and lives in ``lightning_par.models.moe``.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_par.layout.config import divisors
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.model_map import ModelMap

# The differentiable all-to-all of torch.distributed.nn is deprecated in favour of the functional collectives,
# which the flight recorder reads alike but whose backward runs outside Python; this module keeps the one
# whose forward and backward go through torch.distributed (tests/test_experts.py counts each). Its deprecation
# says nothing a user of lightning-par could act on.
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated",
                        module=re.escape(__name__))


def dispatch_and_combine(tokens: Tensor, experts_of_tokens: Tensor, experts: Callable[[Tensor, list[int]], Tensor],
                         per_rank: int, group: dist.ProcessGroup) -> Tensor:
    """Send each token to the rank holding its expert, run the local experts, send the results back.

    ``tokens`` (n, C) with ``experts_of_tokens`` (n,) global expert ids; rank ``r`` of ``group`` holds
    experts ``[r * per_rank, (r + 1) * per_rank)``, and ``experts(tokens, counts)`` runs them once on the tokens
    it received sorted by local expert, ``counts[e]`` of them for expert ``e`` (one call, so that a ZeRO-3 unit
    around the experts gathers them once). The numbers of tokens per destination are exchanged first (an
    all-to-all of ``ep`` integers), then the tokens themselves with uneven splits, forward and back (GShard's
    dispatch and combine). Differentiable: backward runs the same two all-to-alls reversed.
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
    by_expert = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=per_rank).tolist()
    computed = torch.zeros_like(received).index_add(0, by_expert, experts(received[by_expert], counts))
    returned = all_to_all_single(tokens.new_empty(tokens.shape), computed, send, recv, group=group)
    return torch.zeros_like(returned).index_add(0, order, returned)  # back into the tokens' order


def apply_expert_parallel(module: nn.Module, mesh: ParallelMesh, ep: int, model_map: ModelMap | None = None, *,
                          reduce_gradients: bool = True) -> nn.Module:
    """Split the experts of every MoE layer in ``module`` over ``ep`` ranks (in place).

    MoE layers are those that route their own tokens (:func:`routes_its_tokens`: this project's
    ``MoEFeedForward``), and the modules ``model_map`` marks ``experts`` whose weights are stacked by expert
    (:func:`stacked_experts`), called either as ``experts(hidden_states, top_k_index, top_k_weights)`` (Hugging
    Face's Mixtral, Qwen-MoE, OLMoE, GPT-OSS, DBRX in transformers 5) or as ``experts(tokens)`` on every token
    repeated once per expert, expert by expert (Llama 4: its router has already weighed them).

    Expert parallel borrows its ranks from ``dp_shard x cp`` (docs/architecture.md, :meth:`ParallelMesh.experts`):
    consecutive groups of ``ep`` ranks hold one copy of all experts between them, and the groups replicate each
    other. Expert weights become DTensors split along the expert dimension (so checkpoints reshard), ignored by
    DDP. With ``reduce_gradients`` their gradients, which the all-to-alls already summed over the tokens of the
    ``ep`` group, are summed over the replicas and divided by the number of data-parallel ranks, as DDP's
    average would; without it ZeRO-3 does that (:func:`~lightning_par.parallel.zero.fully_shard_model` shards
    the experts over their replicas).
    """
    ours, theirs = _expert_layers(module, model_map)
    if ep == 1 or not (ours or theirs):  # (a model with none is refused before any split: check_experts_found)
        return module
    for n_experts in [layer.n_experts for layer in ours] + [stacked_experts(m) for m in theirs]:
        if n_experts % ep != 0:
            raise ValueError(f"ep={ep!r} does not divide the {n_experts} experts of an MoE "
                             f"layer; use an ep in {divisors(n_experts)}")
    meshes = mesh.experts(ep)
    replicas = meshes.replicas.get_group() if meshes.replicas.size() > 1 else None
    gradient = _ExpertGradient(replicas, mesh.size("dp_cp")) if reduce_gradients else None
    for layer in ours:
        layer.expert_group = meshes.ep.get_group()
        _split_weights(layer.experts, meshes.ep, gradient)
    for experts in theirs:
        n_experts = stacked_experts(experts)
        _split_weights(experts, meshes.ep, gradient)
        experts.forward = _RoutedExperts(experts, n_experts, meshes.ep.get_group())
    return module


def _expert_layers(module: nn.Module, model_map: ModelMap | None) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the MoE layers that route their own tokens, the stacked experts modules the model map marks)."""
    ours = [m for m in module.modules() if routes_its_tokens(m)]
    split_by_ours = {id(layer.experts) for layer in ours}
    theirs = [m for name, m in module.named_modules()
              if model_map is not None and model_map.style_of(name) == "experts" and id(m) not in split_by_ours
              and stacked_experts(m) is not None]
    return ours, theirs


def check_experts_found(module: nn.Module, model_map: ModelMap | None, ep: int) -> None:
    """Refuse expert parallel (``ep > 1``) on a model in which it would split no expert: it would train as plain data
    parallel, not as asked. Run on the whole model, before a pipeline cuts it (each stage's rank sees its own layers
    only), so that every rank decides alike."""
    if ep == 1 or any(_expert_layers(module, model_map)):
        return
    marked = [name for name, _ in module.named_modules() if model_map is not None
              and model_map.style_of(name) == "experts"]
    named = [name for name, _ in module.named_modules() if name.rpartition(".")[2] in ("experts", "expert")]
    found = (f"the model map marks {marked[:3]} as experts, but their weights are not stacked by expert "
             "([experts, ...], or [experts x rows, ...] with num_experts)" if marked else
             f"modules named {named[:3]} hold no weights stacked by expert and route no tokens themselves"
             if named else "it has no module of either kind")
    where = type(module).__name__
    if model_map is not None and model_map.blocks:
        blocks = module.get_submodule(model_map.blocks)
        kinds = sorted({type(block).__name__ for block in blocks.children()})
        where += f"'s blocks {model_map.blocks!r} ({', '.join(kinds)})"
    raise ValueError(f"ep={ep!r}: expert parallel found no experts to split in {where} ({found}). It "
                     "splits MoE layers that route their own tokens (lightning_par's MoEFeedForward: expert_group, "
                     "n_experts, experts) and modules the model map marks 'experts' whose weights are stacked by "
                     f"expert (transformers' Mixtral, Qwen-MoE, OLMoE). Use ep=1 for this model, or "
                     "mark its experts in the model map (docs/expert_parallel.md)")


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """The outermost modules of ``module`` whose weights (their children's included) expert parallel split, all of them
    DTensors over the ``ep`` mesh: the experts module whose forward runs them (DBRX's holds them in a child), which
    ZeRO-3 makes a unit of its own so that they are gathered when that forward starts."""
    def split(sub: nn.Module) -> bool:
        weights = list(sub.parameters())
        return bool(weights) and all(isinstance(w, DTensor) and w.device_mesh.mesh_dim_names == ("ep",)
                                     for w in weights)

    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():  # parents before their children
        if split(sub) and not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, sub))
    return [sub for _, sub in found]


def local_part(weight: Tensor) -> Tensor:
    """This rank's part of ``weight``: under expert parallel the stacked weights are DTensors split by expert."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def routes_its_tokens(module: nn.Module) -> bool:
    """Whether ``module`` is an MoE layer that dispatches its tokens itself once given an expert group: it has
    ``expert_group``, ``n_experts`` and its experts as a module of stacked weights, ``experts``."""
    return (hasattr(module, "expert_group") and isinstance(getattr(module, "n_experts", None), int)
            and isinstance(getattr(module, "experts", None), nn.Module))


def holds_marked_experts(module: nn.Module, name: str, model_map: ModelMap | None) -> bool:
    """Whether ``module`` (called ``name`` in the model) holds a child the model map marks ``experts``: a Hugging
    Face MoE block (router, experts, shared experts)."""
    return model_map is not None and any(model_map.style_of(f"{name}.{child}" if name else child) == "experts"
                                         for child, _ in module.named_children())


def moe_layers(model: nn.Module, model_map: ModelMap | None) -> list[str]:
    """The mixture-of-experts layers of ``model``: those that route their own tokens, and the modules holding experts
    the model map marks (a Hugging Face MoE block)."""
    return [name for name, sub in model.named_modules()
            if routes_its_tokens(sub) or holds_marked_experts(sub, name, model_map)]


def stacked_experts(module: nn.Module) -> int | None:
    """The number of experts of a module whose weights (its own and its children's) are all stacked by expert along
    their first dimension, else None. Either the module says how many experts it holds (``num_experts``) and every
    weight's first dimension is a multiple of it, expert by expert (DBRX's [experts x ffn, hidden] in a child), or
    every weight has the same first dimension and one of them is 3-D ([experts, in, out], with [experts, out] biases
    beside it: GPT-OSS)."""
    weights = list(module.parameters())
    if not weights or any(w.dim() == 0 for w in weights):
        return None
    declared = getattr(module, "num_experts", None)
    if isinstance(declared, int) and declared > 0:
        return declared if all(w.shape[0] % declared == 0 for w in weights) else None
    firsts = {w.shape[0] for w in weights}
    return firsts.pop() if len(firsts) == 1 and any(w.dim() == 3 for w in weights) else None


def _own_weights(experts: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owner, name) of every weight of ``experts``, its children's included."""
    return [(owner, name) for owner in experts.modules() for name, _ in owner.named_parameters(recurse=False)]


def _split_weights(experts: nn.Module, ep_mesh: Any, gradient: Callable[[Tensor], Tensor] | None) -> None:
    for owner, name in _own_weights(experts):
        weight = owner._parameters[name]
        # A frozen expert (a LoRA model's base) stays frozen: no gradient, so nothing to reduce either.
        split = nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)]), requires_grad=weight.requires_grad)
        if gradient is not None and split.requires_grad:
            split.register_hook(gradient)  # on each backward's contribution
        setattr(owner, name, split)


class _RoutedExperts:
    """The forward of a Hugging Face-style experts module under expert parallel.

    Tokens go to the ranks of their experts (:func:`dispatch_and_combine`); there, the module's own forward runs on
    its local weights, so the expert's math stays the model's. Two calls are known: ``(hidden_states, top_k_index,
    top_k_weights)``, where the module's forward then runs one local expert at a time (the routing weights are
    applied here, after the way back), and ``(tokens)`` with every token once per expert, expert by expert, already
    weighed by the router (Llama 4), where it runs once on the local experts' blocks.
    """

    def __init__(self, experts: nn.Module, n_experts: int, group: dist.ProcessGroup) -> None:
        self.experts, self.original, self.group, self.n_experts = experts, experts.forward, group, n_experts
        self.per_rank = n_experts // dist.get_world_size(group)

    # Eager inside a compiled block, as MoEFeedForward._routed is (see the reason there): the sizes follow the
    # routing, and traced they would leave weak references to the expert DTensors that block moving the module.
    @torch.compiler.disable
    def __call__(self, hidden_states: Tensor, *routing: Tensor) -> Tensor:
        if not routing:
            return self._expert_major(hidden_states)
        top_k_index, top_k_weights = routing
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # DBRX hands (batch, seq, hidden)
        n = tokens.shape[0]
        k = top_k_index.numel() // n
        token = torch.arange(n, device=tokens.device).repeat_interleave(k)
        chosen = top_k_index.reshape(-1)
        y = dispatch_and_combine(tokens[token], chosen, self._one_expert_at_a_time, self.per_rank, self.group)
        weighted = y * top_k_weights.reshape(-1, 1).to(y.dtype)
        routed = torch.zeros_like(tokens).index_add(0, token, weighted.to(tokens.dtype))
        return routed.reshape(hidden_states.shape)

    def _expert_major(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2 or tokens.shape[0] % self.n_experts:
            raise ValueError(f"expert parallel: {type(self.experts).__name__} was called with one tensor of shape "
                             f"{tuple(tokens.shape)}, which it splits as every token once for each of its "
                             f"{self.n_experts} experts, expert by expert ([experts x tokens, hidden]); this one does "
                             "not divide so. Call it as experts(hidden_states, top_k_index, top_k_weights), or use "
                             "expert_parallel_size=1 for this model")
        experts = torch.arange(self.n_experts, device=tokens.device)
        ids = experts.repeat_interleave(tokens.shape[0] // self.n_experts)
        # Each local expert receives the same number of tokens (every rank's tokens, once each), so the blocks stay
        # expert by expert and the module's own forward takes them at once.
        return dispatch_and_combine(tokens, ids, lambda received, counts: self._on_local(self.original, received),
                                    self.per_rank, self.group)

    def _one_expert_at_a_time(self, tokens: Tensor, counts: list[int]) -> Tensor:
        def run_each() -> Tensor:
            outputs = []
            for local, part in enumerate(tokens.split(counts)):
                if part.shape[0]:
                    index = torch.full((part.shape[0], 1), local, dtype=torch.long, device=part.device)
                    ones = torch.ones(part.shape[0], 1, dtype=part.dtype, device=part.device)
                    outputs.append(self.original(part, index, ones).reshape(part.shape))
            return torch.cat(outputs) if outputs else tokens

        return self._on_local(run_each)

    def _on_local(self, forward: Callable[..., Tensor], *args: Any) -> Tensor:
        """``forward(*args)`` with the module's weights this rank's experts as plain tensors, and its
        ``num_experts`` their number."""
        weights = _own_weights(self.experts)
        saved = [owner._parameters[name] for owner, name in weights]
        saved_count = getattr(self.experts, "num_experts", None)
        try:
            for (owner, name), weight in zip(weights, saved):
                owner._parameters[name] = local_part(weight)
            if saved_count is not None:
                self.experts.num_experts = self.per_rank
            return forward(*args)
        finally:
            for (owner, name), weight in zip(weights, saved):
                owner._parameters[name] = weight
            if saved_count is not None:
                self.experts.num_experts = saved_count


class _ExpertGradient:
    def __init__(self, replicas: dist.ProcessGroup | None, average_over: int) -> None:
        self.replicas, self.average_over = replicas, average_over

    def __call__(self, grad: Tensor) -> Tensor:
        local = local_part(grad).clone()
        if self.replicas is not None:
            dist.all_reduce(local, group=self.replicas)
        local.div_(self.average_over)
        return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)


__all__ = ["apply_expert_parallel", "dispatch_and_combine", "expert_modules", "holds_marked_experts", "local_part",
           "moe_layers", "routes_its_tokens", "stacked_experts"]
