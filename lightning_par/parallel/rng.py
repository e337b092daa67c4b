"""Dropout under model parallelism: the same mask on every rank that holds the same activations, independent masks
where ranks hold different ones.

Megatron-LM's model-parallel RNG tracker (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", section 3; Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", for sequence parallel) draws the activations every tensor-parallel rank holds in full from
the default stream, alike on those ranks, and the activations split between a column-parallel layer and its
row-parallel partner from a second stream seeded per rank. This module keeps that rule and extends it to every
dimension that gives ranks different activations. Each such stretch of the forward is a *region* with a key naming
the rank's part; at the region's entry its stream is derived from the default generators' state:

    seed = hash(state of the default generators, key)

and the default generators (CPU, and the current accelerator's) are seeded with it for the region. At the exit their
own state is put back and, if anything in the region drew, advanced by one draw, so that the next region (or the
next micro-batch through this one) derives another stream. Derived rather than kept beside the default stream, as
Megatron's tracker keeps its states, because then:

* activation checkpointing replays the masks by itself: ``torch.utils.checkpoint`` restores the default generators'
  state at a block's recomputation, and the regions inside derive the same seeds from it (Megatron's checkpoint
  function saves and restores its tracker's states for this);
* a resumed run draws on as the uninterrupted one did from the default generators' states alone, which the
  strategies already keep in checkpoints (``strategies/resilience.py``);
* a model whose regions draw nothing leaves the default stream exactly as it found it.

Regions, by what makes ranks hold different activations (their keys in brackets):

* tensor parallel (``split``, the tensor-parallel rank): from the output of a column-wise layer to the output of
  its row-wise partner, where each rank holds its own heads or hidden units: attention probabilities, an MLP's
  hidden units, ``scaled_dot_product_attention``'s ``dropout_p``, a row-wise LoRA layer's input dropout. Outside,
  the activations are whole on every tensor-parallel rank (the residual stream, a dropout after the row-wise
  layer's all-reduce) and draw from the default stream, which tensor-parallel ranks share.
* sequence parallel (``shard``, the shard's coordinates on the mesh): a random op on a DTensor split along the
  sequence (the activations between the regions) draws per shard; one on a ``Replicate`` DTensor draws from the
  default stream. On CUDA, DTensor's own ``OffsetBasedRNGTracker`` does this (each shard takes its part of one
  Philox stream); it is created at set-up (:func:`install_shard_streams`), so that its first use does not
  broadcast a generator state over the whole world in the middle of a forward, where pipeline stages would not
  meet it. On CPU, where DTensor has no tracker, :class:`ShardStreams` derives a stream per shard.
* context parallel (``tokens``, the context-parallel rank): every block, and the final norm and the head where they
  run on each rank's tokens; before the blocks cut the sequence (the embedding) the activations are whole on
  every context-parallel rank, which share the default stream too.
* pipeline parallel (``stage``, the stage's index): a stage's whole forward. Every rank starts from the user's
  seed, so without it stage 1's first block would draw the masks stage 0's first block drew for the same
  micro-batch.

Data-parallel ranks are left as the user seeded them: with one seed on every rank they draw the same masks for
their different samples, as under Lightning's DDP.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import _random as dtensor_random

Key = tuple[Any, ...]


def default_generators(device_type: str) -> list[torch.Generator]:
    """The generators a forward on ``device_type`` draws from: the CPU's, and the current accelerator's."""
    generators = [torch.default_generator]
    if device_type != "cpu":
        accelerator = getattr(torch, device_type, None)
        if accelerator is not None and accelerator.is_available():
            index = accelerator.current_device()  # initialises the device's generators first
            generators.append(accelerator.default_generators[index])
    return generators


def derived_seed(generators: Sequence[torch.Generator], key: Key) -> int:
    """A seed from the state of ``generators`` and ``key``: the same on ranks whose generators agree and whose keys
    are equal, unrelated otherwise. Reads the states; draws nothing."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8)
    for generator in generators:
        digest.update(generator.get_state().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1  # manual_seed takes up to 2**64 - 1; keep it signed-safe


class DerivedStream:
    """A region's stream (module docstring): on entry the default generators are seeded from their own state and
    ``key``; on exit their state is put back, advanced by one draw for each generator that the region drew from."""

    def __init__(self, key: Key, device_type: str) -> None:
        self.key, self.device_type = key, device_type
        self._saved: list[tuple[torch.Generator, torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> DerivedStream:
        generators = default_generators(self.device_type)
        seed = derived_seed(generators, self.key)
        saved = [generator.get_state() for generator in generators]
        for generator in generators:
            generator.manual_seed(seed)
        self._saved = [(g, state, g.get_state()) for g, state in zip(generators, saved)]
        return self

    def __exit__(self, *exc: object) -> None:
        saved, self._saved = self._saved, []
        for generator, state, start in saved:
            drew = not torch.equal(generator.get_state(), start)
            generator.set_state(state)
            if drew:
                # One draw from the default stream: the next region derives another seed. Alike on every rank whose
                # region drew alike, so ranks that share the default stream still share it afterwards.
                torch.empty((), device=generator.device).random_(generator=generator)


class Region:
    """A module's forward run in a region: entered by a forward pre-hook, left by a forward hook that runs also when
    the forward raises (``always_call``), so that the module and its attributes stay the user's."""

    def __init__(self, key: Key, device_type: str) -> None:
        self.key, self.device_type = key, device_type
        self._open: list[DerivedStream] = []

    def enter(self, module: nn.Module, args: tuple) -> None:
        self._open.append(DerivedStream(self.key, self.device_type).__enter__())

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def attach(self, module: nn.Module) -> None:
        """Run ``module``'s forward, its own hooks included, in this region."""
        module.register_forward_pre_hook(self.enter, prepend=True)
        module.register_forward_hook(self.leave, always_call=True)


class SplitRegion:
    """The stretch of a module from its first column-wise layer's output to its row-wise layer's output: opened by a
    forward hook of the column-wise layers (the first one opens it), closed by one of the row-wise layers, and
    closed at the latest when the module's forward ends, also when it raises.

    The column-wise layer's input is whole on every rank and draws from the default stream (a column-wise LoRA
    layer's input dropout); the row-wise layer's input is this rank's slice (a row-wise LoRA layer's input
    dropout) and draws inside."""

    def __init__(self, key: Key, device_type: str) -> None:
        self.key, self.device_type = key, device_type
        self._open: DerivedStream | None = None

    def open(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._open is None:
            self._open = DerivedStream(self.key, self.device_type).__enter__()

    def close(self, module: nn.Module | None = None, args: tuple = (), output: Any = None) -> None:
        if self._open is not None:
            stream, self._open = self._open, None
            stream.__exit__(None, None, None)


def apply_split_streams(module: nn.Module, regions: Mapping[str, Sequence[tuple[str, str]]], tp_rank: int,
                        device_type: str) -> int:
    """Give each module of ``regions`` (``{module: [(layer, style), ...]}``, the split layers tensor parallel laid out
    in it) its :class:`SplitRegion`, keyed by this rank's tensor-parallel ``tp_rank``: ``colwise`` layers (whose
    output is this rank's part) open it, ``rowwise`` and ``rowwise_split`` layers (whose output is whole again)
    close it, and so does the end of the module's forward. Returns the number of regions."""
    count = 0
    for parent_name, layers in regions.items():
        opening = [name for name, style in layers if style == "colwise"]
        if not opening:
            continue  # every output whole (colwise_gather): nothing split to draw for
        region = SplitRegion(("split", tp_rank), device_type)
        for name in opening:
            module.get_submodule(name).register_forward_hook(region.open)
        for name, style in layers:
            if style in ("rowwise", "rowwise_split"):
                module.get_submodule(name).register_forward_hook(region.close)
        module.get_submodule(parent_name).register_forward_hook(region.close, always_call=True)
        count += 1
    return count


def apply_token_streams(module: nn.Module, names: Sequence[str], cp_rank: int, device_type: str) -> None:
    """Run the modules ``names`` (the blocks, and the final norm and head where they compute on each rank's tokens)
    in regions keyed by this rank's context-parallel ``cp_rank``."""
    for name in names:
        Region(("tokens", cp_rank), device_type).attach(module.get_submodule(name))


def apply_stage_streams(stages: Sequence[nn.Module], indices: Sequence[int], device_type: str) -> None:
    """Run each pipeline stage module in ``stages`` (this rank's) in a region keyed by its stage index."""
    for stage, index in zip(stages, indices):
        Region(("stage", index), device_type).attach(stage)


# --------------------------------------------------------------------------------- DTensor random ops
def shard_coordinates(mesh: DeviceMesh, placements: Sequence[Any]) -> Key:
    """This rank's shard of a DTensor laid out by ``placements`` on ``mesh``: the coordinate of every mesh dimension
    that splits it (ranks holding the same shard get the same key; a replicated DTensor gets ``()``)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return ()
    return tuple((dim, coordinate[dim]) for dim, placement in enumerate(placements) if placement.is_shard())


@contextmanager
def _drawing_from(generator: torch.Generator) -> Iterator[None]:
    """The CPU's default generator standing in for ``generator`` (DTensor takes a random op's ``generator`` argument
    away and leaves the draw to the tracker); ``generator`` advances by what was drawn."""
    default = torch.default_generator
    own = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(default.get_state())
        default.set_state(own)


class ShardStreams(dtensor_random._RNGStateTracker):
    """DTensor's random-op tracker for CPU meshes, where DTensor has none and a random op on a sharded DTensor would
    draw the same numbers for every shard from the shared default stream: a split DTensor draws in a region keyed by
    its shard's coordinates, a replicated one from the default stream (CUDA's ``OffsetBasedRNGTracker`` gives the
    same semantics with offsets into one Philox stream)."""

    def __init__(self) -> None:  # noqa: D107 - the base's checks are for accelerators; nothing else is needed
        self._device = torch.device("cpu")
        self._device_handle = torch.cpu
        self._use_distribute_region = True

    @property
    def distribute_region_enabled(self) -> bool:
        return self._use_distribute_region

    @distribute_region_enabled.setter
    def distribute_region_enabled(self, value: bool) -> None:
        self._use_distribute_region = value

    @contextmanager
    def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
        key = shard_coordinates(spec.mesh, spec.placements)
        with _drawing_from(generator) if generator is not None else nullcontext():
            if not key:
                yield
                return
            with DerivedStream(("shard", *key), "cpu"):
                yield


def install_shard_streams(mesh: DeviceMesh) -> None:
    """Make DTensor's random ops on ``mesh``'s device draw per shard: :class:`ShardStreams` on CPU; on an accelerator,
    DTensor's own ``OffsetBasedRNGTracker``, created now without synchronising states (the ranks that hold one
    DTensor start alike: tensor- and context-parallel ranks share their states, ``strategies/resilience.py``) rather
    than at its first use, where it broadcasts rank 0's state to every rank, a collective the pipeline stages would
    reach at different times. A tracker already there is kept."""
    if mesh.device_type == "cpu":
        if dtensor_random._rng_tracker is None or isinstance(dtensor_random._rng_tracker, ShardStreams):
            dtensor_random._rng_tracker = ShardStreams()
        return
    if dtensor_random._rng_tracker is None and dtensor_random.is_rng_supported_mesh(mesh):
        dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(mesh, run_state_sync=False)


__all__ = ["DerivedStream", "Region", "ShardStreams", "SplitRegion", "apply_split_streams", "apply_stage_streams",
           "apply_token_streams", "default_generators", "derived_seed", "install_shard_streams", "shard_coordinates"]
