"""Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism") on PyTorch DTensor.

Inside each transformer block the first projection of a pair is split by output features (column-wise:
q/k/v, gate/up) and the second by input features (row-wise: o, down), so each rank computes its own heads
and its own slice of the MLP hidden units, and one all-reduce per pair restores the full activation.
The embedding is split by vocabulary rows (each rank looks up the tokens it holds, an all-reduce sums
them) and the head by vocabulary columns (an all-gather assembles the logits, or, with loss parallel,
the logits stay split and the cross-entropy is computed on the shards). Which module gets which style
comes from the model map (``colwise``, ``rowwise``, ``colwise_gather``, ``rowwise_split``, ``vocab``,
``sequence``, ``per_shard``, ``shared_rope_key``; see ``lightning_par.parallel.model_map``), checked against the
model's computation before training (``lightning_par.parallel.model_map_check``). ``nn.Linear`` and GPT-2's
``Conv1D`` (weight stored as (in, out)) are both split. A fused projection whose output the model cuts into sections
([q | k | v]) has its rows regrouped so that each rank holds its part of every section
(``lightning_par.parallel.regroup``), and the head counts of a module the model map names are set to each rank's
(``lightning_par.parallel.local_heads``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (DTensor, Partial, Placement, Replicate, Shard, distribute_module,
                                      distribute_tensor)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.overrides import TorchFunctionMode

from lightning_par.layout.config import divisors
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.adapters import base_layer as adapter_base
from lightning_par.parallel.adapters import is_adapted, is_lora, unused_lora_weights
from lightning_par.parallel.context import SequenceSplit
from lightning_par.parallel.buckets import all_reduce_in_buckets
from lightning_par.parallel.experts import local_part, moe_layers
from lightning_par.parallel.local_heads import localize_head_counts
from lightning_par.parallel.model_map import (SPLIT_STYLES, ModelMap, is_conv1d, is_projection, projection_features,
                                              why_no_blocks)
from lightning_par.parallel.modules import retie, tied_groups
from lightning_par.parallel.regroup import regroup_rows


class PrepareFirstInput(ParallelStyle):
    """Lay out a module's first input, passed by position or by keyword, as ``desired`` (a DTensor).

    PyTorch's ``PrepareModuleInput`` needs to know whether the caller passes the input by position; this
    style accepts both, so the same styles fit modules called as ``attn(x)`` and as ``attn(hidden_states=x)``
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


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    """Make the parameters ``placements`` names (dotted names inside ``module``) DTensors laid out so, keeping whether
    each requires a gradient."""
    for name, placement in placements.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        parameter = getattr(owner, leaf, None)
        if parameter is not None:
            owner.register_parameter(leaf, nn.Parameter(distribute_tensor(parameter, mesh, [placement]),
                                                        requires_grad=parameter.requires_grad))


def _split_placements(module: nn.Module, *, colwise: bool) -> dict[str, Placement]:
    """Where each parameter of a ``Conv1D``, or of a LoRA layer (peft) on a linear or ``Conv1D`` layer, goes when the
    layer is split column-wise (its output features) or row-wise (its input features).

    A LoRA layer is split like the layer it adapts (torchtitan's rule for LoRA under tensor parallel): column-wise,
    ``lora_B`` (r -> out) is split by its output features and ``lora_A`` stays whole; row-wise, ``lora_A`` (in -> r)
    is split by its input features and ``lora_B`` stays whole. The adapter's output then has the base's layout, and
    the row-wise partial sums of base and adapter are reduced by one collective."""
    base = adapter_base(module)
    if base is not module and not (is_lora(module) and module.base_layer is base and is_projection(base)):
        raise ValueError(f"tensor parallel splits LoRA layers (peft) on linear layers; this {type(module).__name__} "
                         f"adapts a {type(base).__name__}{' through another adapter' if module.base_layer is not base else ''}"
                         ", which it cannot split: adapt the linear projections with LoRA, or train this model with "
                         "data parallel / ZeRO")
    weight_dim = (1 if colwise else 0) if is_conv1d(base) else (0 if colwise else 1)  # Conv1D stores (in, out)
    placements: dict[str, Placement] = {}
    prefix = "" if base is module else "base_layer."
    placements[prefix + "weight"] = Shard(weight_dim)
    placements[prefix + "bias"] = Shard(0) if colwise else Replicate()
    if base is module:
        return placements
    for adapter in module.lora_A:
        placements[f"lora_A.{adapter}.weight"] = Replicate() if colwise else Shard(1)
        placements[f"lora_B.{adapter}.weight"] = Shard(0) if colwise else Replicate()
        placements[f"lora_B.{adapter}.bias"] = Shard(0) if colwise else Replicate()
    held = {name for name, _ in module.named_parameters()}
    others = sorted(held - set(placements))
    if others:
        raise ValueError(f"tensor parallel splits a LoRA layer's base_layer, lora_A and lora_B; this "
                         f"{type(module).__name__} also holds {others} ({', '.join(unused_lora_weights(module))}), "
                         "which it cannot split: adapt linear layers with plain LoRA (no DoRA, no embedding adapters) "
                         "under tensor parallel, or train this model with data parallel / ZeRO")
    return placements


def _distribute_split(style: ColwiseParallel | RowwiseParallel, module: nn.Module, mesh: DeviceMesh, *,
                      colwise: bool) -> nn.Module:
    """``style`` applied to a layer PyTorch's styles do not split themselves (``Conv1D``, a LoRA layer): its
    parameters laid out by :func:`_split_placements`, its input and output as ``style`` lays them out."""
    placements = _split_placements(module, colwise=colwise)
    return distribute_module(
        module, mesh, lambda name, m, mesh: _distribute(m, mesh, placements) if not name else None,
        lambda m, inputs, mesh: style._prepare_input_fn(style.input_layouts, style.desired_input_layouts, m, inputs,
                                                        mesh),
        lambda m, outputs, mesh: style._prepare_output_fn(style.output_layouts, style.use_local_output, m, outputs,
                                                          mesh))


class Colwise(ColwiseParallel):
    """PyTorch's ``ColwiseParallel``, also for ``Conv1D``, whose (in, out) weight splits along dim 1, and for a LoRA
    layer on either (:func:`_split_placements`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not (is_conv1d(module) or is_adapted(module)):
            return super()._apply(module, device_mesh)
        return _distribute_split(self, module, device_mesh, colwise=True)


class Rowwise(RowwiseParallel):
    """PyTorch's ``RowwiseParallel``, also for ``Conv1D``, whose (in, out) weight splits along dim 0, and for a LoRA
    layer on either (:func:`_split_placements`).

    A whole output is handed on as a tensor of its own, not as the view of the DTensor's local tensor that
    ``to_local`` returns: models add to it in place (Falcon's parallel attention: ``mlp_output +=
    attention_output``), which autograd refuses on a view made by a custom Function.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return outputs.clone() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not (is_conv1d(module) or is_adapted(module)):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_split(self, module, device_mesh, colwise=False)


class VocabParallelEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight is split by vocabulary rows over the tensor-parallel ranks, looking up on its
    own rows only (Megatron-LM's ``VocabParallelEmbedding``; Shoeybi et al. 2019): a token another rank holds reads
    zeros here, and the partial embeddings are summed (the all-reduce, or the reduce-scatter of sequence parallel, that
    the style's output layout asks for). Its backward then produces the gradient of this rank's rows only, where
    DTensor's embedding backward hands over the whole (V, h) table on every rank first (torch 2.13). The class of
    a plain ``nn.Embedding`` the ``vocab`` style splits (:class:`VocabParallel`); the state dict is unchanged."""

    def forward(self, input: Tensor) -> DTensor:  # noqa: A002 - nn.Embedding's own argument name
        weight = self.weight
        rows = weight.to_local()  # its gradient arrives as a shard of the weight's, like the weight
        ids = input.to_local() if isinstance(input, DTensor) else input
        per_rank = -(-weight.shape[0] // weight.device_mesh.size())  # torch.chunk's rows per shard
        first = min(weight.device_mesh.get_local_rank() * per_rank, weight.shape[0])
        local_ids = ids - first
        elsewhere = (local_ids < 0) | (local_ids >= rows.shape[0])
        padding = (self.padding_idx - first if self.padding_idx is not None
                   and 0 <= self.padding_idx - first < rows.shape[0] else None)
        looked_up = F.embedding(local_ids.masked_fill(elsewhere, 0), rows, padding)
        looked_up = looked_up.masked_fill(elsewhere.unsqueeze(-1), 0)
        return DTensor.from_local(looked_up, weight.device_mesh, (Partial(),), run_check=False)


class VocabParallel(Rowwise):
    """The ``vocab`` style: PyTorch's row-wise split of an embedding's weight (``Shard(0)``), an ``nn.Embedding`` that
    looks up as ``nn.Embedding`` does becoming a :class:`VocabParallelEmbedding`. A subclass with a forward of its own
    (Gemma's scaled embedding) and one with ``max_norm``, ``scale_grad_by_freq`` or ``sparse`` keep DTensor's lookup."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if (type(module).forward is nn.Embedding.forward and module.max_norm is None and not module.scale_grad_by_freq
                and not module.sparse):
            module.__class__ = VocabParallelEmbedding
        return module


class PerShard(ParallelStyle):
    """A replicated module applied to each rank's share of a split activation (a norm over each head's features).

    Each rank sees only its heads, so its parameter gradients are partial: the parameters become ``Replicate``
    DTensors and the input is declared split (along its leading dimension: the module must not mix positions
    across it, which a per-head norm does not), so that DTensor sums the gradients over the tensor-parallel
    ranks. The output is handed on as the local tensor it was.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def declare_split(m: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, (Shard(0),), run_check=False)
                         if isinstance(x, Tensor) and not isinstance(x, DTensor) and x.is_floating_point() else x
                         for x in inputs)

        def local(m: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(
            module, device_mesh,
            lambda _, m, mesh: _distribute(m, mesh, {n: Replicate() for n, _ in m.named_parameters(recurse=False)}),
            declare_split, local)


class SharedRopeKey(ParallelStyle):
    """A replicated projection whose last ``rope_features`` output features reach every rank's split heads directly:
    the rotary key that multi-head latent attention computes once and shares among all heads (DeepSeek-AI 2024,
    "DeepSeek-V2", section 2.1.3). The rest of its output (the compressed key/value latent) reaches the heads through
    a column-wise projection, whose input gradient tensor parallel already sums over the ranks; the rotary part's
    gradient holds only this rank's heads' share, so it is summed here (Megatron's f operator on that part only).
    The weights stay whole and plain: their gradients are then whole on every rank."""

    def __init__(self, rope_features: int) -> None:
        super().__init__()
        self.rope_features = rope_features

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sum_rope_gradient(m: nn.Module, args: tuple, output: Tensor) -> Tensor:
            latent, rope = output.split([output.shape[-1] - self.rope_features, self.rope_features], dim=-1)
            # Identity forward; backward declares the gradient partial, and from_local's backward sums it over tp.
            rope = DTensor.from_local(rope, device_mesh, (Replicate(),), run_check=False).to_local(
                grad_placements=(Partial(),))
            return torch.cat([latent, rope], dim=-1)

        module.register_forward_hook(sum_rope_gradient)
        return module


def _rope_features(module: nn.Module, name: str) -> int:
    """``qk_rope_head_dim`` of the attention holding projection ``name`` (its attribute, or its config's)."""
    parent = module.get_submodule(name.rpartition(".")[0])
    for holder in (parent, parent.__dict__.get("config")):
        value = getattr(holder, "qk_rope_head_dim", None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"the model map gives {name!r} the style 'shared_rope_key', which sums the gradient of the "
                     f"projection's last qk_rope_head_dim output features over tp; {type(parent).__name__} "
                     f"{name.rpartition('.')[0]!r} holds no qk_rope_head_dim (nor does its config): give that "
                     "projection another style ('replicate' keeps the attention whole)")


class RoutedOnLocalTokens(ParallelStyle):
    """Under sequence parallel, a mixture-of-experts layer takes this rank's piece of the sequence (the local tensor of
    the sequence-split activations) and hands its output back as that piece: the router and the experts compute on
    1/tp of the tokens (Megatron-Core's MoE under sequence parallel; routing is per token). Such a layer is one that
    routes its own tokens (``MoEFeedForward``) or the module holding experts a model map marks (Hugging Face's MoE
    blocks: router, experts, shared experts). Nothing in it is split by tensor parallel (a shared expert computes
    this rank's tokens whole: the same work as split, without the gather and the reduce-scatter). Its weights stay
    whole on every tensor-parallel rank, each seeing other tokens: ``Parallelized.after_backward`` sums their
    gradients over ``tp`` (:func:`sum_over_tensor_parallel`). Capacity and load statistics span the sequence
    through the layer's ``sequence_split``
    (``lightning_par.parallel.context.SequenceSplit``), set here."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        module.sequence_split = SequenceSplit(device_mesh.get_group(), "ulysses", cp=1, tp=tp)
        shapes: list[torch.Size] = []  # of this rank's piece, for an output the layer returns flattened (Llama 4)

        def local(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            args = tuple(x.to_local() if isinstance(x, DTensor) else x for x in args)
            kwargs = {k: x.to_local() if isinstance(x, DTensor) else x for k, x in kwargs.items()}
            first = next((x for x in (*args, *kwargs.values()) if isinstance(x, Tensor)), None)
            shapes.append(first.shape if first is not None else None)
            return args, kwargs

        def split(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            shape = shapes.pop()
            if isinstance(output, tuple):  # (hidden states, router logits or scores): the logits stay local
                return (as_piece(output[0], shape), *output[1:])
            return as_piece(output, shape)

        def as_piece(output: Tensor, shape: torch.Size | None) -> Tensor:
            if isinstance(output, DTensor):
                return output
            if shape is not None and output.shape != shape and output.numel() == shape.numel():
                output = output.reshape(shape)
            return DTensor.from_local(output, device_mesh, (Shard(1),), run_check=False)

        module.register_forward_pre_hook(local, with_kwargs=True)
        module.register_forward_hook(split, with_kwargs=True)
        return module


def routed_on_local_tokens(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` that :class:`RoutedOnLocalTokens` made route this rank's piece of the sequence."""
    return [m for m in module.modules() if getattr(getattr(m, "sequence_split", None), "tp", 1) > 1]


def sum_over_tensor_parallel(module: nn.Module, mesh: ParallelMesh, *, bucket_cap_mb: float = 25.0) -> None:
    """Sum over ``tp`` the gradients of the layers that route this rank's tokens (:class:`RoutedOnLocalTokens`), in
    buckets per dtype as the data-parallel average is (``buckets.all_reduce_in_buckets``). Every rank of a
    tensor-parallel group holds the same of them (the same data-parallel coordinate owns the same ZeRO partition),
    so they reduce alike."""
    grads = [local_part(p.grad) for layer in routed_on_local_tokens(module) for p in layer.parameters()
             if p.grad is not None]
    all_reduce_in_buckets(grads, mesh.group("tp"), bucket_cap_mb=bucket_cap_mb)


class Replicated(ParallelStyle):
    """A module outside the split regions whose output meets sequence-split DTensors (a learned position
    embedding added to the embedding's output): its parameters and inputs become ``Replicate`` DTensors, and so
    does its output, which DTensor then adds to the split activations correctly."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated(m: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                         if isinstance(x, Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        return distribute_module(
            module, device_mesh,
            lambda _, m, mesh: _distribute(m, mesh, {n: Replicate() for n, _ in m.named_parameters(recurse=False)}),
            replicated)


def tensor_parallel_styles(module: nn.Module, model_map: ModelMap, *, sequence_parallel: bool = False,
                           vocab_parallel_logits: bool = False) -> dict[str, ParallelStyle]:
    """The DTensor style of every module the model map splits (see :data:`~lightning_par.parallel.model_map.STYLES`).

    With ``sequence_parallel`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models") the activations between the tensor-parallel regions stay split along the
    sequence: norms run on 1/tp of the tokens, each region starts with an all-gather of the sequence and
    ends with a reduce-scatter, in place of the one all-reduce (same bytes, 1/tp of the activation memory);
    modules outside the blocks that hold parameters and meet those activations compute on replicated DTensors.
    With ``vocab_parallel_logits`` the head returns its logits as a DTensor split over the vocabulary, for
    :func:`vocab_parallel_loss`.
    """
    # Activations between the regions: whole tensors, or under sequence parallel DTensors split along the
    # sequence. DTensors, not their local pieces, so that code between the blocks (residual adds, rotary
    # tables built from the hidden states' length, as in Hugging Face models) sees the global shape.
    between = Shard(1) if sequence_parallel else Replicate()
    styles: dict[str, ParallelStyle] = {}
    # Under sequence parallel a mixture-of-experts layer routes this rank's tokens (RoutedOnLocalTokens), whole.
    local_layers = set(moe_layers(module, model_map)) if sequence_parallel else set()
    regions = split_regions(module, model_map, sequence_parallel=sequence_parallel)  # laid out after the loop
    blocks = model_map.blocks + "."
    for name, sub in module.named_modules():
        style = model_map.style_of(name)
        if any(name.startswith(layer + ".") for layer in local_layers):
            continue
        if style == "vocab" and isinstance(sub, nn.Embedding):
            # Rows are the vocabulary: each rank embeds the tokens it holds; the partial sums are reduced.
            styles[name] = VocabParallel(input_layouts=Replicate(), output_layouts=between,
                                         use_local_output=not sequence_parallel)
        elif style in ("colwise", "colwise_gather") and is_projection(sub) and name == model_map.head:
            # The vocabulary-sharded logits are gathered so that any loss function sees them whole, unless the
            # loss runs on the shards (loss parallel).
            styles[name] = (Colwise(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
                            if vocab_parallel_logits else Colwise(input_layouts=between, output_layouts=Replicate()))
        elif style in SPLIT_STYLES and is_projection(sub):
            continue  # in ``regions``
        elif style == "sequence" and sequence_parallel:
            styles[name] = SequenceParallel()
        elif name in local_layers:
            styles[name] = RoutedOnLocalTokens()
        elif style == "per_shard":
            styles[name] = PerShard()
        elif style == "shared_rope_key":
            styles[name] = SharedRopeKey(_rope_features(module, name))
        elif (sequence_parallel and style in (None, "replicate") and not name.startswith(blocks)
              and name != model_map.blocks and next(sub.parameters(recurse=False), None) is not None):
            styles[name] = Replicated()
    for parent, layers in regions.items():
        once = _takes_input_once(module, parent, model_map)
        for name, style in layers:
            if style in ("colwise", "colwise_gather"):
                # Split heads stay local; a gathered output is whole (for code that slices it by global sizes).
                styles[name] = Colwise(input_layouts=Replicate() if once else between,
                                       output_layouts=Shard(-1) if style == "colwise" else Replicate())
            else:
                # A row-wise layer after a gathered output takes its input whole and keeps its own slice.
                styles[name] = Rowwise(input_layouts=Shard(-1) if style == "rowwise" else Replicate(),
                                       output_layouts=between, use_local_output=not sequence_parallel)
        if once:
            # The module owning the projections (attention, MLP) hands all of them one replicated input: one
            # all-gather of the sequence under sequence parallel, and in backward their input gradients are
            # summed before one all-reduce (or reduce-scatter), not one per projection (Megatron's f operator).
            styles[parent] = PrepareFirstInput(between, Replicate())
    return styles


def split_regions(module: nn.Module, model_map: ModelMap, *,
                  sequence_parallel: bool = False) -> dict[str, list[tuple[str, str]]]:
    """The modules holding the projections tensor parallel splits inside the network, each with its projections and
    their styles in order (``{"layers.0.mlp": [("layers.0.mlp.up", "colwise"), ("layers.0.mlp.down", "rowwise")]}``):
    between a ``colwise`` layer's output and its ``rowwise`` partner each rank holds its own part of the activations.
    The head is not one (its logits are gathered or split over the vocabulary), nor, under sequence parallel, a
    mixture-of-experts layer routing this rank's tokens whole (:class:`RoutedOnLocalTokens`)."""
    local_layers = set(moe_layers(module, model_map)) if sequence_parallel else set()
    regions: dict[str, list[tuple[str, str]]] = {}
    for name, sub in module.named_modules():
        style = model_map.style_of(name)
        if (style not in SPLIT_STYLES or not is_projection(sub)
                or any(name.startswith(layer + ".") for layer in local_layers)
                or (name == model_map.head and style in ("colwise", "colwise_gather"))):
            continue
        regions.setdefault(name.rpartition(".")[0], []).append((name, style))
    return regions


def _takes_input_once(module: nn.Module, parent: str, model_map: ModelMap) -> bool:
    """Whether the split layers' module can receive its input as one replicated DTensor: it is not a block (whose
    norms and residual need the plain activations) and every parameter in it belongs to a split layer or to a
    ``per_shard`` module, so nothing else in it meets that DTensor."""
    if not parent or parent == model_map.blocks or parent.rpartition(".")[0] == model_map.blocks:
        return False
    for name, sub in module.get_submodule(parent).named_modules():
        if next(sub.parameters(recurse=False), None) is None:
            continue
        style = model_map.style_of(f"{parent}.{name}" if name else parent)
        if not (style == "per_shard" or (style in SPLIT_STYLES and is_projection(sub))):
            return False
    return True


def check_tensor_parallel(module: nn.Module, model_map: ModelMap | None, tp: int) -> None:
    """Raise ``ValueError`` when ``module`` cannot be split ``tp`` ways, naming the size and what fits."""
    if tp == 1:
        return
    named_tp = f"tp={tp!r}"
    if model_map is None:
        raise ValueError(
            f"{named_tp} needs to know which layers to split, and no model map was found ({why_no_blocks(module)}): "
            "give the strategy a model map (model_map: {blocks: ..., styles: {...}}) or use a standard decoder layout "
            "(see docs/models.md)"
        )
    for name, sub in module.named_modules():
        style = model_map.style_of(name)
        if style not in (*SPLIT_STYLES, "vocab"):
            continue
        inside = [n for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention) and
                  name.startswith(n + ".")]
        if inside and style in SPLIT_STYLES:
            raise ValueError(f"tensor parallel cannot split {name!r} ({style}): it belongs to nn.MultiheadAttention "
                             f"{inside[0]!r}, which computes with its projections' weights directly "
                             "(F.multi_head_attention_forward); leave it whole (style 'replicate'), or write the "
                             "attention with nn.Linear q/k/v/out projections")
        if isinstance(sub, nn.Embedding):
            size, what = sub.num_embeddings, "vocabulary size"
        elif is_projection(sub):
            features_in, features_out = projection_features(sub)
            size, what = ((features_out, "output features") if style.startswith("colwise")
                          else (features_in, "input features"))
        else:
            continue
        parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        head_dim = getattr(parent, "head_dim", None)
        if style in ("colwise", "rowwise") and isinstance(head_dim, int) and size % head_dim == 0:
            # Attention projections must split into whole heads, not just into equal slices.
            size, what = size // head_dim, "heads"
        if size % tp != 0:
            fits = [d for d in divisors(size) if d <= 64]
            raise ValueError(f"{named_tp} does not divide the {size} {what} of {name!r}; tensor-parallel sizes that "
                             f"fit this layer: {fits}")


def apply_tensor_parallel(module: nn.Module, mesh: ParallelMesh, model_map: ModelMap | None, *,
                          sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    """Split the layers of ``module`` that ``model_map`` marks over the ``tp`` dimension of ``mesh`` (in place).

    Under ``sequence_parallel`` the sequence length of every batch must be divisible by ``tp``. Under
    ``loss_parallel`` the head's logits stay split over the vocabulary: run the loss inside
    :func:`vocab_parallel_loss`.
    """
    tp = mesh.size("tp")
    if tp == 1:
        return module
    check_tensor_parallel(module, model_map, tp)
    assert model_map is not None
    styles = tensor_parallel_styles(module, model_map, sequence_parallel=sequence_parallel,
                                    vocab_parallel_logits=loss_parallel)
    _split_heads_per_rank(module, model_map, tp)
    ties = tied_groups(module)
    parallelize_module(module, mesh["tp"], styles)
    # parallelize_module gives each module its own DTensors: a head tied to the embedding would become a copy.
    retie(module, ties)
    for name, sub in module.named_modules():
        if (model_map.style_of(name) == "vocab" and isinstance(sub, nn.Embedding) and isinstance(sub.weight, DTensor)
                and not isinstance(sub, VocabParallelEmbedding)):  # which computes its own rows' gradient only
            sub.register_forward_pre_hook(_GradientKeepsPlacements())
    if sequence_parallel and model_map.embedding is not None:
        # Before the embedding's collective, on every rank alike: a sequence that does not split would
        # otherwise fail deep inside DTensor with shapes that do not mention the cause.
        module.get_submodule(model_map.embedding).register_forward_pre_hook(_SequenceLengthCheck(tp))
    return module


def _split_heads_per_rank(module: nn.Module, model_map: ModelMap, tp: int) -> None:
    """Fused projections regrouped so that each rank's rows hold its part of every section
    (:mod:`~lightning_par.parallel.regroup`), and head counts set to each rank's
    (:mod:`~lightning_par.parallel.local_heads`), where the model map says so."""
    for name, sub in module.named_modules():
        sections = model_map.sections_of(name)
        if sections is None:
            continue
        if not is_projection(sub) or model_map.style_of(name) != "colwise":
            raise ValueError(f"the model map gives {name!r} sections {list(sections)}, which only a fused linear "
                             f"projection split colwise has (it is a {type(sub).__name__}, style "
                             f"{model_map.style_of(name)!r})")
        held = dict(sub.named_parameters())
        dims = {parameter: placement.dim for parameter, placement in _split_placements(sub, colwise=True).items()
                if isinstance(placement, Shard) and parameter in held}
        regroup_rows(sub, sections, tp, dims)
    localize_head_counts([sub for name, sub in module.named_modules() if model_map.has_local_heads(name)], tp)


def split_summary(module: nn.Module, model_map: ModelMap) -> str:
    """How many parameter tensors each style split, e.g. ``colwise 8, rowwise 4, vocab 1``."""
    counts: dict[str, int] = {}
    for name, sub in module.named_modules():
        style = model_map.style_of(name)
        tensors = [p for p in sub.parameters(recurse=False) if isinstance(p, DTensor)]
        if style is not None and tensors:
            counts[style] = counts.get(style, 0) + len(tensors)
    return ", ".join(f"{style} {count}" for style, count in sorted(counts.items())) or "nothing"


class _GradientKeepsPlacements:
    """Gives the gradient of a vocabulary-split embedding that keeps DTensor's lookup the weight's own placements.

    DTensor's embedding backward returns the gradient of a vocabulary-sharded table replicated: the whole (V, h)
    table on every tensor-parallel rank (torch 2.13). Re-sharding it right away copies this rank's rows, and the
    accumulated gradient (and what the optimizer reads) is then 1/tp of it, like the weight. The gradient hook is
    put on the weight the embedding holds when it runs (a forward pre-hook), once per weight: a model built on the
    meta device gets new parameter objects when it is allocated after the split, which would not carry a hook put
    on the weight at the split (the whole table would then stay held as the gradient, (tp-1)/tp of it wasted).
    """

    def __call__(self, module: nn.Module, args: tuple) -> None:
        weight = module.weight
        if (isinstance(weight, DTensor) and weight.requires_grad  # a frozen embedding has no gradient to lay out
                and not getattr(weight, "_gradient_keeps_placements", False)):
            weight.register_hook(functools.partial(_with_placements, placements=tuple(weight.placements)))
            weight._gradient_keeps_placements = True


def _with_placements(grad: Tensor, *, placements: tuple[Placement, ...]) -> Tensor:
    if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
        return grad.redistribute(grad.device_mesh, placements)
    return grad


class _SequenceLengthCheck:
    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: tuple) -> None:
        seq_len = args[0].shape[1]
        if seq_len % self.tp != 0:
            raise ValueError(f"sequence parallel splits the sequence over tp={self.tp!r} "
                             f"ranks, but a batch has {seq_len} tokens; use a sequence length divisible by {self.tp}")


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


__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "routed_on_local_tokens", "split_regions", "split_summary",
           "sum_over_tensor_parallel", "tensor_parallel_styles", "vocab_parallel_loss"]
