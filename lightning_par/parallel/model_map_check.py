"""A tensor-parallel styles checked against what the model computes, before anything trains.

A model map names the layers to split; whether the model then computes the same thing depends on the code
around them. Splitting a fused q/k/v projection column-wise hands a rank the first rows of [q; k; v] (the
model's ``split(n_embd)`` then fails, or a ``chunk(3)`` silently pairs the wrong heads); a norm over the
whole projection width (OLMo 2) cannot run on one rank's slice; a per-head norm (Qwen3, Gemma 3) runs fine
but receives each rank's share of the gradient only. Names cannot tell these apart. So the model map is run:

- a small copy of the model is made (``lightning_par.parallel.small_copy``: no weights are copied, one block of
  each kind, the embedding and head cut to a few rows per rank where the model allows, random values that
  every rank draws alike);
- it runs forward and backward on one sample of the data, whole, then split with the model map (in evaluation
  mode: dropout draws differ between the two);
- outputs of every split region and the logits, and every parameter's gradient, must agree (float64, where
  every kernel has a float64 version: the differences left are rounding, ~1e-15; else float32).

What disagrees is named: the region whose output differs first, or the module that raised. A replicated
parameter whose gradient is exactly the sum over the ranks of the split one is marked ``per_shard`` (its
gradients are then summed). For a model map :func:`~lightning_par.parallel.model_map.derive_model_map` made, a
region that does not compute the same is tried again with its heads per rank (its head counts each rank's, a fused
projection's rows regrouped by the sections the model cuts it into: :class:`_HeadsPerRank`), then with its output
gathered (``colwise_gather`` / ``rowwise_split``), then left whole, and the log says so; a model map the user or the model's config gave is refused with the module,
the reason and the model map key that would change it. A model of which nothing in the blocks stays split is
refused: it would train replicated, not tensor parallel.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.modules import first_tensor
from lightning_par.parallel.model_map import SPLIT_STYLES, ModelMap, is_projection
from lightning_par.parallel.local_heads import head_counts
from lightning_par.parallel.model_map_structure import fused_sections, structural_styles
from lightning_par.parallel.regroup import regrouped_parameters
from lightning_par.parallel.small_copy import Vocabulary, small_copy
from lightning_par.parallel.modules import clean_name
from lightning_par.parallel.model_call import run_model

# A faithful split differs from the whole model by rounding only: ~1e-15 in float64, ~1e-7 where a model
# computes a norm in float32 whatever its dtype (Gemma), ~1e-6 in float32 (models whose kernels have no float64
# version, such as grouped expert matmuls); a wrong split differs by O(0.1-1).
_RTOL = {torch.float64: 1e-5, torch.float32: 1e-4}
_GATHERED = {"colwise": "colwise_gather", "rowwise": "rowwise_split"}
# Model maps the project found (by names, by structure): a split that does not compute the same falls back to
# gathered or whole. A map the user or the model's config gave is refused instead.
FOUND_SOURCES = ("derived", "structure")


@dataclass
class _Outcome:
    """One run of the model map: None fields mean it agreed with the whole model."""

    region: str | None = None  # the split region (module full name) that differed or raised
    module: str | None = None  # the innermost module running when it raised
    reason: str | None = None
    partial: tuple[str, ...] = ()  # modules whose replicated parameters got only their rank's share

    @property
    def ok(self) -> bool:
        return self.reason is None and not self.partial


def check_model_map(module: nn.Module, mesh: ParallelMesh, model_map: ModelMap, inputs: Tensor, *,
               sequence_parallel: bool = False, loss_parallel: bool = False,
               apply: Callable[..., nn.Module]) -> tuple[ModelMap, list[str]]:
    """The model map to train with, and notes on what the check changed. Collective over the ``tp`` ranks.

    ``apply(copy, mesh, model_map, sequence_parallel=..., loss_parallel=...)`` splits a copy as training will
    (``apply_tensor_parallel``). ``inputs``: a sample of the input of the model's own forward, which the copy runs
    (it may hand the network more than the inputs: a timestep, labels); its first row is used. Raises
    ``ValueError`` naming the module and the reason when the model map cannot compute what the model computes.
    """
    notes: list[str] = []
    device = torch.device(mesh.device_type)
    vocabulary, sample, dtype = copy_settings(module, model_map, inputs[:1], mesh.size("tp"), device)
    if model_map.source == "derived":  # layers no name rule knows: paired by what the blocks compute
        model_map = _with_structural_pairs(module, model_map, sample, dtype, vocabulary, device, notes)
    candidate = model_map
    per_rank = _HeadsPerRank(module, model_map, sample, dtype, vocabulary, device, mesh.size("tp"))
    for _ in range(5 * max(1, len(_regions(module, model_map))) + 4):
        outcome = _run(module, mesh, candidate, sample, dtype=dtype, sequence_parallel=sequence_parallel,
                       loss_parallel=loss_parallel, apply=apply, vocabulary=vocabulary)
        if outcome.ok:
            break
        if outcome.partial:
            added = {_pattern(model_map, name): "per_shard" for name in outcome.partial}
            notes.append(f"{', '.join(sorted(added))}: per_shard (applied to each rank's heads; gradients summed "
                         "over tp)")
            candidate = candidate.with_styles({**added, **candidate.styles})
            continue
        where = outcome.region or outcome.module or "the model"
        if model_map.source not in FOUND_SOURCES or outcome.region is None:
            raise ValueError(_refusal(model_map, outcome, mesh, sequence_parallel))
        tried = per_rank.applied_to(candidate, outcome.region)
        if tried is not candidate:
            candidate = tried
            continue
        candidate = per_rank.removed_from(candidate, outcome.region)
        layers = _layers(module, candidate, outcome.region)
        styles = {_key_of(candidate, layer): candidate.style_of(layer) for layer in layers}
        if any(style in _GATHERED for style in styles.values()):
            candidate = candidate.with_styles({**candidate.styles,
                                               **{k: _GATHERED.get(s, s) for k, s in styles.items()}})
            notes.append(f"{_pattern(model_map, where)}: its output gathered before the code that uses it "
                         f"(split as planned, {outcome.reason})")
        else:
            candidate = candidate.with_styles({k: ("replicate" if k in styles else s)
                                               for k, s in candidate.styles.items()})
            notes.append(f"{_pattern(model_map, where)}: left whole ({outcome.reason})")
    else:
        raise ValueError(f"tensor parallel: the model map for {type(module).__name__} did not settle; last: "
                         f"{_refusal(model_map, outcome, mesh, sequence_parallel)}")
    notes.extend(per_rank.notes(candidate))
    if not any(is_projection(sub) and candidate.style_of(name) in SPLIT_STYLES
               for name, sub in module.named_modules() if name.startswith(model_map.blocks + ".")):
        why = "; ".join(notes) if notes else "the model map marks no projection inside the blocks column- and row-wise"
        named_tp = f"tp={mesh.size('tp')!r}"
        raise ValueError(f"{named_tp} would split no layer inside the blocks {model_map.blocks!r} of "
                         f"{type(module).__name__} ({model_map.source} map; {why}): the blocks would train "
                         "replicated on every tensor-parallel rank. Give a model map whose blocks pair colwise and rowwise projections (docs/models.md), "
                         "or use data parallel / ZeRO-3 for this model")
    return candidate, notes


def _with_structural_pairs(module: nn.Module, model_map: ModelMap, sample: Tensor, dtype: torch.dtype,
                           vocabulary: Vocabulary | None, device: torch.device, notes: list[str]) -> ModelMap:
    """``model_map`` with the column/row-wise pairs the blocks compute among the projections it leaves unstyled
    (``lightning_par.parallel.model_map_structure``), source ``structure`` when it found any."""
    model_copy = small_copy(module, model_map.blocks, device, dtype, vocabulary=vocabulary)
    found = structural_styles(model_copy, model_map, lambda: run_model(model_copy, _as(sample, device, dtype)))
    if not found:
        return model_map
    notes.append("found from the computation: " + ", ".join(f"{p}: {s}" for p, s in found.items()))
    return replace(model_map, styles={**model_map.styles, **found}, source="structure")


class _HeadsPerRank:
    """The second try for a region of a found map that does not compute what the whole model does, before its
    output is gathered: its head counts set to each rank's (:mod:`~lightning_par.parallel.local_heads`) and its fused
    projections regrouped by the sections the model cuts them into (:mod:`~lightning_par.parallel.regroup`; the
    sections are read off one forward of a small copy, the first time a region needs them)."""

    def __init__(self, module: nn.Module, model_map: ModelMap, sample: Tensor, dtype: torch.dtype,
                 vocabulary: Vocabulary | None, device: torch.device, tp: int) -> None:
        self.module, self.model_map, self.tp = module, model_map, tp
        self.copy_settings = (sample, dtype, vocabulary, device)
        self.tried: set[str] = set()
        self.sections: dict[str, tuple[int, ...]] = {}  # layer -> the sections the model cuts its output into
        self.probed: set[str] = set()
        self.counts: dict[str, dict[str, tuple[int, int]]] = {}

    def applied_to(self, candidate: ModelMap, region: str) -> ModelMap:
        """``candidate`` with ``region``'s heads per rank; ``candidate`` itself where that was tried or cannot be."""
        key = _pattern(candidate, region)
        if key in self.tried:
            return candidate
        self.tried.add(key)
        counts = head_counts(self.module.get_submodule(region), self.tp)
        fused = [layer for layer in _layers(self.module, candidate, region) if candidate.style_of(layer) == "colwise"]
        self._probe([layer for layer in fused if layer not in self.probed])
        sections = {_pattern(candidate, layer): self.sections[layer] for layer in fused if layer in self.sections}
        if counts is None or not (counts or sections):
            return candidate
        self.counts[key] = counts
        return replace(candidate, local_heads=(*candidate.local_heads, key),
                       sections={**candidate.sections, **sections})

    def _probe(self, layers: list[str]) -> None:
        if not layers:
            return
        sample, dtype, vocabulary, device = self.copy_settings
        model_copy = small_copy(self.module, self.model_map.blocks, device, dtype, vocabulary=vocabulary)
        self.sections.update(fused_sections(model_copy, layers, lambda: run_model(model_copy, _as(sample, device, dtype))))
        self.probed.update(layers)

    def removed_from(self, candidate: ModelMap, region: str) -> ModelMap:
        """``candidate`` without ``region``'s heads per rank (its output is about to be gathered: whole, in the
        model's own order, with its own counts)."""
        key = _pattern(candidate, region)
        layers = {_pattern(candidate, layer) for layer in _layers(self.module, candidate, region)}
        self.counts.pop(key, None)
        return replace(candidate, local_heads=tuple(p for p in candidate.local_heads if p != key),
                       sections={p: s for p, s in candidate.sections.items() if p not in layers})

    def notes(self, final: ModelMap) -> list[str]:
        notes = [f"{key}: head counts per rank ("
                 + ", ".join(f"{name} {whole} -> {mine}" for name, (whole, mine) in self.counts[key].items()) + ")"
                 for key in final.local_heads if self.counts.get(key)]
        notes.extend(f"{key}: rows regrouped by section {list(sizes)} (each rank holds its part of every section)"
                     for key, sizes in final.sections.items() if key not in self.model_map.sections)
        return notes


def _key_of(model_map: ModelMap, name: str) -> str:
    """The pattern of ``model_map.styles`` that gives ``name`` its style."""
    return next(pattern for pattern in model_map.styles if fnmatch.fnmatchcase(name, pattern))


def _pattern(model_map: ModelMap, name: str) -> str:
    """A pattern naming ``name`` in every block: ``model.layers.0.attn.q_norm`` -> ``model.layers.*.attn.q_norm``."""
    prefix = model_map.blocks + "."
    if name.startswith(prefix):
        _, _, rest = name[len(prefix):].partition(".")
        return f"{prefix}*.{rest}"
    return name


def _regions(module: nn.Module, model_map: ModelMap) -> list[str]:
    """Modules holding split layers, in module order; one inside another is part of it (diffusers' attention keeps
    its output projection in ``to_out.0``, its feed-forward's first one in ``net.0.proj``)."""
    parents: list[str] = []
    for name, sub in module.named_modules():
        if is_projection(sub) and model_map.style_of(name) in SPLIT_STYLES and name != model_map.head:
            parent = name.rpartition(".")[0]
            if parent not in parents:
                parents.append(parent)
    return [p for p in parents if not any(p.startswith(other + ".") for other in parents)]


def _layers(module: nn.Module, model_map: ModelMap, region: str) -> list[str]:
    """The split layers inside ``region``."""
    return [f"{region}.{name}" for name, sub in module.get_submodule(region).named_modules()
            if name and is_projection(sub) and model_map.style_of(f"{region}.{name}") in SPLIT_STYLES]


def _refusal(model_map: ModelMap, outcome: _Outcome, mesh: ParallelMesh, sequence_parallel: bool) -> str:
    where = outcome.region or outcome.module or "the model"
    key = _pattern(model_map, where)
    if sequence_parallel and "mixed torch.Tensor and DTensor" in (outcome.reason or ""):
        # Between the split regions the activations are DTensors split along the sequence.
        advice = (f"{key!r} is not split but receives the sequence-split activations of sequence parallel, which "
                  "it cannot compute with (an MoE router, nn.MultiheadAttention, a low-rank projection): set "
                  "sequence_parallel=False for this model, or give the model map a style for it")
    else:
        advice = (f"change the styles of {key!r}'s layers in the model map (colwise_gather/rowwise_split when the "
                  "model slices a projection's output by global sizes, replicate to keep it whole; see docs/models.md)")
    named_tp = f"tp={mesh.size('tp')!r}"
    return (f"tensor parallel ({named_tp}, {model_map.source} map) does not compute what the model computes in "
            f"{key!r}: {outcome.reason}. {advice[0].upper()}{advice[1:]}")


# ------------------------------------------------------------------------------------------- one run
# Rows per tensor-parallel rank of the copy's embedding and head: enough for every split to hold several.
_VOCABULARY_ROWS_PER_RANK = 16


def copy_settings(module: nn.Module, model_map: ModelMap, inputs: Tensor, tp: int,
                      device: torch.device) -> tuple[Vocabulary | None, Tensor, torch.dtype]:
    """How the copy is made, found by running it: its vocabulary cut (or None), the sample it runs on (token ids
    below the cut) and its dtype. Local, without collectives, so every rank finds the same.

    The embedding and head are cut to a few rows per rank, with the model's remainder modulo ``tp`` (a vocabulary
    that does not divide among the ranks still does not), where the model runs so cut: one that reads its
    vocabulary size elsewhere (a reshape by ``config.vocab_size``) keeps the whole vocabulary. The dtype is
    float64 where the model runs in it, else float32 (some kernels, such as grouped expert matmuls, have none).
    """
    vocabulary = _vocabulary_candidate(module, model_map, inputs, tp)
    if vocabulary is not None:
        sample = inputs % vocabulary.rows
        for dtype in (torch.float64, torch.float32):
            try:
                model_copy = small_copy(module, model_map.blocks, device, dtype, vocabulary=vocabulary)
                logits, _, _ = first_tensor(run_model(model_copy, _as(sample, device, dtype)))
            except Exception:  # noqa: BLE001 - a dtype without kernels, or whatever the cut model raises
                continue
            if model_map.head is None or logits.shape[-1] == vocabulary.rows:
                return vocabulary, sample, dtype
            break
    return None, inputs, _dtype_that_runs(module, model_map, inputs, device)


def _vocabulary_candidate(module: nn.Module, model_map: ModelMap, inputs: Tensor, tp: int) -> Vocabulary | None:
    if inputs.is_floating_point() or model_map.embedding is None:
        return None
    table = module.get_submodule(model_map.embedding)
    if not isinstance(table, nn.Embedding):
        return None
    rows = _VOCABULARY_ROWS_PER_RANK * tp + table.num_embeddings % tp
    return Vocabulary.to_cut(module, model_map.embedding, model_map.head, rows)


def _dtype_that_runs(module: nn.Module, model_map: ModelMap, inputs: Tensor, device: torch.device) -> torch.dtype:
    """float64 where the whole model runs in it, else float32."""
    try:
        model_copy = small_copy(module, model_map.blocks, device, torch.float64)
        run_model(model_copy, _as(inputs, device, torch.float64))
        return torch.float64
    except RuntimeError:
        return torch.float32


def _as(inputs: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    inputs = inputs.to(device)
    return inputs.to(dtype) if inputs.is_floating_point() else inputs


def _run(module: nn.Module, mesh: ParallelMesh, model_map: ModelMap, inputs: Tensor, *, dtype: torch.dtype,
         sequence_parallel: bool, loss_parallel: bool, apply: Callable[..., nn.Module],
         vocabulary: Vocabulary | None) -> _Outcome:
    device = torch.device(mesh.device_type)
    model_copy = small_copy(module, model_map.blocks, device, dtype, vocabulary=vocabulary)
    regions = _regions(model_copy, model_map)
    inputs = _as(inputs, device, dtype)
    def run(record: dict[str, Tensor], stack: list[str], settle: Callable[[], None] = lambda: None) -> Tensor:
        handles = []
        for name, sub in model_copy.named_modules():
            if not name:
                continue
            handles.append(sub.register_forward_pre_hook(
                lambda m, a, k, n=name: _enter(stack, n, record, a, k, regions), with_kwargs=True))
            handles.append(sub.register_forward_hook(lambda m, a, o, n=name: _leave(stack, n, record, o, regions)))
        try:
            logits, _, _ = first_tensor(run_model(model_copy, inputs))
        finally:
            for handle in handles:
                handle.remove()
        whole = logits.full_tensor() if isinstance(logits, DTensor) else logits
        seed = torch.Generator(device="cpu").manual_seed(0)  # the same cotangent for both runs
        cotangent = torch.randn(whole.shape, generator=seed, dtype=whole.dtype).to(whole.device)
        (whole * cotangent).sum().backward()
        settle()
        record["logits"] = whole.detach()
        return whole

    expected: dict[str, Tensor] = {}
    run(expected, [])
    expected_grads = {clean_name(n): p.grad.detach().clone() for n, p in model_copy.named_parameters()
                      if p.grad is not None}
    model_copy.zero_grad(set_to_none=True)

    group = mesh.group("tp")
    actual: dict[str, Tensor] = {}
    stack: list[str] = []
    outcome = _Outcome()
    # Sizes that do not split raise here, with a message that already says what would fit.
    apply(model_copy, mesh, model_map, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    from lightning_par.parallel.tensor import routed_on_local_tokens, sum_over_tensor_parallel

    # Layers that route this rank's piece of the sequence under sequence parallel are left whole: what they hold is
    # compared through their output and the gradients, not region by region.
    local = [name for name, sub in model_copy.named_modules() if sub in routed_on_local_tokens(model_copy)]
    regions = [r for r in regions if not any(r.startswith(name + ".") for name in local)]
    expected = {key: value for key, value in expected.items() if key.removeprefix("grad:") in regions
                or key == "logits"}

    def settle() -> None:  # what a training step does after backward: layers that routed a piece sum over tp
        if sequence_parallel:
            sum_over_tensor_parallel(model_copy, mesh)

    try:
        run(actual, stack, settle)
    except Exception as error:  # noqa: BLE001 - what the split model raises is the reason it is refused
        innermost = stack[-1] if stack else None
        region = next((n for n in reversed(stack) if n in regions), None)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        outcome = _Outcome(region=region, module=innermost, reason=f"it raises {type(error).__name__}: {first_line}")
    if outcome.reason is None:
        outcome = _compare(model_copy, expected, actual, expected_grads, regions, group)
    return _agree(outcome, group)


def _gradient_culprit(expected: dict[str, Tensor], actual: dict[str, Tensor], regions: list[str]) -> str | None:
    """The region closest to the output whose input received a different gradient: gradients flow backwards,
    so the regions before it only inherit the difference."""
    wrong = [r for r in regions if f"grad:{r}" in expected and not _close(actual.get(f"grad:{r}"),
                                                                           expected[f"grad:{r}"])]
    return wrong[-1] if wrong else None


def _enter(stack: list[str], name: str, record: dict[str, Tensor], args: tuple, kwargs: dict,
           regions: list[str]) -> tuple[tuple, dict] | None:
    """Push ``name``; for a region, keep the gradient its own input receives (``grad:<region>``). The input is
    handed on as an alias, so that a tensor two regions share (a parallel residual) gives each its own part."""
    stack.append(name)
    if name not in regions or f"grad:{name}" in record:
        return None

    def keep(grad: Tensor) -> None:
        record.setdefault(f"grad:{name}", (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone())

    for index, value in enumerate(args):
        if isinstance(value, Tensor) and value.requires_grad:
            alias = value.view_as(value)
            alias.register_hook(keep)
            return (*args[:index], alias, *args[index + 1:]), kwargs
    for key, value in kwargs.items():
        if isinstance(value, Tensor) and value.requires_grad:
            alias = value.view_as(value)
            alias.register_hook(keep)
            return args, {**kwargs, key: alias}
    return None


def _leave(stack: list[str], name: str, record: dict[str, Tensor], output: Any, regions: list[str]) -> None:
    if stack and stack[-1] == name:
        stack.pop()
    if name in regions and name not in record:
        tensor, _, _ = first_tensor(output)
        if tensor is not None:
            record[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _compare(model_copy: nn.Module, expected: dict[str, Tensor], actual: dict[str, Tensor],
             expected_grads: dict[str, Tensor], regions: list[str], group: dist.ProcessGroup) -> _Outcome:
    for name in sorted(set(expected) & set(actual)):
        actual[name] = _whole(actual[name], expected[name], group)
    for name in [*regions, "logits"]:
        if name in expected and not _close(actual.get(name), expected[name]):
            error = _error(actual.get(name), expected[name])
            return _Outcome(region=name if name != "logits" else None, module=name,
                            reason=f"its output differs from the whole model's by {error:.1e} relative")
    culprit = _gradient_culprit(expected, actual, regions)
    if culprit is not None:
        return _Outcome(region=culprit, module=culprit,
                        reason=f"the gradient it passes back to its input differs by "
                               f"{_error(actual.get(f'grad:{culprit}'), expected[f'grad:{culprit}']):.1e} relative "
                               "(a whole tensor in it is used by the split heads only)")
    partial: list[str] = []
    # Gradients that are zero in exact arithmetic (a key bias: softmax ignores a constant added to every key)
    # are rounding noise on both sides: compare them against the size of the gradients, not their own.
    floor = 1e-6 * max((g.abs().max().item() for g in expected_grads.values()), default=0.0)
    regrouped = regrouped_parameters(model_copy)
    for name, parameter in model_copy.named_parameters():
        name = clean_name(name)
        grad = parameter.grad
        want = expected_grads.get(name)
        if grad is None or want is None:
            if (grad is None) != (want is None):
                return _Outcome(module=name, reason=f"the gradient of {name!r} is missing on one side")
            continue
        if isinstance(grad, DTensor):
            got = grad.full_tensor()
            if name in regrouped:  # rows in the order the whole model has them
                dim, order = regrouped[name]
                got = got.index_select(dim, torch.argsort(order).to(got.device))
        else:
            got = grad.detach().clone()
            summed = got.clone()
            dist.all_reduce(summed, group=group)  # every rank, every plain gradient: the same collectives
            if not _close(got, want, floor) and _close(summed, want, floor):
                partial.append(name.rpartition(".")[0])
                continue
        if not _close(got, want, floor):
            owner = name.rpartition(".")[0]
            region = next((r for r in regions if owner == r or owner.startswith(r + ".")), None)
            return _Outcome(region=region, module=owner,
                            reason=f"the gradient of {name!r} differs by {_error(got, want, floor):.1e} relative")
    return _Outcome(partial=tuple(dict.fromkeys(partial)))


def _whole(actual: Any, expected: Tensor, group: dist.ProcessGroup) -> Any:
    """``actual`` made whole where it is this rank's slice of ``expected``'s features: the output of a region that
    ends in column-wise split layers (BERT's self-attention, whose output projection is a module of its own), or
    the gradient of the next region's input."""
    tp = dist.get_world_size(group)
    if (not isinstance(actual, Tensor) or isinstance(actual, DTensor) or tp == 1 or actual.dim() == 0
            or actual.dim() != expected.dim()
            or actual.shape[:-1] != expected.shape[:-1] or actual.shape[-1] * tp != expected.shape[-1]):
        return actual
    pieces = [torch.empty_like(actual) for _ in range(tp)]
    dist.all_gather(pieces, actual.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def _agree(outcome: _Outcome, group: dist.ProcessGroup) -> _Outcome:
    """Every tensor-parallel rank takes the same decision: the first rank's that found a difference."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, outcome, group=group)
    return next((o for o in everyone if not o.ok), outcome)


def _close(actual: Tensor | None, expected: Tensor, floor: float = 0.0) -> bool:
    return (actual is not None and actual.shape == expected.shape
            and _error(actual, expected, floor) <= _RTOL[expected.dtype])


def _error(actual: Tensor | None, expected: Tensor, floor: float = 0.0) -> float:
    """The largest difference relative to the largest expected value (or to ``floor``, if larger)."""
    if actual is None or actual.shape != expected.shape:
        return float("inf")
    scale = max(float(expected.abs().max()), floor, 1e-30)
    return float((actual.to(expected.dtype) - expected).abs().max()) / scale


__all__ = ["check_model_map"]
