"""Values one block hands to later blocks beside the hidden states, read from the traced forward (pipeline parallel).

A network's loop may give a later block more than the hidden states of the block before it, through two channels:

- an **item** of a block's output: the block returns a value beside the hidden states and the loop hands it to the
  next blocks. T5's relative position bias is one (Raffel et al. 2020, "Exploring the Limits of Transfer Learning
  with a Unified Text-to-Text Transformer"): block 0 computes it from its table, ``T5Stack`` passes
  ``layer_outputs[1]`` to block 1, which returns it again, and so on;
- an **entry** of a mapping every block receives, written by one block and read by later ones: cross-layer key/value
  sharing (Brandon et al. 2024, "Reducing Transformer Key-Value Cache Size with Cross-Layer Attention"), as Gemma 3n's
  ``shared_kv_states``, where the last layer of each kind stores its keys and values and later layers reuse them.

On one process both are plain Python. Between pipeline stages they are not: a later stage runs the loop with the
earlier blocks skipped, and would compute without the value (T5 then falls back to a zero bias: silently wrong) or
fail to find it (Gemma 3n: ``KeyError``). :func:`find_handoffs` reads both channels from the trace's record of every
block call: an item counts where a later block receives that very tensor, or one computed from it (the autograd
graph reaches it); an entry where a block wrote it (the mapping's tensors changed across the block's call) and a
later block receives the mapping. :meth:`Handoffs.crossing` names what a stage starting at a block must receive,
which ``lightning_par.parallel.pipeline.carry`` sends with the hidden states. What cannot cross (a list a block
appends to, an entry that holds no tensor) is kept in ``uncarried``: a split whose stage starts between its writer
and its readers is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass(frozen=True, order=True)
class Item:
    """Item ``index`` of block ``block``'s output (its position in the tuple the block returns)."""

    block: int
    index: int


@dataclass(frozen=True)
class Entry:
    """Key ``key`` of the mapping that blocks receive at ``location`` (an argument's position or keyword): a tensor
    (``length`` 0), or a tuple or list (``sequence``) of ``length`` tensors. ``name`` says it in messages."""

    location: int | str
    key: Any
    length: int
    name: str
    sequence: str = "tuple"


@dataclass(frozen=True)
class EntryPart:
    """Tensor ``element`` of an entry (0 for a tensor entry): what crosses a stage boundary, one tensor each."""

    entry: Entry
    element: int


Carried = Item | EntryPart


@dataclass(frozen=True)
class Uncarried:
    """A value handed from block ``writer`` to blocks up to ``last_reader`` that cannot cross a stage boundary."""

    writer: int
    last_reader: int
    reason: str


@dataclass(frozen=True)
class Handoffs:
    """What the blocks of a traced forward hand each other (see the module docstring), block indices from 0.

    ``items``: item -> the blocks that receive it; ``entries``: entry -> (the first block that writes it, the blocks
    after it that receive the mapping). ``traced``: the blocks the trace ran, fewer than the model's where the model
    was built on the meta device and a copy of its first blocks was traced; ``chain``: the output indices a block
    hands to the very next block (T5's bias), assumed of every block after the traced ones."""

    traced: int = 0
    items: dict[Item, frozenset[int]] = field(default_factory=dict)
    entries: dict[Entry, tuple[int, frozenset[int]]] = field(default_factory=dict)
    chain: frozenset[int] = frozenset()
    uncarried: tuple[Uncarried, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.items or self.entries or self.uncarried)

    def crossing(self, start: int, n_blocks: int) -> tuple[Carried, ...]:
        """The values a stage whose first block is ``start`` receives from the stage before it (of ``n_blocks``):
        items of earlier blocks a block from ``start`` on receives, then the tensors of entries written before
        ``start`` into a mapping a block from ``start`` on receives. Beyond the traced blocks, the last traced block
        stands for the rest: what it receives, they receive, and the chained items of the block before ``start``
        cross (``lightning_par.parallel.pipeline.carry`` checks that the values are there when it sends them)."""
        untraced = n_blocks > self.traced
        last = self.traced - 1

        def read_from(readers: frozenset[int], chained: bool = False) -> bool:
            return any(r >= start for r in readers) or (untraced and last in readers and not chained)

        # An item the last traced block receives as the next block of a chain stands for the chain, not for itself.
        items = {item for item, readers in self.items.items() if item.block < start
                 and read_from(readers, chained=item.block == last - 1 and item.index in self.chain)}
        if untraced and start - 1 >= last:
            items |= {Item(start - 1, index) for index in self.chain}
        parts = [EntryPart(entry, element) for entry, (writer, readers) in self.entries.items()
                 if writer < start and read_from(readers) for element in range(max(entry.length, 1))]
        return (*sorted(items), *parts)

    def exact(self, n_blocks: int) -> bool:
        """Whether every block was traced (else :meth:`crossing` extrapolates from the last traced block)."""
        return self.traced >= n_blocks

    def check_split(self, starts: Iterable[int], block_names: list[str]) -> None:
        """Refuse stages starting between the writer and a reader of a value that cannot cross, naming it and the
        blocks a stage may start at instead."""
        starts = set(starts)
        for value in self.uncarried:
            cut = sorted(s for s in starts if value.writer < s <= value.last_reader)
            if cut:
                allowed = [block_names[i] for i in range(1, len(block_names))
                           if not any(v.writer < i <= v.last_reader for v in self.uncarried)]
                keep = (f"Keep them on one stage with the map's split_points (any of {allowed[:8]}"
                        f"{' ...' if len(allowed) > 8 else ''}), or hand" if allowed else "Hand")
                raise ValueError(f"pipeline parallel: {value.reason}; a stage would start at {block_names[cut[0]]!r}, "
                                 f"between them, and run without it. {keep} the value on as a tensor the block "
                                 "returns or in a dict the blocks share, which cross stage boundaries, or train this "
                                 "model without pipeline parallel")


# ------------------------------------------------------------------------------------------------ the trace's side
def snapshot(arguments: dict[int | str, Any]) -> dict[int | str, tuple[Any, dict[Any, Any]]]:
    """The mappings and lists among a block call's ``arguments`` (location -> value), each with the identities of
    what it holds, to compare after the call."""
    return {location: (value, _identities(value)) for location, value in arguments.items()
            if isinstance(value, (MutableMapping, MutableSequence))}


def written(before: dict[int | str, tuple[Any, dict[Any, Any]]]) -> dict[tuple[int | str, Any], Any]:
    """(location, key) -> value of what a block call changed in the mappings and lists of :func:`snapshot`."""
    changes = {}
    for location, (container, identities) in before.items():
        now = _identities(container)
        for key, identity in now.items():
            if identities.get(key) != identity:
                changes[(location, key)] = container[key]
    return changes


def _identities(container: Any) -> dict[Any, Any]:
    pairs = container.items() if isinstance(container, MutableMapping) else enumerate(container)
    return {key: _identity(value) for key, value in pairs}


def _identity(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(id(v) for v in value)
    return id(value)


def _tensors_of(value: Any) -> list[Tensor] | None:
    """The tensors of an entry's value: a tensor, or a flat tuple or list of them; None for anything else."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return list(value)
    return None


@dataclass
class BlockCall:
    """What the trace kept of one block call: its arguments by location (hidden states left out), what its output
    holds beside the hidden states (index -> tensor), and what it wrote into the mappings and lists it received."""

    arguments: dict[int | str, Any]
    names: dict[int | str, str]  # location -> the parameter's name, for messages
    items: dict[int, Tensor]
    writes: dict[tuple[int | str, Any], Any]


def find_handoffs(calls: list[BlockCall], block_names: list[str], tensors_in: Callable[[Any], Iterable[Tensor]]
                  ) -> tuple[Handoffs, list[list[Tensor]], list[set[Any]]]:
    """The values the traced blocks hand each other (:class:`Handoffs`); and, per block, the tensors among its
    arguments besides the hidden states that are not handed values (``tensors_in(argument)`` finds them) with the
    autograd nodes of the handed values it may receive. The trace's check of what a block argument is computed from
    looks at the first and stops at the second: a handed value is carried, whatever it was computed from."""
    readers_of: dict[int, set[int]] = {}  # id of a mapping or list some block writes into -> the blocks receiving it
    for call in calls:
        for location, _ in call.writes:
            readers_of.setdefault(id(call.arguments[location]), set())
    for index, call in enumerate(calls):
        for value in call.arguments.values():
            if id(value) in readers_of:
                readers_of[id(value)].add(index)

    entries: dict[Entry, tuple[int, frozenset[int]]] = {}
    written_tensors: list[tuple[int, Entry, list[Tensor]]] = []
    uncarried: list[Uncarried] = []
    for writer, call in enumerate(calls):
        for (location, key), value in call.writes.items():
            container = call.arguments[location]
            readers = frozenset(r for r in readers_of[id(container)] if r > writer)
            if not readers:
                continue
            name = f"{call.names.get(location, location)}[{key!r}]"
            tensors = _tensors_of(value)
            if not isinstance(container, MutableMapping) or tensors is None:
                what = ("into a list the blocks share: a stage boundary carries the entries of a dict they share, "
                        "not of a list" if not isinstance(container, MutableMapping) else
                        f"as a {type(value).__name__}: a stage boundary carries tensors and tuples of tensors")
                uncarried.append(Uncarried(writer, max(readers), f"block {block_names[writer]!r} writes {name} "
                                           f"{what}, and block {block_names[max(readers)]!r} receives it"))
                continue
            entry = Entry(location, key, 0 if isinstance(value, Tensor) else len(tensors), name,
                          "list" if isinstance(value, list) else "tuple")
            first, earlier = entries.get(entry, (writer, frozenset()))
            entries[entry] = (min(first, writer), earlier | readers)
            written_tensors.append((writer, entry, tensors))

    items: dict[Item, set[int]] = {}
    sides: list[list[Tensor]] = []
    stops: list[set[Any]] = []
    for index, call in enumerate(calls):
        # What this block may receive handed on: the items of earlier blocks (of a tensor several blocks returned,
        # the latest block's: the loop read it from that block's output) and the tensors of earlier entries (which
        # the loop may read out of the mapping for it).
        handed: dict[int, Item | Entry] = {}
        by_node: dict[Any, Item | Entry] = {}
        sources = [(Item(block, position), tensor) for block in range(index)
                   for position, tensor in calls[block].items.items()]
        sources += [(entry, tensor) for writer, entry, tensors in written_tensors if writer < index
                    for tensor in tensors]
        for source, tensor in sources:
            handed[id(tensor)] = source
            if tensor.grad_fn is not None:
                by_node[tensor.grad_fn] = source
        side = []
        arguments = [value for value in call.arguments.values() if id(value) not in readers_of]
        for tensor in (t for value in arguments for t in tensors_in(value)):
            received = ([handed[id(tensor)]] if id(tensor) in handed
                        else [by_node[node] for node in _reached(tensor, by_node)])
            for source in received:
                if isinstance(source, Item):
                    items.setdefault(source, set()).add(index)
                else:
                    writer, readers = entries[source]
                    entries[source] = (writer, readers | {index})
            if id(tensor) not in handed:
                side.append(tensor)
        sides.append(side)
        stops.append(set(by_node))
    chain = frozenset(item.index for item, readers in items.items() if item.block + 1 in readers)
    handoffs = Handoffs(len(calls), {item: frozenset(readers) for item, readers in items.items()}, entries, chain,
                        tuple(uncarried))
    return handoffs, sides, stops


def _reached(tensor: Tensor, targets: dict[Any, Any]) -> set[Any]:
    """The nodes among ``targets`` the autograd graph of ``tensor`` reaches (not walking past them)."""
    found: set[Any] = set()
    stack = [tensor.grad_fn] if tensor.grad_fn is not None else []
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in targets:
            found.add(node)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found


__all__ = ["BlockCall", "Carried", "Entry", "EntryPart", "Handoffs", "Item", "Uncarried", "find_handoffs",
           "snapshot", "written"]
