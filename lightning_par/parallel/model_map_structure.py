"""Tensor-parallel pairs found from what a block computes, for blocks whose layers carry no name the model map knows.

Megatron-LM's split (Shoeybi et al. 2019) pairs, inside each sub-layer of a transformer block, the projections
that *read* the residual stream (split by output features: q/k/v, gate/up) with the one projection that *writes*
back to it (split by input features: o, down); whatever runs between them (attention over heads, an activation)
then runs on each rank's share. Those roles are facts of the computation, not of the names, so they are read off
one forward pass of a small copy of the model (``lightning_par.parallel.small_copy``), with every tensor tagged by
where it comes from (a ``TorchFunctionMode``):

* the block's first input is the *residual stream*; a sum with the stream as one operand writes to the stream;
* a *reader* is a projection whose input is computed from the stream without passing through another projection
  that read the stream (a norm, a modulation by a conditioning input as DiT's adaLN-Zero does, are fine);
* a *writer* is a projection whose output reaches a sum into the stream without passing through another
  projection, returns to the stream's width, and has readers upstream since the stream was last written: those
  readers are its column-wise partners.

A projection that is neither (a router, a low-rank down-projection between the pair, a conditioning MLP) stays
whole. The pairs are candidates only: ``lightning_par.parallel.model_map_check`` then runs them against the whole
model and gathers or leaves whole any pair that does not compute the same (a fused q/k/v the model slices by global
sizes, as litgpt and timm do, is gathered), so a wrong guess costs a fallback, never a wrong model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_par.parallel.adapters import base_layer, outside_adapters
from lightning_par.parallel.model_map import ModelMap, is_projection

# The calls through which a projection's weight computes its output (nn.Linear: F.linear; GPT-2's Conv1D: addmm).
_PROJECTION_CALLS = {F.linear, torch.addmm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_SUMS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add_,
         torch.Tensor.__iadd__}


@dataclass(frozen=True)
class _Origin:
    """Where a tensor inside a block comes from."""

    stream: bool = False  # the residual stream itself: the block's input, or a sum into it
    from_stream: bool = False  # computed from the stream
    direct: frozenset[str] = frozenset()  # projections whose outputs reach it through no other projection
    readers: frozenset[str] = frozenset()  # readers upstream of it since the stream was last written


@dataclass
class _Trace(TorchFunctionMode):
    """Tags the tensors of one block's forward with their :class:`_Origin` and records the pairs."""

    weights: dict[int, str]  # id(weight) of the block's projections -> name relative to the block
    width: int = 0  # the stream's features
    origins: dict[int, tuple[Tensor, _Origin]] = field(default_factory=dict)
    readers: set[str] = field(default_factory=set)
    stream_projections: set[str] = field(default_factory=set)
    writer_inputs: dict[str, frozenset[str]] = field(default_factory=dict)  # projection -> readers upstream
    out_features: dict[str, int] = field(default_factory=dict)
    writers: dict[str, frozenset[str]] = field(default_factory=dict)
    entered: bool = False

    def __post_init__(self) -> None:
        super().__init__()

    def mark_stream(self, tensor: Tensor) -> None:
        self.origins = {id(tensor): (tensor, _Origin(stream=True, from_stream=True))}
        self.width = tensor.shape[-1]

    def origin(self, value: Any) -> _Origin | None:
        entry = self.origins.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        inputs = [v for v in tree_leaves((args, kwargs)) if isinstance(v, Tensor)]
        tagged = [(v, o) for v in inputs if (o := self.origin(v)) is not None]
        if not tagged:
            return output
        projection = (next((self.weights[id(v)] for v in inputs if id(v) in self.weights), None)
                      if func in _PROJECTION_CALLS else None)
        if projection is not None:
            origin = self._project(projection, _merge([o for _, o in tagged]), output)
        elif func in _SUMS and len(tagged) == 2 and any(o.stream for _, o in tagged):
            for _, other in tagged:  # what the other operand's projections wrote into the stream
                for name in other.direct:
                    if name in self.stream_projections and self.writer_inputs.get(name):
                        self.writers.setdefault(name, self.writer_inputs[name])
            origin = _Origin(stream=True, from_stream=True)
        else:
            origin = _merge([o for _, o in tagged])
            # A norm, a dropout, a cast of the stream alone is still the stream (its sum with a sub-layer's output
            # is a residual connection).
            single = len(tagged) == 1 and isinstance(output, Tensor) and output.shape == tagged[0][0].shape
            origin = _Origin(stream=origin.stream and single, from_stream=origin.from_stream, direct=origin.direct,
                             readers=origin.readers)
        for value in tree_leaves(output):
            if isinstance(value, Tensor):
                self.origins[id(value)] = (value, origin)
        return output

    def _project(self, name: str, source: _Origin, output: Any) -> _Origin:
        if name not in self.out_features and isinstance(output, Tensor):
            self.out_features[name] = output.shape[-1]
            if source.from_stream:
                self.stream_projections.add(name)
                if not source.direct & self.stream_projections:
                    self.readers.add(name)
                self.writer_inputs[name] = source.readers
        readers = source.readers | ({name} if name in self.readers else set())
        return _Origin(from_stream=source.from_stream, direct=frozenset({name}), readers=frozenset(readers))

    def pairs(self) -> dict[str, str]:
        """Styles (names relative to the block) of the reader/writer pairs found: each writer row-wise, its readers
        column-wise; a reader two writers share, and a writer that does not return to the stream's width, are left
        out."""
        styles: dict[str, str] = {}
        claimed: set[str] = set()
        for writer, readers in self.writers.items():
            readers = frozenset(r for r in readers if r != writer and r not in claimed)
            if writer in self.readers or not readers or self.out_features.get(writer) != self.width:
                continue
            claimed |= readers
            styles[writer] = "rowwise"
            styles.update({reader: "colwise" for reader in readers})
        return styles


def _merge(origins: list[_Origin]) -> _Origin:
    return _Origin(stream=any(o.stream for o in origins), from_stream=any(o.from_stream for o in origins),
                   direct=frozenset().union(*(o.direct for o in origins)),
                   readers=frozenset().union(*(o.readers for o in origins)))


def structural_styles(model_copy: nn.Module, model_map: ModelMap, run: Callable[[], Any]) -> dict[str, str]:
    """Styles (patterns over every block) of the column/row-wise pairs each kind of block of ``model_copy``
    computes, found while ``run()`` runs its forward once. Projections inside experts, inside
    ``nn.MultiheadAttention`` (whose input projection is a bare parameter) and those the model map already styles
    are not candidates."""
    blocks = model_copy.get_submodule(model_map.blocks)
    traces: list[tuple[str, _Trace]] = []
    handles = []
    for index, block in blocks.named_children():
        modules = outside_adapters(list(block.named_modules()))
        excluded = [n for n, m in modules if isinstance(m, nn.MultiheadAttention) or n.rpartition(".")[2] == "experts"]
        weights = {id(base_layer(m).weight): n for n, m in modules
                   if n and is_projection(m) and not any(n.startswith(e + ".") for e in excluded)
                   and model_map.style_of(f"{model_map.blocks}.{index}.{n}") is None}
        if not weights:
            continue
        trace = _Trace(weights)
        traces.append((index, trace))

        def enter(module: nn.Module, args: tuple, kwargs: dict, trace: _Trace = trace) -> None:
            first = next((v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)), None)
            if first is not None and first.is_floating_point():
                trace.mark_stream(first)
                trace.__enter__()
                trace.entered = True

        def leave(module: nn.Module, args: tuple, output: Any, trace: _Trace = trace) -> None:
            if trace.entered:
                trace.__exit__(None, None, None)
                trace.entered = False

        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
        for _, trace in traces:
            if trace.entered:
                trace.__exit__(None, None, None)
    styles: dict[str, str] = {}
    for _, trace in traces:
        styles.update({f"{model_map.blocks}.*.{name}": style for name, style in trace.pairs().items()})
    return styles


# ------------------------------------------------------------------------------------------- fused sections
_SPLITS = {torch.split, torch.Tensor.split, torch.Tensor.split_with_sizes}
_CHUNKS = {torch.chunk, torch.Tensor.chunk, torch.Tensor.tensor_split}
_RESHAPES = {torch.reshape, torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.unflatten}


class _Cuts(TorchFunctionMode):
    """Records how the model cuts the outputs of some projections along their features: the sizes of a ``split``,
    the number of a ``chunk``, the leading factor of a reshape into (sections, heads, head size), the bounds of
    slices ``[..., a:b]``."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[int, tuple[Tensor, str]] = {}
        self.found: dict[str, tuple[int, ...]] = {}
        self.bounds: dict[str, set[int]] = {}
        self.widths: dict[str, int] = {}

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        entry = self.outputs.get(id(args[0])) if args and isinstance(args[0], Tensor) else None
        if entry is not None and entry[0] is args[0] and entry[1] not in self.found:
            self._record(entry[1], func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, layer: str, func: Callable, args: tuple, kwargs: dict) -> None:
        tensor = args[0]
        width, last = tensor.shape[-1], tensor.dim() - 1
        if func in _SPLITS or func in _CHUNKS:
            how = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("chunks"))
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            if dim % tensor.dim() != last:
                return
            if func in _CHUNKS and isinstance(how, int) and width % how == 0:
                self.found[layer] = (width // how,) * how
            elif func in _SPLITS and isinstance(how, int) and width % how == 0:
                self.found[layer] = (how,) * (width // how)
            elif func in _SPLITS and isinstance(how, (list, tuple)) and sum(how) == width:
                self.found[layer] = tuple(int(n) for n in how)
        elif func in _RESHAPES:
            shape = _shape_argument(func, args, kwargs, tensor)
            factors = shape[last:] if shape is not None and list(shape[:last]) == list(tensor.shape[:last]) else ()
            if len(factors) >= 3 and math.prod(factors) == width and factors[0] > 1:
                self.found[layer] = (width // factors[0],) * factors[0]  # (q|k|v, heads, head size)
        elif func is torch.Tensor.__getitem__:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            cut = index[-1] if index and (index[0] is Ellipsis or len(index) == tensor.dim()) else None
            if isinstance(cut, slice) and cut.step in (None, 1):
                bounds = self.bounds.setdefault(layer, set())
                bounds.update(b % width if b < 0 else b for b in (cut.start, cut.stop) if isinstance(b, int))

    def sections(self) -> dict[str, tuple[int, ...]]:
        found = dict(self.found)
        for layer, bounds in self.bounds.items():
            width = self.widths[layer]
            edges = sorted({0, width, *(b for b in bounds if 0 < b < width)})
            if layer not in found and len(edges) > 2:
                found[layer] = tuple(b - a for a, b in zip(edges, edges[1:]))
        return found


def _shape_argument(func: Callable, args: tuple, kwargs: dict, tensor: Tensor) -> tuple[int, ...] | None:
    if func is torch.Tensor.unflatten:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        sizes = args[2] if len(args) > 2 else kwargs.get("sizes")
        if dim is None or sizes is None or dim % tensor.dim() != tensor.dim() - 1:
            return None
        shape = [*tensor.shape[:-1], *sizes]
    else:
        shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
        shape = shape or kwargs.get("shape") or kwargs.get("size")
        if not shape or not all(isinstance(n, int) for n in shape):
            return None
        shape = list(shape)
    if shape.count(-1) == 1:
        known = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = tensor.numel() // known if known else 0
    return tuple(shape)


def fused_sections(model_copy: nn.Module, layers: list[str], run: Callable[[], Any]) -> dict[str, tuple[int, ...]]:
    """Name -> section sizes of each of ``layers`` (projections of ``model_copy``) whose output the model cuts into
    several pieces along its features (a fused q/k/v or gate/up), found while ``run()`` runs the forward once."""
    cuts = _Cuts()
    handles = []
    for name in layers:
        def keep(module: nn.Module, args: tuple, output: Any, name: str = name) -> None:
            if isinstance(output, Tensor):
                cuts.outputs[id(output)] = (output, name)
                cuts.widths[name] = output.shape[-1]

        handles.append(model_copy.get_submodule(name).register_forward_hook(keep))
    try:
        with torch.no_grad(), cuts:
            run()
    finally:
        for handle in handles:
            handle.remove()
    return cuts.sections()


__all__ = ["fused_sections", "structural_styles"]
