"""``lightning-par plan``: rank the layouts of a LightningCLI config on a cluster, without starting anything.

    lightning-par plan --config configs/zero3.yaml --nodes 8 --devices-per-node 8 --device h100-80gb \\
        --model llama3-70b --global-batch-size 1024 --seq-len 4096
    lightning-par plan --model llama3-70b --nodes 8 --device h100-80gb --global-batch-size 1024 --seq-len 4096 \\
        --tp 8 --pp 4 --zero-stage 1
    lightning-par plan --published

The YAML gives the model (``model.init_args``: the reference ``LlamaLM`` arguments, read as a
``LlamaConfig``), the batch (``data.init_args.batch_size`` sequences per data-parallel rank and ``seq_len``),
the devices (``trainer.devices``, ``trainer.num_nodes``), the precision and any sizes already chosen in
``trainer.strategy.init_args`` (``tensor_parallel_size: 8`` is kept; ``"auto"`` or absent is searched).
Options override the YAML; ``--model`` replaces its model by a published architecture. ``--tp 8 --pp 16 ...`` fix
sizes and knobs on the command line, to cost a layout one has in mind (with ``--all`` also one this version cannot
compose).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from lightning_par.layout.config import CP_METHODS, PP_SCHEDULES, RECOMPUTE_MODES
from lightning_par.planner.cluster import DEVICE_PRESETS, ClusterSpec
from lightning_par.planner.memory import LIGHTNING_PRECISIONS
from lightning_par.planner.model import MODEL_PRESETS, ModelSpec, parameter_count
from lightning_par.planner.report import explain, format_table
from lightning_par.planner.runtime import plan_for_run
from lightning_par.planner.search import TrainingSpec, normalize_fixed, plan_layouts
from lightning_par.planner.sensitivity import cluster_sensitivity, residual_sensitivity

# Strategy arguments that fix a size or the ZeRO stage.
FIXED_ARGUMENTS = ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                   "expert_parallel_size", "replicate_size", "zero_stage")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-par plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="LightningCLI YAML (model, data, trainer, strategy)")
    parser.add_argument("--nodes", type=_positive, help="number of nodes (default: trainer.num_nodes, or 1)")
    parser.add_argument("--devices-per-node", type=_positive,
                        help="devices per node (default: trainer.devices, or 8)")
    parser.add_argument("--device", choices=sorted(DEVICE_PRESETS),
                        help="device preset (default: cpu for accelerator: cpu, else h100-80gb)")
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), help="a published architecture instead of the "
                        "YAML's model")
    parser.add_argument("--global-batch-size", type=int, help="sequences per optimizer step (default: "
                        "data.batch_size x devices x accumulate_grad_batches)")
    parser.add_argument("--microbatch-size", type=int, nargs="+",
                        help="sequences per micro-batch per data-parallel rank (several values: let the planner "
                             "choose; default 1). Without it and --global-batch-size, a YAML's data.batch_size is "
                             "the batch of every data-parallel rank, as the auto_parallel strategy plans it")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: data.seq_len)")
    parser.add_argument("--precision", help="32-true, bf16-mixed or bf16-true (default: trainer.precision, "
                        "else 32-true on the cpu preset and bf16-mixed on accelerators)")
    parser.add_argument("--compile", action="store_true", default=None,
                        help="blocks under torch.compile (default: the strategy's compile in --config)")
    parser.add_argument("--float8", action="store_true", default=None, help="the blocks' linear layers in float8 at "
                        "the device's float8 peak (default: the strategy's float8 in --config, unless emulated)")
    fix = parser.add_argument_group("fixed sizes and knobs (the rest is searched; they override the YAML's)")
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert"),
                       ("dp", "data (replicate x shard)"), ("dp-replicate", "replicated data"),
                       ("dp-shard", "sharded data")):
        fix.add_argument(f"--{name}", type=_positive, help=f"{what}-parallel size")
    fix.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    fix.add_argument("--pp-schedule", choices=PP_SCHEDULES)
    fix.add_argument("--cp-method", choices=CP_METHODS)
    fix.add_argument("--activation-checkpointing", choices=RECOMPUTE_MODES)
    fix.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    fix.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--check", type=_positive, nargs="?", const=3, metavar="K",
                        help="dry-run the first K layouts that fit (default 3) with the config's model and data, and "
                             "print each pipeline rank's planned memory beside the dry run's (lightning-par check)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="plan again with each rough cluster figure (NVLink bus efficiency, attention efficiency, "
                             "usable memory) a quarter lower and higher, and print the pick each time")
    parser.add_argument("--published", action="store_true",
                        help="print the published runs the model is held to: each row's ratio in sample, left out "
                             "alone and left out with its source, the fitted constants, and the spread over each "
                             "row's open choices (docs/planner.md, Published runs), then exit")
    parser.add_argument("--all", action="store_true", help="rank every layout the cost model understands, not only "
                        "those this version of lightning_par composes")
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _section(config: dict, name: str) -> dict:
    value = config.get(name) or {}
    if isinstance(value, dict) and "init_args" in value:
        return value.get("init_args") or {}
    return value if isinstance(value, dict) else {}


def model_from_yaml(config: dict) -> ModelSpec:
    """The ``model.init_args`` of a LlamaLM config as a :class:`ModelSpec`, through ``LlamaConfig``'s rules
    (defaults, GQA, the SwiGLU hidden size)."""
    from lightning_par.models.llama import LlamaConfig  # imports torch: only when a YAML model is read

    args = _section(config, "model")
    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    llama = LlamaConfig(**{k: v for k, v in args.items() if k in known})
    llama.validate()
    class_path = (config.get("model") or {}).get("class_path", "LlamaLM") if isinstance(config.get("model"), dict) \
        else "LlamaLM"
    name = f"{class_path.rpartition('.')[2]}(dim={llama.dim}, n_layers={llama.n_layers})"
    return ModelSpec.from_llama_config(llama, name=name)


def fixed_from_yaml(config: dict) -> dict[str, Any]:
    """Sizes already chosen in ``trainer.strategy.init_args``."""
    strategy = (config.get("trainer") or {}).get("strategy")
    if not isinstance(strategy, dict):
        return {}  # a registered name ("zero3") or nothing: every size is open
    args = strategy.get("init_args") or {}
    return {k: v for k, v in args.items() if k in FIXED_ARGUMENTS and v not in (None, "auto")}


def _speed_options(config: dict, options: argparse.Namespace) -> dict[str, bool]:
    """``compiled`` and ``float8`` for the time model: the flags, else the strategy's arguments in the YAML (emulated
    float8 multiplies at the high-precision rate)."""
    strategy = (config.get("trainer") or {}).get("strategy")
    args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    compiled = options.compile if options.compile is not None else bool(args.get("compile"))
    float8 = (options.float8 if options.float8 is not None
              else args.get("float8") is not None and not args.get("float8_emulate"))
    return {"compiled": compiled, "float8": float8}


FIXED_OPTIONS = ("tp", "pp", "cp", "ep", "dp", "dp_replicate", "dp_shard", "zero_stage", "pp_schedule", "cp_method",
                 "activation_checkpointing", "sequence_parallel", "loss_parallel")


def fixed_from_options(options: argparse.Namespace) -> dict[str, Any]:
    """The sizes and knobs fixed on the command line (``--tp 8`` -> ``{"tp": 8}``)."""
    return {name: getattr(options, name) for name in FIXED_OPTIONS if getattr(options, name) is not None}


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (without the program name; default ``sys.argv[1:]``; a leading ``plan`` is skipped), plan
    and print."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        argv = argv[1:]
    options = _parser().parse_args(argv)
    if options.published:
        from lightning_par.planner.published_report import published_report

        print(published_report())
        return
    config: dict = {}
    if options.config is not None:
        import yaml

        config = yaml.safe_load(options.config.read_text()) or {}
    trainer, data = config.get("trainer") or {}, _section(config, "data")

    devices_per_node = options.devices_per_node or _int(trainer.get("devices"), 8)
    nodes = options.nodes or _int(trainer.get("num_nodes"), 1)
    device = options.device or ("cpu" if trainer.get("accelerator") == "cpu" else "h100-80gb")
    cluster = ClusterSpec.from_preset(device, nodes=nodes, devices_per_node=devices_per_node)

    if options.model:
        model = ModelSpec.preset(options.model)
    elif config.get("model"):
        model = model_from_yaml(config)
    else:
        raise SystemExit("lightning-par plan: give --model or a --config with a model section")
    seq_len = options.seq_len or _int(data.get("seq_len"), 0)
    if not seq_len:
        raise SystemExit("lightning-par plan: give --seq-len or a --config with data.init_args.seq_len")
    accumulate = _int(trainer.get("accumulate_grad_batches"), 1)
    global_batch = options.global_batch_size or _int(data.get("batch_size"), 1) * cluster.world_size * accumulate
    # Lightning's own default is 32-true; on accelerators the planner assumes the usual bf16-mixed instead.
    default_precision = "32-true" if device == "cpu" else "bf16-mixed"
    raw_precision = str(options.precision or trainer.get("precision") or default_precision)
    if raw_precision not in LIGHTNING_PRECISIONS:
        raise SystemExit(f"lightning-par plan: precision {raw_precision!r} is not one of {sorted(LIGHTNING_PRECISIONS)}")
    precision = LIGHTNING_PRECISIONS[raw_precision]
    try:
        fixed = {**normalize_fixed(fixed_from_yaml(config)), **fixed_from_options(options)}
    except ValueError as error:
        raise SystemExit(f"lightning-par plan: {error}") from None
    speed = _speed_options(config, options)
    composable = (lambda c: True) if options.all else None
    per_rank = _int(data.get("batch_size"), 0)
    # The loader's batch per data-parallel rank, as Lightning (and the auto_parallel strategy) runs it: the global
    # batch then grows with the data-parallel size.
    loader_batch = per_rank and options.global_batch_size is None and options.microbatch_size is None
    if options.check and not (options.config is not None and config.get("model") and not options.model
                              and loader_batch):
        raise SystemExit("lightning-par plan: --check dry-runs the config's own model on its loader's batch: give "
                         "--config with a model and a data section, without --model, --global-batch-size or "
                         "--microbatch-size")
    batch_text = (f"{per_rank} sequences per data-parallel rank" if loader_batch
                  else f"{global_batch} sequences per step")
    print(f"Planning {model.name} ({parameter_count(model.total_params)} parameters) on {cluster.nodes} x "
          f"{cluster.devices_per_node} {cluster.name}: {batch_text} x {seq_len} tokens, {precision}"
          + "".join(f", {name}" for name, on in speed.items() if on) + (f", fixed {fixed}" if fixed else ""))
    try:
        if loader_batch:
            candidates = plan_for_run(model, cluster, batch_size_per_rank=per_rank, seq_len=seq_len,
                                      precision=precision, accumulate_grad_batches=accumulate, fixed=fixed,
                                      composable=composable, training_options=speed)
        else:
            training = TrainingSpec(global_batch_size=global_batch, seq_len=seq_len,
                                    microbatch_size=tuple(options.microbatch_size or [1]), precision=precision,
                                    **speed)
            candidates = plan_layouts(model, cluster, training, fixed=fixed, composable=composable)
    except ValueError as error:
        raise SystemExit(f"lightning-par plan: {error}") from None
    print(format_table(candidates, top=options.top))
    print(explain(candidates))
    hinge = residual_sensitivity(candidates)
    if hinge:
        print(hinge)
    if options.sensitivity and not loader_batch:
        print(cluster_sensitivity(lambda changed: plan_layouts(model, changed, training, fixed=fixed,
                                                               composable=composable), cluster))
    if options.check:
        from lightning_par.cli.plan_check import check_candidates  # runs the strategies: Lightning's layer

        print(check_candidates(options.config, [c for c in candidates if c.fits][:options.check], cluster.world_size))
    if device == "cpu":
        print("Note: the cpu preset's peak and bandwidths are rough figures, not measured on this machine, so its "
              "times and tokens/s are far from a run's; the auto_parallel strategy with calibrate: true measures them "
              "before it plans (docs/planner.md).")


__all__ = ["fixed_from_options", "fixed_from_yaml", "main", "model_from_yaml"]
