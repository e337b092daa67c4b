"""Which pairs of techniques compose in one layout: every pair of the features below, as a ``ParallelConfig``,
through ``check_composable`` (what the strategies and ``parallelize`` ask before any collective).

    python docs/composition_matrix.py            # the tables of docs/hybrid3d.md
    python docs/composition_matrix.py --refused  # only the pairs refused, with the reason
    python docs/composition_matrix.py --holders  # every pair with all the layouts that hold it

Two features that set the same knob to different values (two pipeline schedules, two ZeRO stages) are
alternatives, not a pair, and are left out. ``tests/test_compositions.py`` holds the result to this table.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

#: Each feature as the ``ParallelConfig`` fields that turn it on, at the smallest sizes.
FEATURES: dict[str, dict[str, Any]] = {
    "tp": dict(tp=2),
    "tp+SP": dict(tp=2, sequence_parallel=True),
    "tp+LP": dict(tp=2, loss_parallel=True),
    "pp 1F1B": dict(pp=2, pp_schedule="1f1b"),
    "pp ZB-V": dict(pp=2, pp_schedule="zbv"),
    "pp DualPipeV": dict(pp=2, pp_schedule="dualpipev"),
    "cp Ulysses": dict(cp=2, cp_method="ulysses"),
    "cp ring": dict(cp=2, cp_method="ring"),
    "ep": dict(ep=2),
    "HSDP": dict(dp_replicate=2, zero_stage=3),
    "ZeRO-1": dict(zero_stage=1),
    "ZeRO-2": dict(zero_stage=2),
    "ZeRO-3": dict(zero_stage=3),
    "sharded accumulation": dict(zero_stage=3, sharded_accumulation=True),
    "compile": dict(compile=True),
    "float8": dict(float8="tensorwise"),
    "async TP": dict(tp=2, sequence_parallel=True, compile=True, async_tp=True),
    "CPU offload": dict(zero_stage=3, cpu_offload=True),
    "full recomputation": dict(activation_checkpointing="full"),
}


#: Layouts trained against one process (``tests/test_compositions.py::test_every_pair_trains_like_one_process``:
#: loss and weights within 1e-5 over 8 optimizer steps, accumulation 2, clipping), on 4 or 8 ranks each, with the
#: MoE model (4 experts, top 2, capacity 1.0; 4 blocks where a V schedule puts two stages on a rank). Together they
#: hold every pair of features that composes but those of :data:`NOT_ON_CPU`, each at 2 ranks or more in every
#: dimension the pair works across (:func:`dimensions`). ``tp+SP+LP`` stands for ``tp``, ``tp+SP`` and ``tp+LP``;
#: ZeRO-3 comes with sharded accumulation and CPU offload (a no-op on a CPU, where everything already lives in host
#: memory). A ZeRO stage shards over ``dp_shard x cp``, so a layout without context parallel needs ``dp_shard=2`` to
#: prove one. Experts split over the context-parallel ranks where there are any. Full recomputation in as many as
#: pair it with every other feature.
_TP = dict(tp=2, sequence_parallel=True, loss_parallel=True)
_ZERO3 = dict(zero_stage=3, sharded_accumulation=True, cpu_offload=True)
_HSDP = dict(dp_replicate=2, dp_shard=1, **_ZERO3)  # sharded over the context-parallel ranks, or dp_shard=2


_RECOMPUTE = dict(activation_checkpointing="full")


def _layout(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    layout: dict[str, Any] = dict(model="moe", dp_shard=1)
    for part in (*parts, fields):
        layout.update(part)
    if layout.get("cp", 1) > 1:
        layout["ep"] = 2
    if layout.get("pp", 1) > 1:  # DualPipeV runs 2 x pp micro-batches at least
        layout["microbatches"] = 4 if layout["pp_schedule"] == "dualpipev" else 2
    if layout.get("pp_schedule") in ("zbv", "dualpipev"):
        layout["model"] += "-4-blocks"
    return layout


LAYOUTS: dict[str, dict[str, Any]] = {
    # pipeline x context parallel: every schedule with every method, each with one ZeRO stage (over the cp ranks)
    "A1": _layout(_RECOMPUTE, pp=2, cp=2, pp_schedule="1f1b", cp_method="ulysses", zero_stage=1),
    "A2": _layout(pp=2, cp=2, pp_schedule="1f1b", cp_method="ring", zero_stage=2),
    "A3": _layout(_ZERO3, pp=2, cp=2, pp_schedule="zbv", cp_method="ulysses"),
    "A4": _layout(_RECOMPUTE, pp=2, cp=2, pp_schedule="zbv", cp_method="ring", zero_stage=1),
    "A5": _layout(pp=2, cp=2, pp_schedule="dualpipev", cp_method="ulysses", zero_stage=2),
    "A6": _layout(_RECOMPUTE, _ZERO3, pp=2, cp=2, pp_schedule="dualpipev", cp_method="ring"),
    # pipeline x tensor parallel (+SP +LP): every schedule; ZeRO-1 over dp_shard=2 (8 ranks) in B3, while B1's and
    # B2's stages, over one rank, shard nothing (C1, C2, D1 and D4 prove those pairs)
    "B1": _layout(_TP, _ZERO3, pp=2, pp_schedule="1f1b"),
    "B2": _layout(_RECOMPUTE, _TP, pp=2, pp_schedule="zbv", zero_stage=2),
    "B3": _layout(_TP, pp=2, dp_shard=2, pp_schedule="dualpipev", zero_stage=1),
    # context x tensor parallel (+SP +LP), experts on each tp rank's piece of each chunk
    "C1": _layout(_TP, cp=2, cp_method="ulysses", zero_stage=2),
    "C2": _layout(_TP, _ZERO3, cp=2, cp_method="ring"),
    # HSDP (two replicas, ZeRO-3 inside each) with each of the others: sharded over the cp ranks, else over
    # dp_shard=2 (8 ranks)
    "D1": _layout(_RECOMPUTE, _HSDP, _TP, dp_shard=2),
    "D2": _layout(_HSDP, cp=2, cp_method="ulysses"),
    "D3": _layout(_HSDP, cp=2, cp_method="ring"),
    "D4": _layout(_HSDP, dp_shard=2, pp=2, pp_schedule="1f1b"),
    "D5": _layout(_HSDP, dp_shard=2, pp=2, pp_schedule="zbv"),
    # compiled blocks with each of the others
    "E1": _layout(_RECOMPUTE, compile=True, pp=2, cp=2, pp_schedule="1f1b", cp_method="ulysses", zero_stage=1),
    "E2": _layout(_RECOMPUTE, _TP, compile=True, pp=2, pp_schedule="zbv", zero_stage=2),
    "E3": _layout(_RECOMPUTE, _HSDP, compile=True, cp=2, cp_method="ring"),
    "E4": _layout(_RECOMPUTE, compile=True, pp=2, dp_shard=2, ep=2, pp_schedule="dualpipev", zero_stage=2),
    # float8 (emulated on a CPU) against one float8 process multiplying the same pieces of each batch: tensorwise
    # with each of the others but context parallel (HSDP with DualPipeV in F3); rowwise, whose scales are per token
    # and per output channel and so do not depend on how context parallel cuts the sequence, with it
    "F1": _layout(_RECOMPUTE, _TP, float8="tensorwise", pp=2, dp_shard=2, pp_schedule="1f1b", zero_stage=1),
    "F2": _layout(float8="tensorwise", pp=2, dp_shard=2, ep=2, pp_schedule="zbv", zero_stage=2),
    "F3": _layout(_HSDP, float8="tensorwise", dp_shard=2, pp=2, pp_schedule="dualpipev"),
    "F4": _layout(_RECOMPUTE, _TP, float8="rowwise", cp=2, cp_method="ulysses", compile=True),
    "F5": _layout(float8="rowwise", cp=2, dp_shard=2, cp_method="ring", zero_stage=3),
}

#: Features no CPU run can prove, and why: async TP overlaps through CUDA's symmetric memory (refused on every rank
#: elsewhere, ``tests/test_async_tp.py``); CPU offload moves states to host memory, where a CPU run already keeps
#: everything, so ``lightning_par.parallel.zero`` drops it there and a layout that sets it trains without it. No
#: layout is credited with them: their pairs are "unproven on CPU".
NOT_ON_CPU = {"async TP": "needs CUDA's symmetric memory (tests/test_async_tp.py)",
              "CPU offload": "dropped on a CPU run, where everything already lives in host memory"}
UNPROVEN = "unproven on CPU"


def layout_config(layout: dict[str, Any]) -> Any:
    """The ``ParallelConfig`` of a :data:`LAYOUTS` entry (its sizes resolved)."""
    from lightning_par.layout.config import ParallelConfig

    fields = {key: value for key, value in layout.items() if key != "model"}
    config = ParallelConfig(**fields)
    return config.validate(world_size(layout))


def world_size(layout: dict[str, Any]) -> int:
    sizes = [layout.get(name, 1) for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]
    return sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4]


#: The fields of :data:`FEATURES` that are sizes: a layout holds them at 2 ranks or more.
SIZES = ("tp", "pp", "cp", "ep", "dp_replicate")
#: The ranks ZeRO shards model states over: ``dp_shard x cp`` (``lightning_par.parallel.mesh``'s ``dp_shard_cp``, the mesh
#: of ``lightning_par.parallel.zero``; context-parallel ranks hold the same parameters and shard them too).
SHARD_RANKS = "dp_shard_cp"


def dimensions(feature: str) -> tuple[str, ...]:
    """The dimensions ``feature`` works across, each of which a layout must give 2 ranks or more to prove a pair
    with it: its sizes, and for a feature that sets a ZeRO stage (HSDP, sharded accumulation and CPU offload too)
    the ranks the stage shards over, since over one rank it shards nothing and the pair would go untested."""
    fields = FEATURES[feature]
    return tuple(key for key in SIZES if key in fields) + ((SHARD_RANKS,) if "zero_stage" in fields else ())


def ranks(config: Any, dimension: str) -> int:
    """How many ranks a resolved ``ParallelConfig`` gives ``dimension`` (one of :func:`dimensions`)."""
    if dimension == SHARD_RANKS:
        return config.dp_shard * config.cp
    return getattr(config, dimension)


def holds(layout: dict[str, Any], feature: str) -> bool:
    """Whether ``layout`` proves ``feature``: every field of the feature at its value, and every one of its
    :func:`dimensions` at 2 ranks or more."""
    config = layout_config(layout)
    if feature == "ep" and not layout["model"].startswith("moe"):
        return False  # nothing to split
    if any(ranks(config, dimension) < 2 for dimension in dimensions(feature)):
        return False
    if feature == "float8":  # either recipe (context parallel is proven with rowwise)
        return config.float8 is not None
    return all(getattr(config, key) == value for key, value in FEATURES[feature].items() if key not in SIZES)


def proofs() -> dict[tuple[str, str], list[str]]:
    """(feature, feature) -> the :data:`LAYOUTS` that hold both, for every pair of :func:`pairs`."""
    held = {name: {feature for feature in FEATURES if feature not in NOT_ON_CPU and holds(layout, feature)}
            for name, layout in LAYOUTS.items()}
    return {(first, second): [name for name, features in held.items() if {first, second} <= features]
            for first, second, _ in pairs()}


def pairs() -> list[tuple[str, str, dict[str, Any]]]:
    """Every pair of features whose fields do not contradict each other, with the fields together."""
    found = []
    for first, second in itertools.combinations(FEATURES, 2):
        a, b = FEATURES[first], FEATURES[second]
        if any(a[key] != b[key] for key in a.keys() & b.keys()):
            continue  # alternatives: the same knob set two ways
        found.append((first, second, {**a, **b}))
    return found


def refusal(fields: dict[str, Any]) -> str | None:
    """``check_composable``'s reason for refusing ``fields``, or None where they compose."""
    from lightning_par.layout.config import ParallelConfig

    try:
        ParallelConfig(**fields).check_composable()
    except ValueError as error:
        return str(error)
    return None


def matrix() -> dict[tuple[str, str], str | None]:
    """(feature, feature) -> the reason it is refused, or None; for every pair of :func:`pairs`."""
    return {(first, second): refusal(fields) for first, second, fields in pairs()}


def markdown(results: dict[tuple[str, str], str | None], proven: dict[tuple[str, str], list[str]]) -> str:
    """The matrix as a markdown table: one row and one column per feature. A cell names the first of
    :data:`LAYOUTS` that holds the pair (its parity test), ``unproven on CPU`` a pair with a feature of
    :data:`NOT_ON_CPU`, ``open`` a pair
    that composes with no layout holding it yet, ``✗`` a refused pair, ``·`` an alternative (or the feature
    itself)."""
    names = list(FEATURES)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in names:
        cells = []
        for column in names:
            key = (row, column) if (row, column) in results else (column, row)
            if key not in results:
                cells.append("·")
            elif results[key]:
                cells.append("✗")
            elif proven[key]:
                cells.append(proven[key][0])
            else:
                cells.append(UNPROVEN if set(key) & NOT_ON_CPU.keys() else "open")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def holders(results: dict[tuple[str, str], str | None], proven: dict[tuple[str, str], list[str]]) -> str:
    """One line per pair: every layout of :data:`LAYOUTS` that holds it, at 2 ranks or more in each dimension the
    pair works across (the table names only the first), or why none does."""
    lines = []
    for pair, reason in results.items():
        if reason:
            held = f"refused: {reason}"
        elif proven[pair]:
            held = ", ".join(proven[pair])
        else:
            held = UNPROVEN if set(pair) & NOT_ON_CPU.keys() else "open"
        lines.append(f"{pair[0]} x {pair[1]}: {held}")
    return "\n".join(lines)


def layouts_markdown() -> str:
    """:data:`LAYOUTS` as a markdown table: name, ranks, model and the config's fields."""
    lines = ["| layout | ranks | model | ParallelConfig |", "|---|---|---|---|"]
    for name, layout in LAYOUTS.items():
        fields = ", ".join(f"{key}={value!r}" for key, value in layout.items() if key != "model")
        lines.append(f"| {name} | {world_size(layout)} | {layout['model']} | `{fields}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refused", action="store_true", help="only the refused pairs, with the reason")
    parser.add_argument("--holders", action="store_true", help="every pair with all the layouts that hold it")
    args = parser.parse_args(argv)
    results = matrix()
    refused = {pair: reason for pair, reason in results.items() if reason}
    if args.refused:
        for (first, second), reason in refused.items():
            print(f"{first} x {second}: {reason}")
        return
    proven = proofs()
    if args.holders:
        print(holders(results, proven))
        return
    print(markdown(results, proven))
    held = sum(1 for pair, layouts in proven.items() if layouts)
    print(f"\n{len(results) - len(refused)} of {len(results)} pairs compose, {len(refused)} are refused; "
          f"{held} are held by a layout trained against one process\n")
    print(layouts_markdown())


if __name__ == "__main__":
    main()
