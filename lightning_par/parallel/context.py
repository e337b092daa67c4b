"""Context parallelism: each rank of the ``cp`` group holds a slice of every sequence.

The blocks of the model run on ``T / cp`` tokens per rank; only attention needs the other ranks'
tokens, and the methods of ``layout/context_methods.py``'s table provide them, each with its function here:

* ``ulysses`` (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
  Extreme Long Sequence Transformer Models"): an all-to-all turns q/k/v split by sequence into q/k/v
  split by heads, each rank attends over the whole sequence for ``H / cp`` heads, and a second
  all-to-all turns the output back. The number of heads must be divisible by ``cp``.
* ``ring`` (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"):
  key/value blocks travel round the ring while each rank merges the partial attention of its queries
  with an online softmax (Milakov & Gimelshein 2018; Dao et al. 2022, "FlashAttention"). Under a causal
  mask, rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of ``2cp`` equal chunks, so that every rank
  computes the same number of unmasked score blocks (the load balancing of Llama 3 / Megatron-CP).
* ``allgather`` (Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.2): keys and values are all-gathered
  at their own heads and this rank's queries (the same balanced chunks) attend to the whole sequence in one
  ``scaled_dot_product_attention``; backward reduce-scatters the key and value gradients.

All are plain PyTorch with gloo-capable collectives, so they run on CPU; PyTorch's own
``context_parallel`` needs SDPA sharding rules that CPU lacks.

How it attaches to a model, without model-specific code (``apply_context_parallel``):

* the first block's hidden-state input is cut to this rank's tokens; in every block, tensors passed
  beside the hidden state that run along the sequence (rotary tables, position ids: shapes (B, T, ...),
  (1, T, ...) or (T, ...)) are cut the same way;
* ``F.scaled_dot_product_attention`` calls inside the blocks are routed to the chosen method;
* the final norm and the head run on this rank's tokens too, and the head's output (the logits) is gathered
  back to the whole sequence, so the user's loss runs unchanged, on every position, identically on every rank of
  the group (:class:`GatherAtHead`; without a head in the model map, the last block's output is gathered and the
  final norm and head run on the whole sequence);
* under tensor parallel with sequence parallel, the activations between the regions split each rank's chunk
  over ``tp`` (``_along_sequence``).

The gradient of that gather keeps this rank's slice scaled by ``cp``: every gradient before it then covers only
this rank's tokens, ``cp`` times over, and the average over ``dp x cp`` (DDP or FSDP2 over ``dp_cp``) is the
whole gradient. A layer whose numbers span the sequence (a router's capacity and load statistics) computes them
over the whole sequence through :class:`SequenceSplit`.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from lightning_par.layout.config import CP_METHODS
from lightning_par.layout.context_methods import CONTEXT_METHODS, ContextMethod, chunks_of_rank, sequence_divisor
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.model_map import ModelMap, why_no_blocks
from lightning_par.parallel.modules import first_tensor
from lightning_par.parallel.small_copy import small_copy
from lightning_par.parallel.model_call import run_model

# Ulysses' all-to-all is the one expert parallel uses, whose deprecation says nothing a user could act on
# (lightning_par/parallel/experts.py says why it is kept).
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated",
                        module=re.escape(__name__))

Method = ContextMethod  # a name of layout.context_methods.CONTEXT_METHODS


# ----------------------------------------------------------------------------------- token layout
def local_positions(seq_len: int, rank: int, cp: int, method: Method) -> Tensor:
    """Global token positions held by ``rank``, in the order it holds them."""
    n_chunks = sequence_divisor(cp, method)
    size = seq_len // n_chunks
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of_rank(rank, cp, method)])


def check_sequence_length(seq_len: int, cp: int, method: Method) -> None:
    """Raise ``ValueError`` when ``seq_len`` tokens cannot be split over ``cp`` ranks with ``method``, naming them."""
    divisor = sequence_divisor(cp, method)
    if seq_len % divisor != 0:
        why = ("" if divisor == cp else f" ({divisor // cp} x cp: causal load balancing gives "
                                         f"each rank {divisor // cp} of {divisor} chunks)")
        fits = [seq_len - seq_len % divisor, seq_len + divisor - seq_len % divisor]
        raise ValueError(f"sequence length {seq_len} is not divisible by {divisor}{why}, which "
                         f"cp={cp!r} with cp_method={method!r} needs; nearest "
                         f"lengths that fit: {[n for n in fits if n > 0]}")


def causal_score_blocks(rank: int, cp: int, method: Method) -> int:
    """Unmasked (query chunk, key chunk) pairs ``rank`` computes under a causal mask, diagonal pairs as 1/2.

    With the balanced ring layout every rank gets the same number; with contiguous chunks rank ``r``
    would compute ``r + 1/2`` pairs (the imbalance the layout removes).
    """
    mine = chunks_of_rank(rank, cp, method)
    every = [c for r in range(cp) for c in chunks_of_rank(r, cp, method)]
    return sum((1.0 if k < q else 0.5) for q in mine for k in every if k <= q)


# ------------------------------------------------------------------------------------- Ulysses
def _sequence_to_heads(x: Tensor, group: dist.ProcessGroup, cp: int) -> Tensor:
    """(B, H, T/cp, D) split by sequence -> (B, H/cp, T, D) split by heads."""
    B, H, Tl, D = x.shape
    send = x.reshape(B, cp, H // cp, Tl, D).transpose(0, 1).contiguous()  # slot j: the heads rank j will own
    received = all_to_all_single(torch.empty_like(send), send, group=group)  # slot j: rank j's tokens
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * Tl, D)


def _heads_to_sequence(x: Tensor, group: dist.ProcessGroup, cp: int) -> Tensor:
    """(B, H/cp, T, D) split by heads -> (B, H, T/cp, D) split by sequence."""
    B, Hl, T, D = x.shape
    send = x.reshape(B, Hl, cp, T // cp, D).permute(2, 0, 1, 3, 4).contiguous()  # slot j: rank j's tokens
    received = all_to_all_single(torch.empty_like(send), send, group=group)  # slot j: rank j's heads
    return received.transpose(0, 1).reshape(B, cp * Hl, T // cp, D)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, *, is_causal: bool,
                      scale: float | None, mask: Tensor | None = None, dropout_p: float = 0.0) -> Tensor:
    """Attention of q/k/v (B, H, T/cp, D) over the whole sequence, via two all-to-alls per tensor set; ``mask``: the
    whole sequence's (B or 1, H or 1, T, T), as ``scaled_dot_product_attention``'s ``attn_mask``; ``dropout_p``: its
    attention dropout, drawn by each rank for its heads (in the block's stream of ``lightning_par.parallel.rng``,
    which differs per rank)."""
    cp = dist.get_world_size(group)
    H, Hkv = q.shape[1], k.shape[1]
    if H % cp != 0:
        whole_heads = " or ".join(f"cp_method={spec.name!r}" for spec in CONTEXT_METHODS.values()
                                  if not spec.splits_heads)
        raise ValueError(f"context parallel 'ulysses' splits attention heads over cp={cp!r} ranks, "
                         f"but the layer has {H} query heads; use a cp that divides {H}, or "
                         f"{whole_heads}")
    if Hkv % cp != 0:  # too few kv heads to split: give every query head its own copy first
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    q, k, v = (_sequence_to_heads(t, group, cp) for t in (q, k, v))
    if mask is not None and mask.shape[1] > 1:  # one mask per head: this rank's heads
        rank = dist.get_rank(group)
        mask = mask[:, rank * (H // cp):(rank + 1) * (H // cp)]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])  # (B, H/cp, T, D)
    return _heads_to_sequence(out, group, cp)


# ---------------------------------------------------------------------------------------- ring
class _RingExchange:
    """Sends ``tensors`` to the next rank of the ring and receives the previous rank's, in the background: the
    attention of the blocks at hand is computed meanwhile (the overlap of Liu et al. 2023)."""

    def __init__(self, tensors: list[Tensor], group: dist.ProcessGroup) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        nxt, prev = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
        tensors = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prev, group) for r in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


def _pairs(q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...], size: int, is_causal: bool, mask: Tensor | None):
    """(query slice, key slice, what masks the pair's scores) for every chunk pair with at least one unmasked score.
    The mask of a pair is ``True`` for the causal diagonal, else None, or the block of ``mask`` (the whole sequence's)
    for the pair's tokens."""
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(kv_chunks):
            if is_causal and kc > qc:
                continue  # every key of this chunk comes after every query: fully masked, skipped
            block = None if mask is None else mask[..., qc * size:(qc + 1) * size, kc * size:(kc + 1) * size]
            if block is not None and block.dtype == torch.bool and not bool(block.any()):
                continue  # fully masked (after the diagonal, or in another document): skipped
            yield slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size), \
                (True if is_causal and kc == qc else block)


def _expand(x: Tensor, repeat: int) -> Tensor:
    """Key/value heads (B, Hkv, c, D) -> one per query head (B, Hkv x repeat, c, D), grouped-query attention."""
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def _fold(grad: Tensor, repeat: int) -> Tensor:
    """The gradient of :func:`_expand`: the query heads' gradients summed onto their key/value head."""
    if repeat == 1:
        return grad
    B, H, c, D = grad.shape
    return grad.view(B, H // repeat, repeat, c, D).sum(2)


class _RingAttention(torch.autograd.Function):
    """Blockwise attention with key/value blocks passed round the ring; fp32 softmax statistics. The blocks travel
    with their own (grouped-query) heads, expanded to the query heads only where they are used, and the next
    exchange runs while the current blocks are attended to."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, is_causal: bool,
                scale: float, mask: Tensor | None) -> Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        mine = chunks_of_rank(rank, cp, "ring")
        size = q.shape[2] // len(mine)
        repeat = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, Tl, D)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)  # (B, H, Tl)
        kv = [k, v]
        for step in range(cp):
            exchange = _RingExchange(kv, group) if step < cp - 1 else None
            source = (rank - step) % cp  # whose keys and values this rank holds at this step
            for qs, ks, masked in _pairs(mine, chunks_of_rank(source, cp, "ring"), size, is_causal, mask):
                scores = _scores(q[:, :, qs], _expand(kv[0][:, :, ks], repeat), scale, masked)  # (B, H, c, c)
                block_lse = scores.logsumexp(-1)
                block_out = _share(scores, block_lse[..., None]) @ _expand(kv[1][:, :, ks], repeat).float()
                new_lse = torch.logaddexp(lse[:, :, qs], block_lse)
                # Online softmax: rescale what was accumulated and what is added to the new normaliser.
                out[:, :, qs] = (out[:, :, qs] * _share(lse[:, :, qs], new_lse)[..., None]
                                 + block_out * _share(block_lse, new_lse)[..., None])
                lse[:, :, qs] = new_lse
            if exchange is not None:
                kv = exchange.wait()
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.group, ctx.is_causal, ctx.scale = group, is_causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, mask = ctx.saved_tensors
        group, is_causal, scale = ctx.group, ctx.is_causal, ctx.scale
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        mine = chunks_of_rank(rank, cp, "ring")
        size = q.shape[2] // len(mine)
        repeat = q.shape[1] // k.shape[1]
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1)  # (B, H, Tl): rowsum(dO * O), FlashAttention-2's D
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k, v]
        # The key/value gradients travel with their blocks, one exchange behind, and reach the owner after cp.
        grad_kv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                   torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(cp):
            exchange = _RingExchange(kv, group) if step < cp - 1 else None
            source = (rank - step) % cp
            for qs, ks, masked in _pairs(mine, chunks_of_rank(source, cp, "ring"), size, is_causal, mask):
                k_block, v_block = (_expand(t[:, :, ks], repeat).float() for t in kv)
                probs = _share(_scores(q[:, :, qs], k_block, scale, masked), lse[:, :, qs, None])
                grad_kv[1][:, :, ks] += _fold(probs.transpose(-1, -2) @ grad_out[:, :, qs], repeat)
                grad_scores = probs * (grad_out[:, :, qs] @ v_block.transpose(-1, -2) - delta[:, :, qs, None])
                grad_q[:, :, qs] += grad_scores @ k_block * scale
                grad_kv[0][:, :, ks] += _fold(grad_scores.transpose(-1, -2) @ q[:, :, qs].float() * scale, repeat)
            grad_kv = _RingExchange(grad_kv, group).wait()  # to the rank that attends to these blocks next (or home)
            if exchange is not None:
                kv = exchange.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None


def _scores(q: Tensor, k: Tensor, scale: float, masked: bool | Tensor | None) -> Tensor:
    """Scaled scores of a chunk pair: ``masked`` True applies the causal diagonal; a tensor is the pair's block of
    ``attn_mask`` (bool: True attends; float: added)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, c, c)
    if masked is True:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        return scores.masked_fill(~causal, float("-inf"))
    if isinstance(masked, Tensor):
        return scores.masked_fill(~masked, float("-inf")) if masked.dtype == torch.bool else scores + masked.float()
    return scores


def _share(log_part: Tensor, log_total: Tensor) -> Tensor:
    """``exp(log_part - log_total)``, and 0 where ``log_total`` is -inf: a query row with no unmasked key yet (or in
    this pair) holds nothing, where the plain difference would be NaN."""
    return torch.where(torch.isneginf(log_total), 0.0, (log_part - log_total).exp())


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, *, is_causal: bool,
                   scale: float | None, mask: Tensor | None = None, dropout_p: float = 0.0) -> Tensor:
    """Attention of q/k/v (B, H, T/cp, D) over the whole sequence, keys and values passed round the ring; ``mask``:
    the whole sequence's (B or 1, H or 1, T, T), as ``scaled_dot_product_attention``'s ``attn_mask``, each chunk
    pair taking its block (a pair whose block masks everything is skipped, as the causal ones are). It has no
    attention dropout (its row says so, and the router refuses ``dropout_p`` before calling)."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"grouped-query attention needs the {q.shape[1]} query heads to be a multiple of the "
                         f"{k.shape[1]} key/value heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, group, is_causal, scale, mask)


# ---------------------------------------------------------------------------- all-gathered keys
class _GatherAlongSequence(torch.autograd.Function):
    """Every rank's (B, H, T/cp, D) chunks side by side in rank order; backward sums each rank's gradient of this
    rank's part onto it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        parts = [part.contiguous() for part in grad.chunk(dist.get_world_size(ctx.group), dim=2)]
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=ctx.group)
        return mine, None


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, *, is_causal: bool,
                        scale: float | None, mask: Tensor | None = None, dropout_p: float = 0.0) -> Tensor:
    """Attention of q/k/v (B, H, T/cp, D) over the whole sequence, keys and values all-gathered at their own heads
    and this rank's queries attending to all of them (Llama 3's context parallel: Dubey et al. 2024, "The Llama 3
    Herd of Models", sec. 3.3.2); ``mask``: the whole sequence's, as ``scaled_dot_product_attention``'s
    ``attn_mask``; ``dropout_p``: drawn by each rank for its queries."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    seq_len = q.shape[2] * cp
    keys, values = (_GatherAlongSequence.apply(t, group) for t in (k, v))
    queries_at = local_positions(seq_len, rank, cp, "allgather").to(q.device)
    keys_at = torch.cat([local_positions(seq_len, r, cp, "allgather") for r in range(cp)]).to(q.device)
    attn_mask = None if mask is None else mask[:, :, queries_at][:, :, :, keys_at]
    if is_causal:
        causal = queries_at[:, None] >= keys_at[None, :]
        attn_mask = (causal if attn_mask is None else attn_mask & causal if attn_mask.dtype == torch.bool
                     else attn_mask.masked_fill(~causal, float("-inf")))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=keys.shape[1] != q.shape[1])


# ------------------------------------------------------------------------- attaching to a model
class _RouteAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to context-parallel attention over ``group``."""

    def __init__(self, group: dist.ProcessGroup, method: Method) -> None:
        super().__init__()
        self.group, self.method = group, method

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.attend(*args, **kwargs)

    def attend(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor:
        whole = query.shape[2] * dist.get_world_size(self.group)
        if attn_mask is not None and (attn_mask.dim() != 4 or tuple(attn_mask.shape[-2:]) != (whole, whole)):
            raise ValueError(f"context parallel attention takes an attn_mask of the whole sequence, (batch, heads, "
                             f"{whole}, {whole}) with batch and heads 1 or full (each rank attends for its chunks), "
                             f"got shape {tuple(attn_mask.shape)}: use is_causal=True, or a mask of every position")
        method = CONTEXT_METHODS[self.method]
        if dropout_p != 0.0 and not method.attention_dropout:
            others = " or ".join(f"cp_method={spec.name!r}" for spec in CONTEXT_METHODS.values()
                                 if spec.attention_dropout)
            raise ValueError(f"context parallel {self.method!r} attention has no attention dropout ({method.summary}); "
                             f"got dropout_p={dropout_p}: use {others}, or turn attention dropout off")
        attend = globals()[method.attention_function]  # the row's function, defined in this module
        return attend(query, key, value, self.group, is_causal=is_causal, scale=scale, mask=attn_mask,
                      dropout_p=dropout_p)


class _GatherSequence(torch.autograd.Function):
    """All-gather the sequence slices into the whole sequence in token order; see the module docstring
    for why the backward keeps this rank's slice scaled by ``cp``."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup, method: Method) -> Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        ctx.positions, ctx.cp = local_positions(local.shape[1] * cp, rank, cp, method).to(local.device), cp
        return SequenceSplit(group, method, cp).whole(local)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad[:, ctx.positions] * ctx.cp, None, None


@dataclass(frozen=True)
class SequenceSplit:
    """How the ranks of ``group`` hold each sequence, for a layer whose computation spans a sequence: a
    mixture-of-experts router's per-sequence capacity and load-balancing statistics (GShard; Switch, eq. 4) and its
    z-loss (ST-MoE). Context parallel gives each of ``cp`` ranks its chunks (``method``); sequence parallel, where
    the layer routes the tokens of its tensor-parallel rank (``RoutedOnLocalTokens``), splits a chunk further into
    ``tp`` contiguous pieces. ``group`` holds the ``cp x tp`` ranks, tensor-parallel ones innermost. Such a layer has a
    ``sequence_split`` attribute, which :func:`apply_context_parallel` and tensor parallel set, and computes those
    numbers as on the whole sequence:

    * :meth:`whole` gathers a per-token quantity that needs no gradient (the chosen experts) in token order, so that
      the capacity's priority order (by position in the sequence) is the whole sequence's;
    * :meth:`total` sums a partial statistic over the ranks (a sum of router probabilities over this rank's
      tokens). Every rank forms the same loss from the total, and its gradient reaches each rank's part as the
      loss's does through the layout: ``cp`` times (the gather after the head; the average over ``dp x cp`` takes
      it out), once over tensor parallel.
    """

    group: dist.ProcessGroup
    method: Method
    cp: int
    tp: int = 1

    def positions(self, seq_len: int, device: torch.device) -> Tensor:
        """The global positions of this rank's tokens in a sequence of ``seq_len``."""
        return self._positions_of(dist.get_rank(self.group), seq_len).to(device)

    def _positions_of(self, rank: int, seq_len: int) -> Tensor:
        cp_rank, tp_rank = divmod(rank, self.tp)
        chunk = local_positions(seq_len, cp_rank, self.cp, self.method) if self.cp > 1 else torch.arange(seq_len)
        return chunk.chunk(self.tp)[tp_rank]

    def whole(self, local: Tensor) -> Tensor:
        """(B, T / ranks, ...) of this rank -> (B, T, ...) of the whole sequence, in token order (no gradient)."""
        ranks = dist.get_world_size(self.group)
        parts = [torch.empty_like(local) for _ in range(ranks)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.group)
        seq_len = local.shape[1] * ranks
        order = torch.cat([self._positions_of(r, seq_len) for r in range(ranks)])
        return torch.cat(parts, dim=1)[:, order.argsort().to(local.device)]

    def total(self, partial: Tensor) -> Tensor:
        """The sum of ``partial`` over the ranks holding parts of the sequence; differentiable (see above)."""
        return _Total.apply(partial, self.group, self.tp)


class _Total(torch.autograd.Function):
    """All-reduce (sum); backward sums the ranks' gradients, divided by the tensor-parallel ranks among them."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor, group: dist.ProcessGroup, tp: int) -> Tensor:
        ctx.group, ctx.tp = group, tp
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / ctx.tp, None, None


class ContextParallelBlock:
    """Replaces a block's ``forward``: cut sequence inputs, route attention, gather after the last block when no
    head gathers (:class:`GatherAtHead`)."""

    def __init__(self, forward: Callable, group: dist.ProcessGroup, method: Method, *, first: bool,
                 last: bool) -> None:
        self.forward, self.group, self.method, self.first, self.last = forward, group, method, first, last
        self.rank, self.cp = dist.get_rank(group), dist.get_world_size(group)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]  # (B, T, C), or (B, T/cp, C) after the first
        seq_len = hidden.shape[1] if self.first else hidden.shape[1] * self.cp
        if self.first:
            check_sequence_length(seq_len, self.cp, self.method)
        positions = local_positions(seq_len, self.rank, self.cp, self.method).to(hidden.device)
        cut = _SequenceCut(hidden, positions, seq_len, first=self.first)
        args, kwargs = cut(args), {name: cut(value) for name, value in kwargs.items()}
        with _RouteAttention(self.group, self.method):
            output = self.forward(*args, **kwargs)
        if not self.last:
            return output
        if isinstance(output, tuple):  # blocks that return (hidden, extras...)
            return (gather_sequence(output[0], self.group, self.method), *output[1:])
        return gather_sequence(output, self.group, self.method)


@dataclass(frozen=True, eq=False)
class _SequenceCut:
    """A block's inputs cut to this rank's tokens: the hidden states (the first block's; later blocks receive them
    cut), and tensors beside them that run along the sequence (position ids, rotary tables), in tuples and lists too.

    An object rather than a nested function that calls itself: such a function holds itself through its closure,
    a reference cycle that keeps every tensor it closes over (the first block's input is the whole sequence) alive
    until Python's cyclic collector runs, not until the block's forward returns. A dry run's memory tracker, like
    the device's allocator, sees a tensor freed only when Python frees it."""

    hidden: Tensor
    positions: Tensor
    seq_len: int
    first: bool

    def __call__(self, x: Any) -> Any:
        if isinstance(x, (tuple, list)):
            return type(x)(self(item) for item in x)
        if not isinstance(x, Tensor) or x.dim() == 0:
            return x
        if x is self.hidden:
            return _take(x, 1, self.positions) if self.first else x
        if x.dim() >= 2 and x.shape[0] in (1, self.hidden.shape[0]) and x.shape[1] == self.seq_len:
            return _take(x, 1, self.positions)  # (B or 1, T, ...): position ids, rotary tables
        if x.shape[0] == self.seq_len:  # (T, ...): rotary tables shared by the batch
            return _take(x, 0, self.positions)
        return x


class GatherAtHead:
    """Forward hook of the head: its output (the logits of this rank's tokens) gathered into the whole sequence's.

    The final norm and the head then run on ``T / cp`` tokens per rank, not on the whole sequence on every rank
    (the head of a large vocabulary costs as much as several blocks), while the loss still sees every position's
    logits. Used where :func:`head_follows_last_block` found the head computing each position from the last block's
    output at that position alone, as a decoder's does.
    """

    def __init__(self, group: dist.ProcessGroup, method: Method) -> None:
        self.group, self.method = group, method

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return gather_sequence(output, self.group, self.method)


def head_follows_last_block(module: nn.Module, model_map: ModelMap, sample: Tensor) -> bool:
    """Whether the head of ``module`` receives the last block's output itself, through the final norm only (each a
    per-position function), so that it can run on a rank's slice of the sequence. Checked on one forward of a small
    copy (``sample``: model inputs); a model that pools, selects tokens or projects between them gathers after the
    last block instead."""
    steps = [name for name in (model_map.final_norm, model_map.head) if name is not None]
    if model_map.head is None or not all(_holds(module, name) for name in steps):
        return False
    small = small_copy(module, model_map.blocks, sample.device, torch.float32, min_blocks=2)
    last = small.get_submodule(model_map.block_names(small)[-1])
    outputs: list[Tensor] = []
    follows: list[bool] = []

    def record(_: nn.Module, __: tuple, output: Any) -> None:
        outputs.append(first_tensor(output)[0])

    def check(_: nn.Module, args: tuple, kwargs: dict) -> None:
        given = args[0] if args else next(iter(kwargs.values()), None)
        before = outputs[-1] if outputs else None
        # The tensor itself, or a view of all of it (a model's ``hidden[:, slice(0, None)]`` before its head).
        follows.append(isinstance(given, Tensor) and isinstance(before, Tensor) and given.shape == before.shape
                       and given.data_ptr() == before.data_ptr() and given.stride() == before.stride())

    handles = [last.register_forward_hook(record)]
    for name in steps:
        step = small.get_submodule(name)
        handles += [step.register_forward_pre_hook(check, with_kwargs=True), step.register_forward_hook(record)]
    try:
        with torch.no_grad():
            run_model(small, sample[:1])
    except Exception:  # noqa: BLE001 - a model the copy cannot run gathers after the last block, as before
        return False
    finally:
        for handle in handles:
            handle.remove()
    return len(follows) == len(steps) and all(follows)


def gather_sequence(local: Tensor, group: dist.ProcessGroup, method: Method) -> Tensor:
    """This rank's slice (B, T/cp, ...) -> the whole sequence (B, T, ...), laid out as the slice was; its gradient
    keeps this rank's slice scaled by ``cp`` (module docstring)."""
    return _along_sequence(local, 1, lambda whole: _GatherSequence.apply(whole, group, method))


def _along_sequence(x: Tensor, dim: int, function: Callable[[Tensor], Tensor]) -> Tensor:
    """``function`` of ``x`` along its sequence dimension ``dim``, as a plain tensor. A DTensor is made whole along
    ``dim`` first and laid out again afterwards: the sequence-parallel activations of tensor parallel ((B, T, C)
    split along T over ``tp``), so that sequence parallel splits the context-parallel chunk, not the sequence
    (Korthikanti et al. 2022 inside Megatron's context parallel). Other placements (logits split over the
    vocabulary, Replicate) stay: ``function`` runs on the local tensor. Every step keeps the same value on the ranks
    a ``Replicate`` claims, forward and backward, so DTensor's gradients of the two re-layouts are the right ones."""
    if not isinstance(x, DTensor):
        return function(x)
    mesh, placements = x.device_mesh, x.placements
    along = tuple(Replicate() if p.is_shard() and p.dim % x.dim() == dim else p for p in placements)
    result = function(x.redistribute(mesh, along).to_local())
    return DTensor.from_local(result, mesh, along, run_check=False).redistribute(mesh, placements)


def _take(x: Tensor, dim: int, positions: Tensor) -> Tensor:
    """The entries of ``x`` at ``positions`` along ``dim`` (a sequence dimension), DTensors included."""
    return _along_sequence(x, dim, lambda whole: whole.index_select(dim, positions))


def apply_context_parallel(module: nn.Module, mesh: ParallelMesh, model_map: ModelMap | None, *,
                           method: Method = "ulysses", gather_at_head: bool = False) -> nn.Module:
    """Split every sequence over the ``cp`` dimension of ``mesh`` inside the blocks ``model_map`` names (in place).
    ``gather_at_head`` (where :func:`head_follows_last_block`): the final norm and head run on each rank's tokens
    and the logits are gathered; otherwise the last block's output is."""
    cp = mesh.size("cp")
    if cp == 1:
        return module
    if method not in CP_METHODS:
        raise ValueError(f"context parallel method {method!r} is not one of {CP_METHODS}")
    if model_map is None:
        raise ValueError(f"cp={cp!r} needs to know where the blocks are, and no model map was "
                         f"found ({why_no_blocks(module)}): give the strategy a model map (model_map: "
                         "{blocks: ...}) or use a standard decoder layout")
    # A router's per-sequence numbers (capacity, load-balancing statistics) are computed over the whole sequence
    # by the layers that know of the split; a model map's stacked experts are routed token by token by the model's
    # own router and need nothing.
    for sub in module.modules():
        if hasattr(sub, "sequence_split"):
            by_tp = sub.sequence_split is not None and sub.sequence_split.tp > 1  # sequence parallel: routes its piece
            sub.sequence_split = (SequenceSplit(mesh.group("cp_tp"), method, cp, mesh.size("tp")) if by_tp
                                  else SequenceSplit(mesh.group("cp"), method, cp))
    names = model_map.block_names(module)
    if gather_at_head:
        module.get_submodule(model_map.head).register_forward_hook(GatherAtHead(mesh.group("cp"), method))
    for index, name in enumerate(names):
        block = module.get_submodule(name)
        # An instance attribute shadows the class's forward; the parameter names (and checkpoints) stay.
        block.forward = ContextParallelBlock(block.forward, mesh.group("cp"), method, first=index == 0,
                                             last=not gather_at_head and index == len(names) - 1)
    return module


def _holds(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


__all__ = [
    "GatherAtHead",
    "SequenceSplit",
    "apply_context_parallel",
    "causal_score_blocks",
    "check_sequence_length",
    "gather_sequence",
    "head_follows_last_block",
    "chunks_of_rank",
    "local_positions",
    "ring_attention",
    "ulysses_attention",
]
