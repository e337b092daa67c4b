"""Context-parallel attention methods, one row each, and the token layout every reader derives from the rows.

:data:`CONTEXT_METHODS` holds what the runtime (``parallel/context.py``), the config's checks and the planner
(``planner/search.py``, ``memory.py``, ``time.py``, ``report.py``) need to know about a way of attending across the
sequence slices of ``cp`` ranks: which chunks of the sequence a rank holds, whether the heads are split over the
ranks, whether attention dropout runs, the bytes it exchanges, whether those hide behind attention, the activations
and score blocks it keeps, and the function of ``parallel/context.py`` that runs it. Adding a method is adding a row
and that function (docs/architecture.md walks through the all-gather row, added so); nothing else names methods. The
rows' papers:

* Ulysses: Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
  Sequence Transformer Models";
* ring: Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context", with the causal load
  balancing of Llama 3 and Megatron's context parallel (rank ``r`` holds chunks ``r`` and ``2cp - 1 - r``);
* all-gather: Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.2: keys and values all-gathered, each rank's
  queries (the same balanced chunks) attending to the whole sequence.

Pure Python: neither torch nor the package is imported, so the config and the planner read the table without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

#: Chunk-pair score blocks a ring attention's backward holds at its peak (``parallel.context._RingAttention``: the
#: probabilities, the masked scores and their exponential being formed, the scores' gradient), measured by the dry
#: run at 128K tokens (tests/test_dry_run.py).
RING_SCORE_BLOCKS = 4


@dataclass(frozen=True)
class ContextMethodSpec:
    """One method of attending across the sequence slices: every fact the package reads about it.

    Sizes are per block and per micro-batch on one rank. ``local`` is the bytes of one (B, H/tp, T/cp, D) tensor,
    ``heads`` and ``kv_heads`` the query and key/value heads of a tensor-parallel rank, ``recomputed`` whether full
    activation checkpointing runs the block's forward again; ``a`` is the bytes of a matmul activation, ``h`` the
    model width.
    """

    name: str
    #: The planner's suffix after ``cp{n}`` (empty for the default method).
    label: str
    paper: str
    #: One line for the config's error that lists the methods.
    summary: str
    #: Rank r holds chunks r and 2cp - 1 - r of 2cp equal chunks (the same causal work on every rank), instead of
    #: chunk r of cp.
    balances_causal_work: bool
    #: Attention heads are divided over the cp ranks (cp x tp must divide the query heads).
    splits_heads: bool
    #: ``dropout_p`` of ``scaled_dot_product_attention`` runs (else a block with attention dropout is refused).
    attention_dropout: bool
    #: Bytes a rank sends to the others per block and micro-batch:
    #: ``exchange_bytes(local, heads, kv_heads, cp, recomputed)``.
    exchange_bytes: Callable[[float, int, int, int, bool], float]
    #: The exchanges run behind the attention of the blocks at hand (else on the critical path).
    hides_behind_attention: bool
    #: Bytes per token a block keeps for its attention's backward, before the split over tp:
    #: ``attention_activation_bytes(a, h, heads, cp)``.
    attention_activation_bytes: Callable[[int, int, int, int], float]
    #: fp32 score blocks held at the peak of a block's backward: ``score_bytes(micro_batch, heads_per_rank, seq_len,
    #: cp)``.
    score_bytes: Callable[[int, float, int, int], float]
    #: The function of ``lightning_par.parallel.context`` that attends: ``(q, k, v, group, *, is_causal, scale,
    #: mask, dropout_p)``.
    attention_function: str
    #: The planner tries methods in this order; at cp = 1 it keeps the first.
    search_order: int


def _all_to_alls(local: float, heads: int, kv_heads: int, cp: int, recomputed: bool) -> float:
    # Forward, q, k and v to heads and the output back; backward, their gradients; the forward again when recomputed.
    # k and v travel at their own heads where those split over cp, else expanded to the query heads first. An
    # all-to-all keeps 1/cp of its tensor on the rank.
    key = local * (kv_heads / heads if kv_heads % cp == 0 else 1.0)
    return (3 if recomputed else 2) * (2 * local + 2 * key) * (cp - 1) / cp


def _round_the_ring(local: float, heads: int, kv_heads: int, cp: int, recomputed: bool) -> float:
    # Key and value blocks at their own heads: forward passes them on cp - 1 times (once more when recomputed), and
    # backward too, with their gradients, which travel cp times to come home.
    kv = 2 * local * kv_heads / heads
    passes = 2 if recomputed else 1
    return ((cp - 1) * (passes + 1) + cp) * kv


def _keys_gathered(local: float, heads: int, kv_heads: int, cp: int, recomputed: bool) -> float:
    # k and v at their own heads: all-gathered forward (each rank sends its chunks to the cp - 1 others), their
    # gradients reduce-scattered backward; the forward again when recomputed.
    return (3 if recomputed else 2) * 2 * (cp - 1) * local * kv_heads / heads


def _heads_gathered(a: int, h: int, heads: int, cp: int) -> float:
    # q, k, v and the output at their heads, and the attention output gathered back to the sequence; fp32 log-sum-exp.
    return 5 * a * h + 4 * heads


def _blockwise(a: int, h: int, heads: int, cp: int) -> float:
    # q, k, v and the output; the fp32 accumulated output (4 h) and log-sum-exp.
    return 3 * a * h + 4 * h + a * h + 4 * heads


def _whole_keys(a: int, h: int, heads: int, cp: int) -> float:
    # q, k, v and the output, and the other ranks' keys and values gathered; fp32 log-sum-exp.
    return 4 * a * h + 2 * a * h * (cp - 1) + 4 * heads


def _no_score_blocks(micro_batch: int, heads_per_rank: float, seq_len: int, cp: int) -> float:
    return 0.0


def _ring_score_blocks(micro_batch: int, heads_per_rank: float, seq_len: int, cp: int) -> float:
    chunk = seq_len / (2 * cp)  # one (heads, chunk, chunk) fp32 block per sequence and chunk pair
    return RING_SCORE_BLOCKS * micro_batch * heads_per_rank * chunk * chunk * 4


CONTEXT_METHODS: dict[str, ContextMethodSpec] = {spec.name: spec for spec in (
    ContextMethodSpec("ulysses", label="", paper="Jacobs et al. 2023 (DeepSpeed Ulysses)",
                      summary="all-to-all of heads and sequence", balances_causal_work=False, splits_heads=True,
                      attention_dropout=True, exchange_bytes=_all_to_alls, hides_behind_attention=False,
                      attention_activation_bytes=_heads_gathered, score_bytes=_no_score_blocks,
                      attention_function="ulysses_attention", search_order=0),
    ContextMethodSpec("ring", label="-ring", paper="Liu et al. 2023 (Ring Attention)",
                      summary="key/value blocks passed round the ranks", balances_causal_work=True,
                      splits_heads=False, attention_dropout=False, exchange_bytes=_round_the_ring,
                      hides_behind_attention=True, attention_activation_bytes=_blockwise,
                      score_bytes=_ring_score_blocks, attention_function="ring_attention", search_order=1),
    ContextMethodSpec("allgather", label="-ag", paper="Dubey et al. 2024 (Llama 3), sec. 3.3.2",
                      summary="keys and values all-gathered", balances_causal_work=True, splits_heads=False,
                      attention_dropout=True, exchange_bytes=_keys_gathered, hides_behind_attention=False,
                      attention_activation_bytes=_whole_keys, score_bytes=_no_score_blocks,
                      attention_function="allgather_attention", search_order=2),
)}

ContextMethod = Literal[tuple(CONTEXT_METHODS)]  # type: ignore[valid-type]


def chunks_of_rank(rank: int, cp: int, method: ContextMethod) -> tuple[int, ...]:
    """Indices of the equal sequence chunks rank ``rank`` holds, in the order it holds them."""
    return (rank, 2 * cp - 1 - rank) if CONTEXT_METHODS[method].balances_causal_work else (rank,)


def sequence_divisor(cp: int, method: ContextMethod) -> int:
    """The number of equal chunks the sequence is cut into: its length must be a multiple of it."""
    return 2 * cp if CONTEXT_METHODS[method].balances_causal_work else cp


def fits(seq_len: int, heads_per_tp_rank: int, cp: int, method: ContextMethod) -> bool:
    """Whether ``method`` splits ``seq_len`` tokens and, where it divides heads, ``heads_per_tp_rank`` over ``cp``."""
    spec = CONTEXT_METHODS[method]
    return seq_len % sequence_divisor(cp, method) == 0 and (not spec.splits_heads or heads_per_tp_rank % cp == 0)


__all__ = ["CONTEXT_METHODS", "ContextMethod", "ContextMethodSpec", "RING_SCORE_BLOCKS", "chunks_of_rank",
           "fits", "sequence_divisor"]
