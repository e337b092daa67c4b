"""Initialising a model built on the meta device so that every layout holds what one process would have drawn.

``Trainer.init_module(empty_init=True)`` (and Fabric's) builds the model on the meta device; the layout then splits
and shards it, and only each rank's part is ever allocated. Initialising those parts where they lie would draw the
same random numbers for every shard of a tensor (each rank's generator is seeded alike): under ZeRO-3 the two halves
of a weight matrix would start nearly equal, and a pipeline stage would draw its blocks' weights from where one
process draws the first blocks'. Here the model's own initialisers run one at a time, in the model's order, on whole
tensors, and each rank keeps its part of each result (its rows under ZeRO-3 and tensor parallel, a fused
projection's rows regrouped as tensor parallel trains them, the experts it hosts, its pipeline stages' tensors). The
random stream is consumed exactly as one process consumes it, so the gathered model equals one process's
initialisation with the same seed, on any device and layout.

The initialisers, in the order of ``model.named_modules()``, are the ones Lightning materialises a meta-device model
with, plus the model's own:

- a module's ``init_weights()`` (torchtitan's convention: the reference model's blocks), over all of its submodules;
- a Hugging Face ``PreTrainedModel``'s ``_initialize_weights(module)``, module by module, children first, as
  transformers' own ``initialize_weights()`` applies it;
- otherwise ``reset_parameters()`` of each module that holds parameters or buffers of its own (PyTorch's and
  Lightning's convention; litgpt's pretraining sets its initialisation this way).

Memory: the tensors of one initialiser are whole at a time (a module's own, or everything under a module whose
``init_weights()`` covers it). A model that initialises everything in one root ``init_weights()`` is therefore whole
on every rank for a moment at set-up; per-module initialisers keep that to the largest module.

A tensor that no initialiser covers would start as whatever memory held: it is refused, naming its module. So is a
buffer the model computes (non-persistent: a rotary table, a mask), which no checkpoint loads either, that its
initialiser leaves partly unwritten.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_par.parallel.modules import clean_name, retie, tied_groups
from lightning_par.parallel.regroup import regrouped_parameters

__all__ = ["Initializer", "RandomState", "has_meta_tensors", "initialize_meta_model", "initializers", "meta_skeleton"]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose every tensor is on the meta device (nothing copied): its initialisers, in its order,
    as built, for the parts a layout takes off this rank (other pipeline stages') or swaps for modules of another class
    (a vocabulary-parallel embedding, float8 linear layers). Taken before the layout changes ``module``."""
    memo: dict[int, object] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, DeviceMesh):
                memo[id(value)] = None  # a LightningModule's device_mesh: not part of the model
        for tensor in (*sub.parameters(recurse=False), *sub.buffers(recurse=False)):
            if id(tensor) not in memo:
                empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
                    else empty
    return copy.deepcopy(module, memo)


@dataclass(frozen=True)
class Initializer:
    """``run()`` initialises the tensors ``modules`` hold themselves ((path, module) pairs), whole at once."""

    name: str  # for messages: "Block.init_weights()" ...
    modules: tuple[tuple[str, nn.Module], ...]
    run: Callable[[], None]


def initialize_meta_model(module: nn.Module, device: torch.device, *, skeleton: nn.Module | None = None,
                          group: dist.ProcessGroup | None = None) -> bool:
    """Allocate ``module``'s meta-device tensors on ``device`` and initialise them as one process would: the
    initialisers of ``skeleton`` (the model as built, from :func:`meta_skeleton`, taken before a layout changed it) or
    of ``module`` itself (a model that laid itself out) run on whole tensors, and each of ``module``'s tensors receives its part of
    the whole under its name. Returns whether there was anything to allocate.

    Every rank must start from the same random state; where the ranks of ``group`` (by default every rank) do not, the
    first rank's is used, so that the parts of one tensor come from one draw. Raises ``ValueError`` naming the modules
    whose tensors no initialiser covers."""
    if not has_meta_tensors(module):
        return False
    ties = tied_groups(module)
    module.to_empty(device=device)
    retie(module, ties)  # to_empty allocates each module's parameters on their own: a tied head would come apart
    source = skeleton if skeleton is not None else module
    targets = _tensors_by_name(module)
    # Every name of each tensor of the source: a shared block's or tied tensor's part here may be held under any.
    names = {}
    for name, tensors in _tensors_by_name(source).items():
        for tensor in tensors:
            names.setdefault(id(tensor), []).append(name)
    regrouped = regrouped_parameters(module)
    ordered = list(initializers(source))
    _refuse_uncovered(source, ordered)
    _agree_on_random_state(device, group)
    # A tied tensor is one whole tensor through every initialiser that touches it: the later ones see what the earlier
    # ones drew (transformers skips a tensor it marked initialised), as in one process.
    tied = {id(t): None for t in _tied_tensors(source)}
    with torch.no_grad():
        for initializer in ordered:
            for tensor, value in _run_on_whole_tensors(initializer, device, tied):
                written: set[int] = set()
                for name in names[id(tensor)]:
                    for target in targets.get(name, ()):
                        if id(target) not in written:
                            written.add(id(target))
                            _write_part(target, value, regrouped.get(name))
    return True


def _tensors_by_name(module: nn.Module) -> dict[str, list[Tensor]]:
    """Every parameter and buffer of ``module`` under each of its names, as state dicts spell them."""
    found: dict[str, list[Tensor]] = {}
    for name, tensor in (*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)):
        found.setdefault(clean_name(name), []).append(tensor)
    return found


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, str, Tensor]]:
    """(kind, leaf, tensor) of the parameters (``_parameters``) and buffers (``_buffers``) ``module`` holds itself."""
    for kind in ("_parameters", "_buffers"):
        for leaf, tensor in getattr(module, kind).items():
            if tensor is not None:
                yield kind, leaf, tensor


def initializers(root: nn.Module) -> Iterator[Initializer]:
    """The initialisers of ``root``, in the order one process runs them (see the module's docstring)."""
    covered: set[nn.Module] = set()
    for path, sub in root.named_modules():  # a module several parents hold is initialised once, as one process does
        if sub in covered:
            continue
        if _is_hugging_face_model(sub):
            yield from _hugging_face_initializers(sub, path)
            covered.update(sub.modules())
        elif _callable_without_arguments(getattr(sub, "init_weights", None)):
            prefix = f"{path}." if path else ""
            yield Initializer(f"{type(sub).__name__}.init_weights()",
                               tuple((f"{prefix}{p}" if p else path, m)
                                     for p, m in sub.named_modules()), sub.init_weights)
            covered.update(sub.modules())
        elif callable(getattr(sub, "reset_parameters", None)) and any(True for _ in _own_tensors(sub)):
            yield Initializer(f"{type(sub).__name__}.reset_parameters()", ((path, sub),), sub.reset_parameters)


def _callable_without_arguments(method: object) -> bool:
    """Whether ``method`` can be called with no argument (a part's ``init_weights(init_std, out_std)`` that its block
    calls is not an initialiser of its own)."""
    if not callable(method):
        return False
    try:
        inspect.signature(method).bind()
    except (TypeError, ValueError):
        return False
    return True


def _is_hugging_face_model(module: nn.Module) -> bool:
    return callable(getattr(module, "_initialize_weights", None)) and callable(getattr(module, "_init_weights", None)) \
        and hasattr(module, "config")


def _hugging_face_initializers(model: nn.Module, path: str) -> Iterator[Initializer]:
    """transformers' ``initialize_weights()`` one module at a time: each module after its children, by the innermost
    ``PreTrainedModel`` that holds it (a composite model's parts initialise themselves)."""
    custom = bool(model.is_custom_code()) if callable(getattr(model, "is_custom_code", None)) else False
    takes_custom = len(inspect.signature(model._initialize_weights).parameters) > 1  # transformers 5 on

    seen: set[int] = set()  # a module several parents hold is initialised once (transformers marks it done)

    def visit(module: nn.Module, name: str, owner: nn.Module) -> Iterator[Initializer]:
        seen.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                inner = child if _is_hugging_face_model(child) else owner
                yield from visit(child, f"{name}.{child_name}" if name else child_name, inner)

        def run(module: nn.Module = module, owner: nn.Module = owner) -> None:
            module._is_hf_initialized = False  # transformers skips a module it marked, and the marks are stale here
            owner._initialize_weights(module, custom) if takes_custom else owner._initialize_weights(module)

        yield Initializer(f"{type(owner).__name__}._initialize_weights({type(module).__name__})",
                           ((name, module),), run)

    yield from visit(model, path, model)


def _refuse_uncovered(root: nn.Module, ordered: list[Initializer]) -> None:
    covered = {id(module) for initializer in ordered for _, module in initializer.modules}
    missing = [f"{path or type(root).__name__} ({type(sub).__name__}: {', '.join(leaf for _, leaf, _ in own)})"
               for path, sub in root.named_modules() if id(sub) not in covered and (own := list(_own_tensors(sub)))]
    if missing:
        raise ValueError(
            "the model was built on the meta device (empty_init=True), and nothing initialises "
            f"{'; '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: they would start as whatever memory held. "
            f"Give {'these modules' if len(missing) > 1 else 'that module'} a reset_parameters() that sets its tensors "
            "(PyTorch's and Lightning's convention), or an init_weights() on a module above them, or build the model "
            "off the meta device (empty_init=False)")


def _tied_tensors(module: nn.Module) -> list[Tensor]:
    """The tensors of ``module`` registered under more than one name."""
    seen: dict[int, tuple[Tensor, int]] = {}
    for _, tensor in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        seen[id(tensor)] = (tensor, seen.get(id(tensor), (tensor, 0))[1] + 1)
    return [tensor for tensor, count in seen.values() if count > 1]


def _run_on_whole_tensors(initializer: Initializer, device: torch.device,
                          tied: dict[int, Tensor | None]) -> list[tuple[Tensor, Tensor]]:
    """Run ``initializer`` with every tensor of its modules swapped for a whole one on ``device`` (a tied tensor's,
    kept in ``tied``, for the whole walk); return (the module's own tensor, its whole value) pairs, and put the
    modules' own tensors back."""
    whole: dict[int, Tensor] = {}  # one whole tensor per tensor, so that a tie stays a tie while the initialiser runs
    slots: list[tuple[nn.Module, str, str, str, Tensor]] = []
    for path, module in initializer.modules:
        for kind, leaf, tensor in list(_own_tensors(module)):
            if id(tensor) not in whole:
                if tied.get(id(tensor)) is not None:
                    whole[id(tensor)] = tied[id(tensor)]
                else:
                    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    if _computed_by_the_model(module, kind, leaf, tensor):
                        empty.fill_(float("nan"))  # what the initialiser leaves unwritten shows
                    whole[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else empty
                    if id(tensor) in tied:
                        tied[id(tensor)] = whole[id(tensor)]
            getattr(module, kind)[leaf] = whole[id(tensor)]
            slots.append((module, kind, leaf, clean_name(f"{path}.{leaf}" if path else leaf), tensor))
    try:
        initializer.run()
        # An initialiser may assign a new tensor (``self.cos = ...``): what the slot holds now is the value.
        values = [(tensor, getattr(module, kind)[leaf].detach()) for module, kind, leaf, _, tensor in slots]
        unwritten = [name for (_, value), (module, kind, leaf, name, tensor) in zip(values, slots)
                     if _computed_by_the_model(module, kind, leaf, tensor) and bool(value.isnan().any())]
        if unwritten:
            raise ValueError(
                f"the model was built on the meta device (empty_init=True), and {initializer.name} leaves "
                f"{', '.join(repr(n) for n in unwritten)} unset: a buffer the model computes (kept out of checkpoints, "
                "so nothing loads it) would start as whatever memory held. Compute it in that initialiser (as a rotary "
                "table is computed in reset_parameters()), or build the model off the meta device (empty_init=False)")
        return values
    finally:
        for module, kind, leaf, _, tensor in slots:
            getattr(module, kind)[leaf] = tensor


def _computed_by_the_model(module: nn.Module, kind: str, leaf: str, tensor: Tensor) -> bool:
    """Whether ``tensor`` is a floating-point buffer the model computes and keeps out of its state dict (a rotary
    table, a mask): no checkpoint loads it, so its initialiser must write all of it."""
    return kind == "_buffers" and leaf in module._non_persistent_buffers_set and tensor.is_floating_point()


def _write_part(target: Tensor, value: Tensor, regrouped: tuple[int, Tensor] | None) -> None:
    """Copy into ``target`` its part of ``value`` (the whole tensor, in the model's order)."""
    if regrouped is not None:  # rows of a fused projection in the order tensor parallel trains them
        dim, order = regrouped
        value = value.index_select(dim, order.to(value.device))
    if isinstance(target, DTensor):
        part = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                 src_data_rank=None).to_local()
        target.to_local().copy_(part)
    else:
        target.copy_(value)


def _agree_on_random_state(device: torch.device, group: dist.ProcessGroup | None) -> None:
    """Give every rank of ``group`` the first rank's random state on ``device``, where they differ (ranks seeded alike,
    as Lightning's ``seed_everything`` seeds them, already agree and keep theirs): the parts of one tensor must come
    from one draw."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    generator = _generator(device)
    state = generator.get_state()
    fingerprints: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(fingerprints, hashlib.sha256(state.numpy().tobytes()).hexdigest(), group=group)
    if len(set(fingerprints)) > 1:
        states = [state]
        dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        generator.set_state(states[0])


def _generator(device: torch.device) -> torch.Generator:
    """The default random generator of ``device`` (what an initialiser's draws on it use)."""
    if device.type == "cpu":
        return torch.default_generator
    index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
    return torch.get_device_module(device.type).default_generators[index]


class RandomState:
    """The random state of the CPU and of ``device``, taken now, to be put back (:meth:`restore`) after work that must
    not move the user's random stream: the set-up's runs of small copies of the model, which one process never runs,
    so that a meta-device model is then initialised from where one process would draw it."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.device = device if device.type not in ("cpu", "meta") else None
        self.on_device = _generator(device).get_state() if self.device is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            _generator(self.device).set_state(self.on_device)
