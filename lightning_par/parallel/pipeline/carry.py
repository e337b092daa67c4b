"""Carrying the values blocks hand each other across pipeline stage boundaries, with the hidden states.

``lightning_par.parallel.pipeline.handoffs`` finds, in the traced forward, what a stage must receive beside the hidden
states: items of earlier blocks' outputs (T5's position bias) and entries of a mapping the blocks share (Gemma 3n's
keys and values). A stage sends them as further tensors of its output, which ``torch.distributed.pipelining`` sends
like the hidden states (each a tensor of its own, its gradient sent back in backward), and the next stage receives
them as further inputs. There the network's own loop runs as on one process, with the earlier blocks skipped:

- a skipped block returns, beside the hidden states, the items received for it, so the loop hands them on exactly as
  it would have handed the real block's (``position_bias = layer_outputs[1]``);
- the first block call that receives a shared mapping, skipped or not, finds the received entries written into it,
  so every later read (``shared_kv_states["sliding_attention"]``) sees them.

At the end of a stage, the :class:`Carrier` collects what the next stage needs: items its blocks returned or that it
received and handed on, entries as they now stand in the mapping. Every block's output, skipped or not, and the
gradients of the values sent are the ones one process computes, so the stages train like it (Megatron-LM's
pipeline sends one tensor; this generalises it to what the network's loop hands on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_par.parallel.pipeline.handoffs import Carried, Entry, EntryPart, Item

# The carrier of the stage whose forward is running: skipped blocks are shared by the stages of one rank, and ask it.
_ACTIVE: ContextVar["Carrier | None"] = ContextVar("pipeline_carrier", default=None)


def active() -> "Carrier | None":
    """The carrier of the stage running now (None outside a stage's forward, or where nothing is carried)."""
    return _ACTIVE.get()


class Carrier:
    """The handed values of one pipeline stage during one forward: ``incoming`` received from the stage before, in
    that order after the hidden states; ``outgoing`` sent to the stage after. ``block_names`` name blocks in messages;
    ``exact``: whether the trace ran every block (else what crosses was extrapolated from the last traced block, and
    the values are checked as they are sent)."""

    def __init__(self, incoming: tuple[Carried, ...], outgoing: tuple[Carried, ...], block_names: list[str], *,
                 exact: bool = True) -> None:
        self.incoming, self.outgoing = incoming, outgoing
        self.block_names, self.exact = block_names, exact
        self.locations = {part.entry.location for part in (*incoming, *outgoing) if isinstance(part, EntryPart)}
        self._received: dict[Carried, Tensor] = {}
        self._returned: dict[Item, Any] = {}
        self._mappings: dict[int | str, MutableMapping] = {}

    @contextlib.contextmanager
    def running(self, received: tuple[Tensor, ...]) -> Iterator[None]:
        """The stage's forward, with ``received`` (after the hidden states) as the values of ``incoming``."""
        if len(received) != len(self.incoming):
            raise ValueError(f"a pipeline stage received {len(received)} values beside the hidden states, and expects "
                             f"{len(self.incoming)}")
        self._received = {part: _contiguous_gradient(value) for part, value in zip(self.incoming, received)}
        self._returned, self._mappings = {}, {}
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            self._received, self._returned, self._mappings = {}, {}, {}

    # ------------------------------------------------------------------------------------------ during the forward
    def item(self, block: int, index: int) -> Tensor | None:
        """What a skipped ``block`` returns at ``index`` beside the hidden states: the value received for it."""
        return self._received.get(Item(block, index))

    def block_called(self, args: tuple, kwargs: dict) -> None:
        """A block (skipped or run) is called: a shared mapping seen for the first time in this forward gets the
        entries received for it, before anything reads it."""
        for location in self.locations:
            mapping = args[location] if isinstance(location, int) and location < len(args) else kwargs.get(location)
            if not isinstance(mapping, MutableMapping) or location in self._mappings:
                continue
            self._mappings[location] = mapping
            for entry, tensors in _entries(self._received, location).items():
                mapping[entry.key] = tensors[0] if entry.length == 0 else _sequence(entry, tensors)

    def block_returned(self, block: int, output: Any) -> None:
        """A block of this stage returned ``output``: keep the items the next stage needs."""
        for part in self.outgoing:
            if isinstance(part, Item) and part.block == block:
                items = output.to_tuple() if hasattr(output, "to_tuple") else output
                self._returned[part] = items[part.index] if isinstance(items, (tuple, list)) and \
                    part.index < len(items) else None

    # ------------------------------------------------------------------------------------------ at the end
    def collect(self) -> tuple[Tensor, ...]:
        """The values of ``outgoing``, after the stage's last block."""
        values = []
        received = {id(t) for t in self._received.values()}
        for part in self.outgoing:
            value = self._value(part)
            if isinstance(value, DTensor):
                raise ValueError(f"pipeline parallel: {self._describe(part)} is a DTensor (split by tensor parallel); "
                                 "a pipeline stage sends plain tensors beside the hidden states. Train this model "
                                 "with pp or tp alone")
            # A value handed on unchanged is the tensor received: send a copy (the schedule detaches what a stage
            # returns, which would cut the gradient of what the stage's own blocks did with it); likewise a view
            # (detached in place by the zero-bubble schedules, which PyTorch refuses on views). Sends take
            # contiguous tensors (a bias permuted to heads first, keys transposed are not).
            if not value.is_contiguous():
                value = value.contiguous()
            elif id(value) in received or value._base is not None:
                value = value.clone()
            values.append(value)
        if not self.exact:
            self._check_nothing_else_written()
        return tuple(values)

    def _value(self, part: Carried) -> Tensor:
        if isinstance(part, Item):
            value = self._returned[part] if part in self._returned else self._received.get(part)
            if not isinstance(value, Tensor):
                raise ValueError(f"pipeline parallel: block {self.block_names[part.block]!r} returned "
                                 f"{type(value).__name__} as item {part.index} of its output, where the set-up's trace "
                                 "found a tensor the next blocks receive; a later stage would run without it")
            return value
        mapping = self._mappings.get(part.entry.location)
        if mapping is not None and part.entry.key in mapping:
            value = mapping[part.entry.key]
            value = value if part.entry.length == 0 else value[part.element]
        else:
            value = self._received.get(part)
        if not isinstance(value, Tensor):
            raise ValueError(f"pipeline parallel: {part.entry.name} is not in the dict the blocks share at the end of "
                             "a pipeline stage, where the set-up's trace found it written before and read after; a "
                             "later stage would run without it")
        return value

    def _check_nothing_else_written(self) -> None:
        """Where the trace ran only the first blocks, refuse a mapping holding an entry that does not cross."""
        carried = {(part.entry.location, part.entry.key) for part in self.outgoing if isinstance(part, EntryPart)}
        for location, mapping in self._mappings.items():
            unknown = [key for key in mapping if (location, key) not in carried]
            if unknown:
                raise ValueError(f"pipeline parallel: the dict the blocks share ({location}) holds {unknown[0]!r}, "
                                 "which the set-up's trace of the model's first blocks (built on the meta device) did "
                                 "not see written: a later stage would run without it. Build the model with its "
                                 "weights (not on the meta device), or choose split_points before the blocks that "
                                 "write it")

    def _describe(self, part: Carried) -> str:
        if isinstance(part, Item):
            return f"item {part.index} of block {self.block_names[part.block]!r}'s output"
        return part.entry.name


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient of a received value goes back to the stage
    before through a send, which takes contiguous tensors only (a key used transposed gets a transposed gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _contiguous_gradient(value: Tensor) -> Tensor:
    return _ContiguousGradient.apply(value) if value.requires_grad else value


def _entries(received: dict[Carried, Tensor], location: int | str) -> dict[Entry, list[Tensor]]:
    entries: dict[Entry, list[Tensor]] = {}
    for part, tensor in received.items():
        if isinstance(part, EntryPart) and part.entry.location == location:
            entries.setdefault(part.entry, []).append(tensor)
    return entries


def _sequence(entry: Entry, tensors: list[Tensor]) -> tuple | list:
    return list(tensors) if entry.sequence == "list" else tuple(tensors)


def skipped_output(carrier: Carrier | None, block: int, hidden: Any, hidden_index: int, length: int) -> tuple:
    """What a skipped block returns: its hidden-state input at ``hidden_index``, the received items elsewhere (None
    where nothing crosses)."""
    return tuple(hidden if i == hidden_index else (carrier.item(block, i) if carrier is not None else None)
                 for i in range(length))


__all__ = ["Carrier", "active", "skipped_output"]
