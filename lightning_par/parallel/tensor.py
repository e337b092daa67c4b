"""Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism") on PyTorch DTensor.

Inside each transformer block the first projection of a pair is split by output features (column-wise:
q/k/v, gate/up) and the second by input features (row-wise: o, down), so each rank computes its own heads
and its own slice of the MLP hidden units, and one all-reduce per pair restores the full activation.
The embedding is split by vocabulary rows (each rank looks up the tokens it holds, an all-reduce sums
them) and the head by vocabulary columns (an all-gather assembles the logits, or, with loss parallel,
the logits stay split and the cross-entropy is computed on the shards). Which module gets which style
comes from the model plan (``colwise``, ``rowwise``, ``vocab``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import inspect

import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.overrides import TorchFunctionMode

from lightning_par.config import divisors
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.plan import ModelPlan


class PrepareFirstInput(ParallelStyle):
    """Lay out a module's first input, passed by position or by keyword, as ``desired`` (a DTensor).

    PyTorch's ``PrepareModuleInput`` needs to know whether the caller passes the input by position; this
    style accepts both, so the same plan fits modules called as ``attn(x)`` and as ``attn(hidden_states=x)``
    (Hugging Face).
    """

    def __init__(self, layout: Placement, desired: Placement) -> None:
        super().__init__()
        self.layout, self.desired = layout, desired

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))

        def convert(x: Any) -> Any:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (self.layout,), run_check=False)
            return x.redistribute(device_mesh, (self.desired,))

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (convert(args[0]), *args[1:]), kwargs
            return args, {**kwargs, first: convert(kwargs[first])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def tensor_parallel_styles(module: nn.Module, plan: ModelPlan, *, sequence_parallel: bool = False,
                           vocab_parallel_logits: bool = False) -> dict[str, ParallelStyle]:
    """The DTensor style of every module that ``plan`` marks ``colwise``, ``rowwise``, ``vocab`` or ``sequence``.

    With ``sequence_parallel`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models") the activations between the tensor-parallel regions stay split along the
    sequence: norms run on 1/tp of the tokens, each region starts with an all-gather of the sequence and
    ends with a reduce-scatter, in place of the one all-reduce (same bytes, 1/tp of the activation memory).
    With ``vocab_parallel_logits`` the head returns its logits as a DTensor split over the vocabulary, for
    :func:`vocab_parallel_loss`.
    """
    # Activations between the regions: whole tensors, or under sequence parallel DTensors split along the
    # sequence. DTensors, not their local pieces, so that code between the blocks (residual adds, rotary
    # tables built from the hidden states' length, as in Hugging Face models) sees the global shape.
    between = Shard(1) if sequence_parallel else Replicate()
    styles: dict[str, ParallelStyle] = {}
    for name, sub in module.named_modules():
        style = plan.style_of(name)
        if style == "vocab" and isinstance(sub, nn.Embedding):
            # Rows are the vocabulary: each rank embeds the tokens it holds; the partial sums are reduced.
            styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between,
                                           use_local_output=not sequence_parallel)
        elif style == "colwise" and isinstance(sub, nn.Linear) and name == plan.head and vocab_parallel_logits:
            styles[name] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
        elif style == "colwise" and isinstance(sub, nn.Linear) and name == plan.head:
            # The vocabulary-sharded logits are gathered so that any loss function sees them whole.
            styles[name] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
        elif style == "colwise" and isinstance(sub, nn.Linear):
            styles[name] = ColwiseParallel()
            # The module owning the projections (attention, MLP) hands all of them one replicated input: one
            # all-gather of the sequence under sequence parallel, and in backward their input gradients are
            # summed before one all-reduce (or reduce-scatter), not one per projection (Megatron's f operator).
            styles[name.rpartition(".")[0]] = PrepareFirstInput(between, Replicate())
        elif style == "rowwise" and isinstance(sub, nn.Linear):
            styles[name] = RowwiseParallel(output_layouts=between, use_local_output=not sequence_parallel)
        elif style == "sequence" and sequence_parallel:
            styles[name] = SequenceParallel()
    return styles


def check_tensor_parallel(module: nn.Module, plan: ModelPlan | None, tp: int) -> None:
    """Raise ``ValueError`` when ``module`` cannot be split ``tp`` ways, naming the size and what fits."""
    if tp == 1:
        return
    if plan is None:
        raise ValueError(
            f"tp={tp} needs to know which layers to split, and no model plan was found: give the strategy a plan "
            "(plan: {blocks: ..., styles: {...}}) or use a standard decoder layout (see docs/architecture.md)"
        )
    for name, style in tensor_parallel_styles(module, plan).items():
        sub = module.get_submodule(name)
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        if isinstance(sub, nn.Embedding):
            size, what = sub.num_embeddings, "vocabulary size"
        elif isinstance(style, ColwiseParallel):
            size, what = sub.out_features, "output features"
        else:
            size, what = sub.in_features, "input features"
        parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        head_dim = getattr(parent, "head_dim", None)
        if isinstance(head_dim, int) and isinstance(sub, nn.Linear) and size % head_dim == 0:
            # Attention projections must split into whole heads, not just into equal slices.
            size, what = size // head_dim, "heads"
        if size % tp != 0:
            fits = [d for d in divisors(size) if d <= 64]
            raise ValueError(f"tp={tp} does not divide the {size} {what} of {name!r}; tensor-parallel sizes that "
                             f"fit this layer: {fits}")


def apply_tensor_parallel(module: nn.Module, mesh: ParallelMesh, plan: ModelPlan | None, *,
                          sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    """Split the layers of ``module`` that ``plan`` marks over the ``tp`` dimension of ``mesh`` (in place).

    Under ``sequence_parallel`` the sequence length of every batch must be divisible by ``tp``. Under
    ``loss_parallel`` the head's logits stay split over the vocabulary: run the loss inside
    :func:`vocab_parallel_loss`.
    """
    tp = mesh.size("tp")
    if tp == 1:
        return module
    check_tensor_parallel(module, plan, tp)
    assert plan is not None
    styles = tensor_parallel_styles(module, plan, sequence_parallel=sequence_parallel,
                                    vocab_parallel_logits=loss_parallel)
    parallelize_module(module, mesh["tp"], styles)
    for name, sub in module.named_modules():
        if plan.style_of(name) == "vocab" and isinstance(sub, nn.Embedding):
            sub.weight.register_hook(_KeepPlacements(sub.weight.placements))
    if sequence_parallel and plan.embedding is not None:
        # Before the embedding's collective, on every rank alike: a sequence that does not split would
        # otherwise fail deep inside DTensor with shapes that do not mention the cause.
        module.get_submodule(plan.embedding).register_forward_pre_hook(_SequenceLengthCheck(tp))
    return module


class _KeepPlacements:
    """Gives a parameter's gradient the parameter's own placements.

    DTensor's embedding backward returns the gradient of a vocabulary-sharded table replicated: the whole
    (V, h) table on every tensor-parallel rank (torch 2.13). Re-sharding it right away is a local slice, and
    the accumulated gradient (and what the optimizer reads) is then 1/tp of it, like the weight.
    """

    def __init__(self, placements: tuple[Placement, ...]) -> None:
        self.placements = placements

    def __call__(self, grad: DTensor) -> DTensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(self.placements):
            return grad.redistribute(grad.device_mesh, self.placements)
        return grad


class _SequenceLengthCheck:
    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: tuple) -> None:
        seq_len = args[0].shape[1]
        if seq_len % self.tp != 0:
            raise ValueError(f"sequence parallel splits the sequence over tp={self.tp} ranks, but a batch has "
                             f"{seq_len} tokens; use a sequence length divisible by {self.tp}")


# The losses PyTorch's loss_parallel computes on class-sharded inputs.
_SHARDABLE_LOSSES: tuple[Callable, ...] = (F.cross_entropy, F.nll_loss)


class _PlainLoss(TorchFunctionMode):
    """Returns the result of a loss computed on sharded logits as a plain tensor, so the code around it
    (logging, gradient scaling, Lightning's loop) never meets a DTensor."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in _SHARDABLE_LOSSES and isinstance(result, DTensor):
            return result.full_tensor()  # the mean is replicated already: no communication
        return result


@contextmanager
def vocab_parallel_loss(enabled: bool = True) -> Iterator[None]:
    """Cross-entropy on vocabulary-sharded logits (Megatron-LM's vocab-parallel cross-entropy).

    Each rank takes the max and the sum of exponentials over its slice of the vocabulary and picks the
    target logit if it holds it; three all-reduces of (B, T) scalars replace gathering (B, T, V) logits.
    This is PyTorch's ``loss_parallel``; the context must cover the loss's forward and its backward.
    """
    if not enabled:
        yield
        return
    with loss_parallel(), _PlainLoss():
        yield


__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "tensor_parallel_styles", "vocab_parallel_loss"]
