"""What a network does outside its blocks, established from one traced forward (for pipeline parallel).

A pipeline stage runs the model's own forward with the blocks it does not own skipped. That is only right
if everything outside the blocks runs exactly once, on the right stage: the embedding, learned positions,
embedding scaling and dropout before the first block; the final norm under any name, the head and post-head
transforms such as soft-capping after the last block; and the tensors every block receives beside the hidden
states (rotary tables, masks, position ids) on every stage. Names cannot tell these apart; the autograd graph
of one forward can. :func:`trace_network` runs the network once on a sample (on the meta device when the
model was built there) and reads, from the graph:

- the *prelude*: parameters on the path from the inputs into the first block's hidden states (stage 0);
- the *postlude*: parameters between the last block's output and the network's output (the last stage);
- *shared*: parameters behind the blocks' other inputs (every stage that holds a block);
- where each block takes and returns its hidden states;
- parts of blocks the network runs again after its last block (a DiT's final modulation computed by block 0's
  timestep embedding): the last stage holds a copy of them;
- what blocks hand later blocks beside the hidden states, a tensor a block returns that the network passes on or an
  entry a block writes into a dict the blocks share (``lightning_par.parallel.pipeline.handoffs``): the stages carry
  it across their boundaries.

It refuses, naming the blocks or the argument, a network whose stages could not reproduce it: an output that
uses more than the last block's output, a block argument the network computes from the hidden states outside the
blocks, or a parameter outside the blocks that only a block registers. Code between two blocks is noted
(``changed``): a stage must not start after it (:func:`~lightning_par.parallel.pipeline.split.split_pipeline` refuses
such a split and names the split points that avoid it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.parallel.modules import clean_name, first_tensor
from lightning_par.parallel.pipeline.handoffs import BlockCall, Handoffs, find_handoffs, snapshot, written
from lightning_par.parallel.outside_calls import outermost, watching_block_parts


@dataclass(frozen=True)
class Call:
    """Where a module's hidden states go in and come out: a position or a keyword of its arguments, and an index
    into its output (None: the output is the tensor itself) with the output's length."""

    argument: int | str
    output_index: int | None
    output_length: int


@dataclass(frozen=True)
class StandIn:
    """How a stage that does not run an outside module replaces it: ``identity`` (returns its input, same
    shape), ``zeros`` (an embedding: the input's shape plus ``width``), ``batch_zeros`` (zeros of ``shape`` per
    sample: a patch embedding, a projection into the blocks' width), or ``unused`` (never called there). Later
    stages replace the first block's input with the hidden states they receive, so a stand-in's values are never
    used; only the shapes the code before the blocks computes with must be right. ``reason``: why no stand-in fits
    (a module that takes no tensor)."""

    kind: str
    width: int = 0
    dtype: torch.dtype = torch.float32
    reason: str = ""
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class NetworkTrace:
    """The roles found by :func:`trace_network`; parameter names are cleaned full names from the model root,
    every name of a tied parameter included."""

    block_call: Call
    # Indices i of the blocks whose hidden-state input is not the output of block i - 1 (code runs between them):
    # a stage may not start there.
    changed: frozenset[int]
    prelude: frozenset[str]
    postlude: frozenset[str]
    shared: frozenset[str]
    outside: dict[str, StandIn]  # modules outside the blocks holding parameters of their own -> stand-in
    before_blocks: frozenset[str]  # those of them the network calls before its first block
    # Parts of blocks (full names, outermost) the network runs after its last block, outside any block's forward (a
    # DiT's final modulation from block 0's timestep embedding): the last stage holds a copy.
    parts_after_blocks: frozenset[str] = frozenset()
    # Values blocks hand later blocks beside the hidden states (a T5 position bias returned by block 0, keys and values
    # written into a dict every block receives): carried across the stage boundaries (pipeline.handoffs, .carry).
    handoffs: Handoffs = Handoffs()

    def role_stages(self, name: str, n_stages: int) -> set[int]:
        """The stages that use parameter ``name`` outside the blocks."""
        stages: set[int] = set()
        if name in self.prelude:
            stages.add(0)
        if name in self.postlude:
            stages.add(n_stages - 1)
        if name in self.shared:
            stages.update(range(n_stages))
        return stages


def _tensors(value: Any) -> Iterable[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _hidden_argument(args: tuple, kwargs: dict, signature_order: list[str]) -> tuple[int | str, Tensor]:
    """The block's hidden-state input: its first floating-point tensor argument, positional first."""
    for index, value in enumerate(args):
        if isinstance(value, Tensor) and value.is_floating_point():
            return index, value
    for name in [*signature_order, *kwargs]:
        value = kwargs.get(name)
        if isinstance(value, Tensor) and value.is_floating_point():
            return name, value
    raise ValueError("a block received no floating-point tensor: pipeline parallel needs the hidden states as a "
                     "block argument")


def _walk(roots: Iterable[Tensor], stop: set[Any]) -> tuple[set[int], set[Any]]:
    """(ids of the leaf tensors, graph nodes) reachable backwards from ``roots`` without passing ``stop``."""
    leaves: set[int] = set()
    seen: set[Any] = set()
    stack = []
    for root in roots:
        if root.grad_fn is not None:
            stack.append(root.grad_fn)
        elif root.requires_grad:
            leaves.add(id(root))
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return leaves, seen


def _stand_in(shapes: tuple | None) -> StandIn:
    """The stand-in for a module called before the blocks, from its first call's (input, output) shapes."""
    if shapes is None:
        return StandIn("identity", reason="it takes no tensor input")
    in_shape, out_shape, out_dtype = shapes
    if out_shape == in_shape:
        return StandIn("identity")
    if len(out_shape) == len(in_shape) + 1 and out_shape[:-1] == in_shape:
        return StandIn("zeros", width=out_shape[-1], dtype=out_dtype)
    if in_shape and out_shape and in_shape[0] == out_shape[0]:  # a sample in, a sample of another shape out
        return StandIn("batch_zeros", shape=tuple(out_shape[1:]), dtype=out_dtype)
    return StandIn("identity", reason=f"it turns a {list(in_shape)} input into a {list(out_shape)} output")


def trace_network(network: nn.Module, block_names: list[str], inputs: Tensor, *,
                  root: nn.Module | None = None) -> NetworkTrace:
    """Trace ``root(inputs)`` once and classify what the network runs outside its blocks (see the module
    docstring).

    ``root`` is the model (the LightningModule; by default ``network``), whose forward must return the output
    of ``network``, the module a pipeline stage runs: code that the model's forward adds after the network
    (a temperature on the logits) would be skipped by the stages, and is refused. ``block_names`` are full
    names from ``root``. Parameters are made trainable for the trace and restored after, so frozen ones are
    placed too. Raises ``ValueError`` naming what a pipeline cannot reproduce.
    """
    root = root if root is not None else network
    names_by_id: dict[int, list[str]] = {}
    for name, parameter in root.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(parameter), []).append(clean_name(name))
    blocks = [root.get_submodule(name) for name in block_names]
    in_block = {id(p) for block in blocks for p in block.parameters()}
    outside_modules = {name: module for name, module in root.named_modules()
                       if name and not any(name == b or name.startswith(b + ".") or b.startswith(name + ".")
                                           for b in block_names)
                       and next(module.parameters(recurse=False), None) is not None}

    calls: list[dict[str, Any]] = [{} for _ in blocks]
    first_calls: dict[str, tuple | None] = {}  # outside modules called before the first block -> shapes
    blocks_started = []

    def before_block(index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            blocks_started.append(index)
            signature = _signature(module)
            position, hidden = _hidden_argument(args, kwargs, signature)
            arguments = {**dict(enumerate(args)), **kwargs}
            del arguments[position]
            names = {i: signature[i] for i in range(len(args)) if i < len(signature)}
            calls[index].update(argument=position, hidden=hidden, arguments=arguments, names=names,
                                containers=snapshot(arguments))
        return hook

    def after_block(index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            calls[index].update(output=output, writes=written(calls[index]["containers"]))
        return hook

    def outside_call(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if blocks_started or name in first_calls:
                return
            tensor_args = [a for a in args if isinstance(a, Tensor)]
            out, _, _ = first_tensor(output)
            first_calls[name] = ((tuple(tensor_args[0].shape), tuple(out.shape), out.dtype)
                                 if tensor_args and out is not None else None)
        return hook

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(before_block(index), with_kwargs=True))
        handles.append(block.register_forward_hook(after_block(index)))
    for name, module in outside_modules.items():
        handles.append(module.register_forward_hook(outside_call(name)))
    frozen = [p for p in root.parameters() if not p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(True)
    networks: list[Any] = []
    handles.append(network.register_forward_hook(lambda m, a, o: networks.append(o)))
    try:
        with torch.enable_grad(), watching_block_parts(zip(block_names, blocks)) as part_calls:
            returned = root(inputs)
    finally:
        for handle in handles:
            handle.remove()
        for parameter in frozen:
            parameter.requires_grad_(False)
    output = networks[-1] if networks else returned
    if first_tensor(returned)[0] is not first_tensor(output)[0]:
        raise ValueError(f"pipeline parallel: the stages run {type(network).__name__} and hand its output to loss_fn, "
                         f"but {type(root).__name__}.forward returns something else (it computes more after the "
                         "network, or calls it more than once): the stages would skip that code. Return the network's "
                         "output from forward and move the rest into loss_fn")

    missing = [block_names[i] for i, call in enumerate(calls) if "output" not in call]
    if missing or blocks_started != sorted(blocks_started):
        raise ValueError(f"pipeline parallel: the network's forward must run every block of the model map once, in "
                         f"order; it skipped {missing}" if missing else "it ran them out of order")
    output_index, output_length = _hidden_output(calls, block_names)
    hidden_out = [output_item(call["output"], output_index) for call in calls]
    changed = frozenset(i for i in range(1, len(calls)) if calls[i]["hidden"] is not hidden_out[i - 1])
    logits, _, _ = first_tensor(output)
    if logits is None:
        raise ValueError("pipeline parallel: the network's forward returned no tensor")
    first_input, last_output = calls[0]["hidden"], hidden_out[-1]
    # Graph nodes no code outside the blocks may reach except where it feeds the first block: the hidden
    # states between blocks and at the first block's input.
    inner = {t.grad_fn for t in [first_input, *hidden_out[:-1], *(calls[i]["hidden"] for i in changed)]
             if t.grad_fn is not None}

    prelude, _ = _walk([first_input], set())
    postlude, after = _walk([logits], {last_output.grad_fn})
    if logits is not last_output and last_output.grad_fn not in _walk([logits], set())[1]:
        raise ValueError(f"pipeline parallel: the network's output does not depend on the last block "
                         f"{block_names[-1]!r}; the last stage could not compute it")
    # Parts of blocks the network runs again after its last block, outside every block: the last stage keeps them.
    parts_after = outermost(c.part for c in part_calls if c.after_every_block_started and not c.inside_a_block)
    uncovered = sorted({n for i in postlude & in_block for n in names_by_id.get(i, ())
                        if not any(n.startswith(part + ".") for part in parts_after)})
    if uncovered:
        raise ValueError(f"pipeline parallel: the code after the last block uses parameters of blocks "
                         f"({', '.join(uncovered[:4])}) other than through a call of a part of a block; only the "
                         "last stage runs that code, and it holds only its own blocks. Train this model without pp "
                         "(data parallel, ZeRO-3 and tensor parallel train it)")
    if after & inner:
        raise ValueError("pipeline parallel: the network's output uses more than the last block's output (an earlier "
                         "block's or the embedding's activations); only the last stage computes it, and it holds "
                         "neither. Train this model without pp")
    handoffs, sides, handed = find_handoffs(
        [BlockCall(call["arguments"], call["names"], _items(call["output"], output_index), call["writes"])
         for call in calls], block_names, _tensors)
    shared: set[int] = set()
    for index, side in enumerate(sides):
        # What a block receives from earlier blocks is carried across the stages (pipeline.carry): the walk stops
        # at it. Anything else computed from the hidden states cannot be computed on a later stage.
        leaves, nodes = _walk(side, handed[index])
        if nodes & inner:
            raise ValueError(f"pipeline parallel: an argument of block {block_names[index]!r} besides its hidden "
                             "states is computed from the hidden states outside the blocks; later stages, which "
                             "receive the hidden states and what earlier blocks returned or wrote into a dict they "
                             "share, could not compute it")
        shared |= leaves - in_block
    if prelude & in_block:
        raise ValueError("pipeline parallel: the code before the first block uses parameters of a block; the first "
                         "stage would not hold them")

    def names(ids: set[int]) -> frozenset[str]:
        return frozenset(n for i in ids for n in names_by_id.get(i, ()))

    return NetworkTrace(block_call=Call(calls[0]["argument"], output_index, output_length), changed=changed,
                        prelude=names(prelude), postlude=names(postlude), shared=names(shared),
                        outside={name: _stand_in(first_calls.get(name)) if name in first_calls else StandIn("unused")
                                 for name in outside_modules},
                        before_blocks=frozenset(first_calls), parts_after_blocks=frozenset(parts_after),
                        handoffs=handoffs)


def _items(output: Any, hidden_index: int | None) -> dict[int, Tensor]:
    """The tensors a block's output holds beside its hidden states, by position."""
    if hidden_index is None:
        return {}
    items = output.to_tuple() if hasattr(output, "to_tuple") else output
    return {i: item for i, item in enumerate(items) if i != hidden_index and isinstance(item, Tensor)}


def _signature(module: nn.Module) -> list[str]:
    import inspect

    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def output_item(output: Any, index: int | None) -> Tensor:
    """Item ``index`` of a module's output (a tuple or a ``ModelOutput``); the output itself for None."""
    if index is None:
        return output
    items = output.to_tuple() if hasattr(output, "to_tuple") else output
    return items[index]


def _hidden_output(calls: list[dict[str, Any]], block_names: list[str]) -> tuple[int | None, int]:
    """The index of the hidden states in a block's output: the item the next block takes, else the first tensor."""
    output = calls[0]["output"]
    if isinstance(output, Tensor):
        return None, 1
    items = output.to_tuple() if hasattr(output, "to_tuple") else output
    if len(calls) > 1:
        for index, item in enumerate(items):
            if item is calls[1]["hidden"]:
                return index, len(items)
    _, index, length = first_tensor(output)
    if index is None and length == 0:
        raise ValueError(f"block {block_names[0]!r} returned no tensor")
    return index, length


__all__ = ["Call", "NetworkTrace", "StandIn", "output_item", "trace_network"]
