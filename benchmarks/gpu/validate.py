"""One-GPU validation of lightning-par: throughput, MFU, peak memory against the planner, BubbleMeter on CUDA.

    python benchmarks/gpu/validate.py [--out gpu_results.json] [--budget-s 450] [--phases plain lightning ...]
                                      [--dim 2048 --layers 16 --heads 16 --vocab 50304 --seq-len 2048
                                       --batch-size 8 --warmup 3 --steps 15] [--peak-tflops 989]
    python benchmarks/gpu/validate.py --smoke       # tiny model, 2 timed steps, CPU + gloo: tests the logic

Run from the repository root; no ``pip install -e .`` and no download needed (the repository root is put on
``sys.path``). Every phase runs in a process of its own (a fresh interpreter on the GPU; a fork of this one in
``--smoke``), so process groups, ports, CUDA memory statistics and compile caches never leak from one phase to
the next, and a phase that crashes or runs out of memory costs only its own row. Phases run in priority order
within ``--budget-s`` seconds (the whole script, start-up included); one that no longer fits is skipped and
says so. Each phase's figures are printed as soon as it ends and ``--out`` is rewritten after every phase, so a
run cut short still leaves what it measured. Each phase's own output goes to ``<out>_logs/<phase>.log``.

Phases (all train the reference Llama decoder of ``lightning_par.models`` on synthetic tokens, bf16 autocast
over fp32 weights: Lightning's ``bf16-mixed``; AdamW ``foreach`` with LlamaLM's hyper-parameters):

- ``device``: GPU, versions, the peak FLOP/s MFU is relative to and where it comes from, a measured bf16 matmul.
- ``plain`` / ``plain_compile`` / ``plain_float8``: a hand-written PyTorch loop; compile is per decoder block
  (``--plain-compile-scope model``: the whole model); float8 (torchao, tensorwise scaling, block linears only,
  compiled blocks) only if torchao imports and the GPU has float8 tensor cores.
- ``lightning`` / ``lightning_compile``: ``Trainer(accelerator="gpu", devices=1, precision="bf16-mixed")`` with
  Lightning's own default strategy (SingleDeviceStrategy), blocks compiled as above.
- ``lightning_fsdp``: Lightning's ``FSDPStrategy`` (FSDP1, one unit per block) at world size 1 (CUDA only).
- ``lp_data_parallel``, ``lp_zero3``, ``lp_hybrid3d``: lightning-par strategies at world size 1 (NCCL on CUDA,
  gloo on CPU), every size 1; ``lp_data_parallel_compile`` and ``lp_zero3_compile`` with the strategies' own
  ``compile=True`` (each block compiled in place after sharding).
- ``bubble``: ``parallel/pipeline/bubble.py``'s BubbleMeter on a real pipeline at world size 1 (lightning-par's
  ``PipelineRunner``, interleaved 1F1B, two stages on the one rank; CUDA events on the GPU), and the event timing
  alone on a known workload, checked against host timing.

MFU = tokens/s x FLOPs per token / peak FLOP/s, with the project's formula (``llama_flops_per_token``, the one
``callbacks/throughput.py``'s ThroughputMonitor uses): ``6 N + 12 L d T``, N the matmul weights a token goes
through (blocks and lm_head, not the embedding), the second term attention scores and values (PaLM, app. B).
The peak is ``--peak-tflops`` if given, else the planner's dense bf16 figure for an H100/H200
(``ClusterSpec.from_preset("h200-141gb")``: 989 TFLOP/s), else Lightning's table, else a measured matmul.
Lightning-run rows also carry what lightning-par's ThroughputMonitor itself logged, as a cross-check.

Memory: ``torch.cuda.max_memory_allocated`` of the phase's process against ``estimate_memory(...).total`` of
``lightning_par.planner`` for the same model, micro-batch, precision and layout (for lightning-par runs, the
strategy's own resolved ParallelConfig). On CPU (``--smoke``) the peak is the process's ru_maxrss, which is not
comparable with the prediction: the ratio only proves the plumbing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GiB = 1024**3
# A 1.01 B-parameter Llama (Llama-3.2-1B's depth and width, GPT-2's padded vocabulary, multi-head attention).
GPU_DEFAULTS = {"dim": 2048, "layers": 16, "heads": 16, "kv_heads": None, "vocab": 50304, "seq_len": 2048,
                "batch_size": 8, "warmup": 3, "steps": 15, "microbatches": 4}
SMOKE_DEFAULTS = {"dim": 64, "layers": 2, "heads": 4, "kv_heads": None, "vocab": 256, "seq_len": 64,
                  "batch_size": 4, "warmup": 1, "steps": 2, "microbatches": 4}


class PhaseSkipped(Exception):
    """Raised inside a phase that cannot run on this machine (the reason is reported, the run goes on)."""


class Phase(NamedTuple):  # not a dataclass: tests/test_docs.py loads this file without registering the module
    name: str
    kind: str  # device | plain | lightning | bubble
    label: str  # the row's name in the summary
    min_s: float  # on the GPU: skipped when less budget than this is left
    cap_s: float  # on the GPU: the phase's time limit
    compile: bool = False
    float8: bool = False
    strategy: str | None = None  # lightning: auto | fsdp | data_parallel | zero3 | hybrid3d
    cuda_only: bool = False


# In priority order: what a cut-short run must not miss comes first (the compiled runs take the longest).
PHASES = [
    Phase("device", "device", "device", 20, 90),
    Phase("plain", "plain", "plain PyTorch", 35, 150),
    Phase("lightning", "lightning", "Lightning (auto strategy)", 40, 150, strategy="auto"),
    Phase("lp_data_parallel", "lightning", "lightning-par data_parallel", 45, 150, strategy="data_parallel"),
    Phase("lp_zero3", "lightning", "lightning-par zero3 (FSDP2)", 45, 150, strategy="zero3"),
    Phase("lp_hybrid3d", "lightning", "lightning-par hybrid3d (1x1x1)", 45, 150, strategy="hybrid3d"),
    Phase("bubble", "bubble", "BubbleMeter", 30, 120),
    Phase("plain_compile", "plain", "plain PyTorch + compile", 90, 240, compile=True),
    Phase("lightning_compile", "lightning", "Lightning (auto) + compile", 90, 240, compile=True, strategy="auto"),
    Phase("lp_data_parallel_compile", "lightning", "lightning-par data_parallel + compile", 90, 240, compile=True,
          strategy="data_parallel"),
    Phase("lp_zero3_compile", "lightning", "lightning-par zero3 (FSDP2) + compile", 90, 240, compile=True,
          strategy="zero3"),
    Phase("plain_float8", "plain", "plain PyTorch + float8 + compile", 100, 240, compile=True, float8=True,
          cuda_only=True),
    # On a CPU (--smoke) float8 is emulated: the strategy's wiring is exercised, not float8's speed.
    Phase("lp_data_parallel_float8", "lightning", "lightning-par data_parallel + float8 + compile", 100, 240,
          compile=True, float8=True, strategy="data_parallel"),
    Phase("lightning_fsdp", "lightning", "Lightning FSDPStrategy", 45, 150, strategy="fsdp", cuda_only=True),
]
PHASE_NAMES = [p.name for p in PHASES]


# ============================================================================================ shared helpers
def model_kwargs(a: dict) -> dict:
    return {"vocab_size": a["vocab"], "dim": a["dim"], "n_layers": a["layers"], "n_heads": a["heads"],
            "n_kv_heads": a["kv_heads"], "max_seq_len": a["seq_len"]}


def llama_config(a: dict) -> Any:
    from lightning_par.models.llama import LlamaConfig

    return LlamaConfig(**model_kwargs(a))


def exact_parameter_count(a: dict) -> int:
    """Parameters of the reference model, built on the meta device (no memory, no compute)."""
    import torch

    from lightning_par.models.llama import Transformer

    with torch.device("meta"):
        return Transformer(llama_config(a)).num_parameters()


def flops_per_token(a: dict) -> int:
    from lightning_par.models.llama import llama_flops_per_token

    return llama_flops_per_token(llama_config(a), a["seq_len"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def device_of(a: dict):
    import torch

    return torch.device("cuda", 0) if a["cuda"] else torch.device("cpu")


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(a: dict, device) -> tuple[float, str]:
    """The per-device peak MFU is relative to, and where it comes from (same answer in every phase)."""
    import torch

    from lightning_par.planner import ClusterSpec

    if a.get("peak_tflops"):
        return a["peak_tflops"] * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return ClusterSpec.from_preset("cpu").flops("bf16-mixed"), "planner preset 'cpu' (nominal 1 TFLOP/s)"
    name = torch.cuda.get_device_name(device)
    for key, preset in (("h200", "h200-141gb"), ("h100", "h100-80gb"), ("a100", "a100-80gb")):
        if key in name.lower():
            return (ClusterSpec.from_preset(preset).flops("bf16-mixed"),
                    f"planner preset {preset!r} (dense bf16 data-sheet figure) for {name!r}")
    from lightning.fabric.utilities.throughput import get_available_flops

    table = get_available_flops(device, torch.bfloat16)
    if table:
        return float(table), f"Lightning's get_available_flops for {name!r}"
    from lightning_par.callbacks.throughput import measure_matmul_flops

    measured = measure_matmul_flops(device, torch.bfloat16, size=8192, repeats=10)
    return measured, f"measured 8192^3 bf16 matmul on {name!r}"


def configure_torch(a: dict) -> None:
    import torch

    torch.set_float32_matmul_precision("high")
    if not a["cuda"]:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    import torch._dynamo

    # 16 identical blocks compiled one by one must not hit the recompile limit (the knob's name changed over time).
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))


class RandomTokens:
    """Synthetic token ids, (seq_len + 1,) per sample, the same for every run (seeded by the index)."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        g = torch.Generator().manual_seed(i)
        return torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)


def loader(a: dict):
    import torch

    total = a["warmup"] + a["steps"]
    dataset = RandomTokens(a["batch_size"] * (total + 1), a["seq_len"], a["vocab"])
    return torch.utils.data.DataLoader(dataset, batch_size=a["batch_size"], shuffle=False, drop_last=True)


def compile_blocks(transformer, a: dict, scope: str = "blocks") -> str:
    """torch.compile the decoder blocks one by one (as torchtitan does), or the whole model (plain loop only)."""
    backend = a["compile_backend"]
    if scope == "model":
        transformer.compile(backend=backend)
        return f"whole model, backend={backend}"
    for block in transformer.layers.values():
        block.compile(backend=backend)
    return f"per block ({len(transformer.layers)} blocks), backend={backend}"


def predicted_memory(a: dict, parallel_config, precision: str = "bf16-mixed") -> dict:
    """The planner's per-rank memory (and step time, on the device preset) for this model and batch."""
    from lightning_par.planner import (
        ClusterSpec,
        ModelSpec,
        estimate_memory,
        estimate_step_time,
    )

    spec = ModelSpec.from_llama_config(llama_config(a))
    memory = estimate_memory(spec, parallel_config, seq_len=a["seq_len"], microbatch_size=a["batch_size"],
                             precision=precision)
    out = {"layout": parallel_config.describe(), "zero_stage": parallel_config.zero_stage,
           "param_dtype": parallel_config.param_dtype, "bytes": memory.as_dict()}
    try:
        preset = a["device_preset"] if a["cuda"] else "cpu"
        cluster = ClusterSpec.from_preset(preset, nodes=1, devices_per_node=1)
        step = estimate_step_time(spec, parallel_config, cluster, seq_len=a["seq_len"],
                                  microbatch_size=a["batch_size"], microbatches=1, precision=precision)
        out["step_time_s"] = step.total
        out["tokens_per_s"] = a["batch_size"] * a["seq_len"] / step.total
        out["step_time_preset"] = f"{preset} (compute_efficiency {cluster.compute_efficiency})"
    except Exception as error:  # noqa: BLE001 - the step-time model is a bonus: never lose the memory figure for it
        out["step_time_error"] = repr(error)
    return out


def default_parallel_config(**kwargs):
    from lightning_par.layout.config import ParallelConfig

    return ParallelConfig(**{"dp_shard": 1, **kwargs}).validate(1)


class Clock:
    """Ends of optimizer steps, device-synchronised; step k's time is end[k] - end[k - 1] (data loading included)."""

    def __init__(self, device) -> None:
        self.device, self.ends = device, []

    def mark(self) -> None:
        synchronize(self.device)
        self.ends.append(time.perf_counter())

    def summary(self, a: dict) -> dict:
        warmup, steps = a["warmup"], a["steps"]
        if len(self.ends) < warmup + steps:
            raise RuntimeError(f"only {len(self.ends)} steps ran, {warmup + steps} expected")
        timed = self.ends[warmup - 1:warmup + steps]  # the end of the last warm-up step opens the window
        times = [b - e for e, b in itertools.pairwise(timed)]
        tokens = a["batch_size"] * a["seq_len"]
        return {"step_times_s": times, "tokens_per_step": tokens, "timed_steps": len(times), "warmup_steps": warmup,
                "tokens_per_s": tokens * len(times) / (timed[-1] - timed[0]),
                "tokens_per_s_median_step": tokens / statistics.median(times)}


def memory_figures(device) -> dict:
    import torch

    if device.type == "cuda":
        return {"peak_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "peak_source": "torch.cuda.max_memory_allocated"}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if platform.system() == "Darwin" else 1024)
    return {"peak_bytes": rss, "peak_source": "ru_maxrss (CPU: process memory, not comparable with the planner)"}


def finish(a: dict, result: dict, device, prediction: dict) -> dict:
    peak, source = peak_flops(a, device)
    fpt = flops_per_token(a)
    result.update(memory_figures(device))
    result.update({"flops_per_token": fpt, "mfu_formula": "llama_flops_per_token: 6*N_matmul + 12*layers*dim*seq",
                   "peak_flops": peak, "peak_flops_source": source,
                   "mfu": result["tokens_per_s"] * fpt / peak, "predicted": prediction,
                   "predicted_bytes": prediction["bytes"]["total"]})
    result["memory_ratio"] = result["peak_bytes"] / result["predicted_bytes"]
    return result


# ============================================================================================== the phases
def run_device(a: dict, phase: Phase) -> dict:
    import lightning
    import torch

    import lightning_par  # noqa: F401  (registers the strategies, as every other phase does)

    device = device_of(a)
    out: dict[str, Any] = {"torch": torch.__version__, "lightning": lightning.__version__,
                           "python": platform.python_version(), "device_type": device.type,
                           "parameters": exact_parameter_count(a), "flops_per_token": flops_per_token(a),
                           "model": model_kwargs(a), "seq_len": a["seq_len"], "batch_size": a["batch_size"]}
    try:
        import torchao

        out["torchao"] = getattr(torchao, "__version__", "unknown")
    except Exception as error:  # noqa: BLE001 - a torchao that fails to import for any reason is reported
        out["torchao"] = None
        out["torchao_error"] = f"{type(error).__name__}: {error}"
    out["nccl_available"] = torch.distributed.is_nccl_available()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update({"name": props.name, "capability": list(torch.cuda.get_device_capability(device)),
                    "memory_bytes": props.total_memory, "cuda": torch.version.cuda,
                    "nccl": str(torch.cuda.nccl.version()) if out["nccl_available"] else None})
        from lightning.fabric.utilities.throughput import get_available_flops

        # What ThroughputMonitor would use when not given a peak (None: the name is not in Lightning's table,
        # and the monitor falls back to measuring a 1024^3 matmul).
        out["lightning_table_bf16_flops"] = get_available_flops(device, torch.bfloat16)
    from lightning_par.callbacks.throughput import measure_matmul_flops

    size = 8192 if device.type == "cuda" else 256
    out["measured_bf16_matmul_flops"] = measure_matmul_flops(device, torch.bfloat16, size=size, repeats=10)
    out["measured_matmul_size"] = size
    out["peak_flops"], out["peak_flops_source"] = peak_flops(a, device)
    out["measured_over_peak"] = out["measured_bf16_matmul_flops"] / out["peak_flops"]
    return out


def run_plain(a: dict, phase: Phase) -> dict:
    """A hand-written loop: fp32 weights, bf16 autocast, AdamW (foreach), the model's own loss."""
    import torch
    import torch.nn.functional as F

    from lightning_par.models.llama import Transformer

    device = device_of(a)
    notes = []
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(llama_config(a))
    print(f"model built: {model.num_parameters():,} parameters on {device}", flush=True)
    if phase.float8:
        convert_to_float8_training = float8_converter(device)

        def block_linear(module, fqn: str) -> bool:  # the head stays bf16, as torchtitan leaves the output layer
            return (isinstance(module, torch.nn.Linear) and fqn.startswith("layers.")
                    and module.in_features % 16 == 0 and module.out_features % 16 == 0)

        convert_to_float8_training(model, module_filter_fn=block_linear)
        notes.append("torchao float8 training (tensorwise scaling) on the block linears; lm_head in bf16; "
                     "MFU still relative to the bf16 peak; predicted memory is the planner's bf16-mixed figure")
    if phase.compile:
        notes.append("compiled " + compile_blocks(model, a, a["plain_compile_scope"]))
    # LlamaLM.configure_optimizers' AdamW: decay on matrices only, fused=False (foreach on CUDA).
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), fused=False)
    clock, losses = Clock(device), []
    batches = iter(loader(a))
    for _ in range(a["warmup"] + a["steps"]):
        batch = next(batches).to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        clock.mark()
    result = {"runner": "hand-written loop", "precision": "fp32 weights + torch.autocast(bf16) (= bf16-mixed)",
              "optimizer": "torch.optim.AdamW(fused=False): foreach", "compile": phase.compile,
              "float8": phase.float8, "notes": notes, "loss_first": float(losses[0]), "loss_last": float(losses[-1]),
              **clock.summary(a)}
    return finish(a, result, device, predicted_memory(a, default_parallel_config()))


def check_float8_gpu(device) -> None:
    """PhaseSkipped when this GPU has no float8 tensor cores."""
    import torch

    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise PhaseSkipped(f"float8 needs compute capability 8.9 or more, this GPU has {capability}")


def float8_converter(device) -> Callable:
    """torchao's ``convert_to_float8_training``, or PhaseSkipped saying why float8 cannot run here."""
    if device.type != "cuda":
        raise PhaseSkipped("float8 needs CUDA")
    check_float8_gpu(device)
    try:
        from torchao.float8 import convert_to_float8_training
    except Exception as error:
        raise PhaseSkipped(f"torchao.float8 does not import here ({type(error).__name__}: {error})") from error
    return convert_to_float8_training


def make_strategy(name: str, compile: bool = False, float8: str | None = None, float8_emulate: bool = False):
    """Lightning's own strategies (their blocks compiled by the caller) or lightning-par's (``compile`` and
    ``float8`` are theirs: each block converted and compiled in place)."""
    if name == "auto":
        return "auto"
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_par.models.llama import TransformerBlock

        return FSDPStrategy(auto_wrap_policy={TransformerBlock})
    import lightning_par

    if name == "data_parallel":
        return lightning_par.DataParallelStrategy(data_parallel_size=1, compile=compile, float8=float8,
                                                  float8_emulate=float8_emulate)
    if name == "zero3":
        return lightning_par.ZeroStrategy(zero_stage=3, data_parallel_size=1, compile=compile)
    if name == "hybrid3d":
        return lightning_par.Hybrid3DStrategy(data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=1,
                                              context_parallel_size=1, expert_parallel_size=1)
    raise ValueError(f"unknown strategy {name!r}")


def run_lightning(a: dict, phase: Phase) -> dict:
    import lightning
    import torch
    import torch.distributed as dist

    from lightning_par.callbacks import ThroughputMonitor
    from lightning_par.models import LlamaLM

    device = device_of(a)
    clock, seen = Clock(device), {}

    class Timer(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.mark()

        def on_train_end(self, trainer, pl_module):
            seen["backend"] = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
            seen["world_size"] = trainer.world_size

    torch.manual_seed(0)
    with torch.device(device):
        module = LlamaLM(**model_kwargs(a))
    print(f"model built: {module.model.num_parameters():,} parameters on {device}", flush=True)
    notes = []
    ours = phase.strategy in ("data_parallel", "zero3", "hybrid3d")
    float8 = {}
    if phase.float8:
        if device.type == "cuda":
            check_float8_gpu(device)
        float8 = {"float8": "tensorwise", "float8_emulate": device.type != "cuda"}
        notes.append("float8 tensorwise by the strategy" + (" (emulated on CPU)" if float8["float8_emulate"] else ""))
    if phase.compile and not ours:
        notes.append("compiled " + compile_blocks(module.model, a))
    elif phase.compile:
        notes.append("compiled by the strategy (compile=True: each block, in place, after sharding)")
    peak, _ = peak_flops(a, device)
    monitor = ThroughputMonitor(peak_flops_per_device=peak, window=a["steps"])
    trainer = lightning.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, strategy=make_strategy(phase.strategy, phase.compile and ours, **float8),
        precision="bf16-mixed", max_steps=a["warmup"] + a["steps"], callbacks=[Timer(), monitor], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=loader(a))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    strategy = trainer.strategy
    if hasattr(strategy, "parallel_config"):  # lightning-par: the layout the strategy resolved and ran
        prediction = predicted_memory(a, strategy.parallel_config)
    elif phase.strategy == "fsdp":  # Lightning's FSDP under bf16-mixed gathers bf16 parameters
        prediction = predicted_memory(a, default_parallel_config(zero_stage=3, param_dtype="bf16"))
    else:
        prediction = predicted_memory(a, default_parallel_config())
    result = {"runner": f"lightning.Trainer, strategy {type(strategy).__name__}", "strategy": phase.strategy,
              "precision": "bf16-mixed", "optimizer": "LlamaLM.configure_optimizers: AdamW(fused=False), LambdaLR",
              "compile": phase.compile, "notes": notes, "process_group_backend": seen.get("backend"),
              "world_size": seen.get("world_size"), "loss_last": metrics.get("train_loss"),
              "float8": phase.float8,
              "monitor": {"tokens_per_s": metrics.get("perf/tokens_per_sec"), "mfu": metrics.get("perf/mfu"),
                          "mfu_float8_peak": metrics.get("perf/mfu_float8_peak"),
                          "source": "lightning_par ThroughputMonitor, same peak, last window of the timed steps"},
              **clock.summary(a)}
    return finish(a, result, device, prediction)


def run_bubble(a: dict, phase: Phase) -> dict:
    """BubbleMeter on a real pipeline at world size 1, then its event timing alone on a known workload."""
    import torch
    import torch.distributed as dist

    device = device_of(a)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    out: dict[str, Any] = {"backend": dist.get_backend()}
    try:
        # Independent checks: the event timing alone is still reported when the pipeline cannot be built.
        checks = (("pipeline", lambda: _bubble_pipeline(a, device)), ("direct", lambda: _bubble_direct(device)))
        for key, check in checks:
            try:
                out[key] = check()
            except Exception as error:  # noqa: BLE001 - each check's failure is reported, the other still runs
                traceback.print_exc()
                out[key] = {"sane": False, "error": f"{type(error).__name__}: {error}"[:2000]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    out["sane"] = bool(out["pipeline"]["sane"] and out["direct"]["sane"])
    return out


def _bubble_pipeline(a: dict, device) -> dict:
    import torch

    from lightning_par.layout.config import ParallelConfig
    from lightning_par.models import LlamaLM
    from lightning_par.parallel.pipeline.bubble import simulated_bubble
    from lightning_par.parallel.pipeline.split import build_stages, split_pipeline
    from lightning_par.parallel.pipeline.runner import PipelineRunner
    from lightning_par.parallel.model_map import derive_model_map

    config = ParallelConfig(pp=1, dp_shard=1, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
                            microbatches=a["microbatches"]).validate(1)
    from lightning_par.parallel.mesh import build_mesh
    mesh = build_mesh(config, device.type)
    torch.manual_seed(0)
    with torch.device(device):
        module = LlamaLM(**model_kwargs(a))
    batch = next(iter(loader(a))).to(device)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    micro = a["batch_size"] // a["microbatches"]
    layout = split_pipeline(module, mesh, derive_model_map(module), schedule=config.pp_schedule,
                            virtual_stages=config.pp_virtual_stages, balance_by="parameters", device=device,
                            sample_batch=(inputs[:micro], targets[:micro]))
    stages = build_stages(module, layout, mesh, device)
    runner = PipelineRunner(stages, mesh, config, module.loss_fn, device=device)
    parameters = [p for p in module.parameters() if p.requires_grad]
    fractions, busy, steps, losses = [], [], [], []
    for i in range(2 + 5):  # 2 warm-up steps
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = runner.train_step(inputs, targets, parameters)
        synchronize(device)
        if i >= 2:
            steps.append(time.perf_counter() - start)
            fractions.append(runner.bubble_fraction)
            busy.append(runner.bubble._busy)  # seconds of stage compute the meter summed (CUDA events on a GPU)
            losses.append(float(loss))
    meter = runner.bubble
    actions = list(meter.actions)
    simulated = simulated_bubble({0: actions}, meter.n_stages)[0]
    expected_actions = len(stages) * a["microbatches"] * 2  # forward and backward of every micro-batch
    sane = (all(finite(f) and 0.0 <= f < 1.0 for f in fractions) and all(finite(b) and b > 0 for b in busy)
            and all(b <= s * 1.05 for b, s in zip(busy, steps)) and len(actions) == expected_actions
            and all(finite(x) for x in losses) and (device.type != "cuda" or len(meter._events) > 0))
    return {"path": "PipelineRunner (lightning_par.parallel.pipeline.runner), interleaved_1f1b, "
                    f"{len(stages)} stages on 1 rank, {a['microbatches']} micro-batches",
            "timing": "CUDA events" if meter._cuda else "host perf_counter",
            "cuda_events_recorded": len(meter._events), "bubble_fraction": statistics.median(fractions),
            "bubble_fractions": fractions, "busy_s": statistics.median(busy), "step_s": statistics.median(steps),
            "busy_over_step": statistics.median(b / s for b, s in zip(busy, steps)),
            "simulated_bubble": simulated, "actions": len(actions), "expected_actions": expected_actions,
            "loss": losses[-1], "sane": bool(sane)}


def _bubble_direct(device) -> dict:
    """The meter's timing alone: a stand-in stage whose forward runs matmuls back to back; the busy time the events
    report must match the host's synchronised time of the same work."""
    import torch

    from lightning_par.parallel.pipeline.bubble import BubbleMeter

    size = 4096 if device.type == "cuda" else 128
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    class StandInStage:
        num_stages, stage_index = 1, 0

        def forward_one_chunk(self, microbatch: int, *args: Any, **kwargs: Any):
            y = x
            for _ in range(8):
                y = y @ x
            return y

    stage = StandInStage()
    meter = BubbleMeter([stage], device)
    stage.forward_one_chunk(0)  # warm-up, outside a measured step: not counted
    fractions, busy, steps = [], [], []
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        meter.start()
        for microbatch in range(4):
            stage.forward_one_chunk(microbatch)
        fraction = meter.stop()  # synchronises on CUDA before reading the events
        steps.append(time.perf_counter() - start)
        fractions.append(fraction)
        busy.append(meter._busy)
    sane = (all(finite(f) and 0.0 <= f < 1.0 for f in fractions) and all(finite(b) and b > 0 for b in busy)
            and all(b <= s * 1.05 for b, s in zip(busy, steps)) and len(meter.actions) == 4)
    return {"path": "BubbleMeter on a stand-in stage (4 x 8 bf16 matmuls of " + f"{size}^2)",
            "timing": "CUDA events" if meter._cuda else "host perf_counter",
            "bubble_fraction": statistics.median(fractions), "busy_s": statistics.median(busy),
            "step_s": statistics.median(steps), "busy_over_step": statistics.median(b / s for b, s in zip(busy, steps)),
            "sane": bool(sane)}


RUNNERS: dict[str, Callable[[dict, Phase], dict]] = {"device": run_device, "plain": run_plain,
                                                    "lightning": run_lightning, "bubble": run_bubble}


def worker(phase_name: str, a: dict, out_file: str) -> None:
    """Run one phase in this process and write its result (or its error) to ``out_file``."""
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    phase = next(p for p in PHASES if p.name == phase_name)
    started = time.perf_counter()
    try:
        configure_torch(a)
        result = {"status": "ok", **RUNNERS[phase.kind](a, phase)}
    except PhaseSkipped as reason:
        result = {"status": "skipped", "reason": str(reason)}
    except Exception as error:  # noqa: BLE001 - any failure is this phase's result; the next phases still run
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000],
                  "traceback": traceback.format_exc()[-4000:]}
    result["wall_s"] = time.perf_counter() - started
    Path(out_file).write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    sys.stderr.flush()


# ============================================================================================== the driver
def _forked_worker(phase_name: str, a: dict, out_file: str, log_file: str) -> None:
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    worker(phase_name, a, out_file)


def launch(phase: Phase, a: dict, timeout: float, logs: Path) -> dict:
    """Run ``phase`` in a process of its own within ``timeout`` seconds; its result, or why there is none."""
    out_file, log_file = logs / f"{phase.name}.json", logs / f"{phase.name}.log"
    out_file.unlink(missing_ok=True)
    env_port = str(free_port())
    if a["launcher"] == "fork":
        import multiprocessing

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=env_port)
        process = multiprocessing.get_context("fork").Process(
            target=_forked_worker, args=(phase.name, a, str(out_file), str(log_file)))
        process.start()
        process.join(timeout)
        timed_out = process.is_alive()
        if timed_out:
            process.kill()
            process.join()
        rc = process.exitcode
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
    else:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": env_port,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", phase.name,
                   "--worker-args", json.dumps(a), "--worker-out", str(out_file)]
        with open(log_file, "w") as log:
            # A session of its own: on a timeout the whole group goes (compile workers included), nothing else.
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                       start_new_session=True)
            try:
                rc = process.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(process.pid, signal.SIGKILL)
                rc = process.wait()
    if out_file.is_file():
        return json.loads(out_file.read_text())
    tail = log_file.read_text(errors="replace").splitlines()[-25:] if log_file.is_file() else []
    status = "timeout" if timed_out else "crashed"
    why = f"killed after {timeout:.0f} s (phase time limit)" if timed_out else f"exit code {rc}, no result written"
    return {"status": status, "error": why, "log_tail": tail}


def phase_line(name: str, r: dict) -> str:
    if r.get("status") != "ok":
        return f"[{name}] {r.get('status')}: {r.get('error') or r.get('reason')}"
    if name == "device":
        return (f"[device] {r.get('name', r['device_type'])}, torch {r['torch']}, lightning {r['lightning']}, "
                f"torchao {r['torchao']}; model {r['parameters']:,} parameters, {r['flops_per_token'] / 1e9:.2f} "
                f"GFLOP/token; peak {r['peak_flops'] / 1e12:.0f} TFLOP/s ({r['peak_flops_source']}); measured "
                f"bf16 matmul {r['measured_bf16_matmul_flops'] / 1e12:.0f} TFLOP/s; Lightning's table: "
                f"{r.get('lightning_table_bf16_flops')}")
    if name == "bubble":
        p, d = r["pipeline"], r["direct"]
        pipeline = (f"pipeline failed: {p['error']}" if "error" in p else
                    f"pipeline ({p['timing']}) bubble {p['bubble_fraction']:.4f}, busy {p['busy_s'] * 1e3:.1f} ms of a "
                    f"{p['step_s'] * 1e3:.1f} ms step, {p['actions']}/{p['expected_actions']} actions, simulated "
                    f"{p['simulated_bubble']:.3f}")
        direct = (f"stand-in failed: {d['error']}" if "error" in d else
                  f"stand-in ({d['timing']}) busy/step {d['busy_over_step']:.3f}")
        return f"[bubble] sane={r['sane']}: {pipeline}; {direct}"
    monitor = r.get("monitor") or {}
    extra = ""
    if monitor.get("tokens_per_s"):
        extra = f"; ThroughputMonitor {monitor['tokens_per_s']:,.0f} tok/s, MFU {monitor.get('mfu') or 0:.1%}"
    backend = f", backend {r['process_group_backend']}" if r.get("process_group_backend") else ""
    return (f"[{name}] {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}, peak {r['peak_bytes'] / GiB:.2f} GiB vs "
            f"predicted {r['predicted_bytes'] / GiB:.2f} GiB (x{r['memory_ratio']:.2f}), loss {r.get('loss_last')}"
            f"{backend}{extra} [{r['wall_s']:.0f} s]")


def summary_table(results: dict) -> str:
    base = results.get("plain", {})
    base_tps = base.get("tokens_per_s") if base.get("status") == "ok" else None
    header = (f"{'run':<42}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'pred GiB':>10}{'peak/pred':>11}"
              f"{'vs plain':>10}")
    lines = [header, "-" * len(header)]
    order = [p.name for p in PHASES if p.kind in ("plain", "lightning")]
    order = [n for n in order if not n.startswith("lp_")] + [n for n in order if n.startswith("lp_")]
    labels = {p.name: p.label for p in PHASES}
    for name in order:
        r = results.get(name)
        if r is None:
            continue
        if r.get("status") != "ok":
            why = r.get("reason") or r.get("error") or ""
            lines.append(f"{labels[name]:<42}  {r.get('status')}: {why}"[:150])
            continue
        ratio = f"{r['tokens_per_s'] / base_tps:.2f}" if base_tps else "-"
        lines.append(f"{labels[name]:<42}{r['tokens_per_s']:>12,.0f}{r['mfu']:>8.1%}{r['peak_bytes'] / GiB:>10.2f}"
                     f"{r['predicted_bytes'] / GiB:>10.2f}{r['memory_ratio']:>11.2f}{ratio:>10}")
    bubble = results.get("bubble")
    if bubble is not None:
        if bubble.get("status") == "ok":
            lines.append("BubbleMeter: " + phase_line("bubble", bubble).removeprefix("[bubble] "))
        else:
            lines.append(f"BubbleMeter: {bubble.get('status')}: {bubble.get('error')}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the documented invocations against it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, CPU, gloo, 2 timed steps (automatic when CUDA is not available)")
    parser.add_argument("--out", help="JSON of every result (default: $OUT/gpu_results.json, else ./gpu_results.json)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="seconds for the whole script (GPU runs)")
    parser.add_argument("--phases", nargs="+", choices=PHASE_NAMES, help="run only these (default: all)")
    for name in ("dim", "layers", "heads", "kv_heads", "vocab", "seq_len", "batch_size", "warmup", "steps",
                 "microbatches"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {GPU_DEFAULTS[name]} (smoke: {SMOKE_DEFAULTS[name]})")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s per GPU for MFU")
    parser.add_argument("--device-preset", default="h200-141gb",
                        help="planner device preset for the predicted step time (memory needs none)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; smoke: eager)")
    parser.add_argument("--plain-compile-scope", choices=("blocks", "model"), default="blocks",
                        help="plain PyTorch: compile each decoder block (as Lightning's run does) or the whole model")
    parser.add_argument("--launcher", choices=("auto", "subprocess", "fork"), default="auto",
                        help="process per phase: a fresh interpreter (GPU default) or a fork of this one (smoke)")
    parser.add_argument("--worker", choices=PHASE_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--worker-args", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser


def resolve(args: argparse.Namespace) -> dict:
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    smoke = not cuda
    defaults = SMOKE_DEFAULTS if smoke else GPU_DEFAULTS
    a = {name: getattr(args, name) if getattr(args, name) is not None else default
         for name, default in defaults.items()}
    a.update(smoke=smoke, cuda=cuda, peak_tflops=args.peak_tflops, device_preset=args.device_preset,
             compile_backend=args.compile_backend or ("eager" if smoke else "inductor"),
             plain_compile_scope=args.plain_compile_scope,
             launcher=args.launcher if args.launcher != "auto" else ("fork" if smoke else "subprocess"))
    if a["batch_size"] % a["microbatches"]:
        raise SystemExit(f"--batch-size {a['batch_size']} must be divisible by --microbatches {a['microbatches']}")
    if a["warmup"] < 1 or a["steps"] < 1:
        raise SystemExit("--warmup and --steps must be at least 1")
    return a


def write_json(path: Path, payload: dict) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(payload, indent=1, default=str))
    temporary.replace(path)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.worker_args), args.worker_out)
        return
    started = time.perf_counter()
    a = resolve(args)
    out = Path(args.out) if args.out else (Path(os.environ["OUT"]) / "gpu_results.json" if os.environ.get("OUT")
                                             else Path("gpu_results.json"))
    out = out.resolve()  # the phases run with the repository root as their working directory
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.with_name(out.stem + "_logs")
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    if a["launcher"] == "fork":  # import once here: every forked phase starts with torch and Lightning loaded
        import lightning  # noqa: F401

        import lightning_par  # noqa: F401
    if args.smoke:
        mode = "smoke (--smoke): CPU, gloo"
    elif a["smoke"]:
        mode = "smoke (no CUDA device found): CPU, gloo"
    else:
        mode = "GPU: CUDA, NCCL"
    parameters = exact_parameter_count(a)
    print(f"lightning-par GPU validation, {mode}; budget {args.budget_s:.0f} s; results -> {out}, logs -> {logs}")
    print(f"model: Llama dim={a['dim']} layers={a['layers']} heads={a['heads']} kv_heads={a['kv_heads'] or a['heads']}"
          f" vocab={a['vocab']} seq={a['seq_len']}: {parameters:,} parameters (exact); batch {a['batch_size']} x "
          f"{a['seq_len']} = {a['batch_size'] * a['seq_len']:,} tokens/step; {a['warmup']} warm-up + {a['steps']} "
          f"timed steps; bf16 autocast over fp32 weights (bf16-mixed)", flush=True)
    selected = [p for p in PHASES if args.phases is None or p.name in args.phases]
    payload: dict[str, Any] = {"config": {**a, "parameters": parameters}, "phases": {}}
    results = payload["phases"]
    for phase in selected:
        elapsed = time.perf_counter() - started
        left = args.budget_s - elapsed - 5  # 5 s for the summary
        if phase.cuda_only and not a["cuda"]:
            results[phase.name] = {"status": "skipped", "reason": "needs CUDA"}
        elif a["cuda"] and left < phase.min_s:
            results[phase.name] = {"status": "skipped",
                                   "reason": f"budget: {max(left, 0):.0f} s left, the phase needs ~{phase.min_s:.0f} s"}
        else:
            timeout = min(phase.cap_s, left) if a["cuda"] else max(60.0, left)
            print(f"[{phase.name}] running (limit {timeout:.0f} s) ...", flush=True)
            results[phase.name] = launch(phase, a, timeout, logs)
        print(phase_line(phase.name, results[phase.name]), flush=True)
        if results[phase.name].get("status") in ("error", "crashed", "timeout") and results[phase.name].get("log_tail"):
            print("    " + "\n    ".join(results[phase.name]["log_tail"][-8:]), flush=True)
        payload["elapsed_s"] = time.perf_counter() - started
        write_json(out, payload)
    table = summary_table(results)
    payload["summary"] = table
    payload["elapsed_s"] = time.perf_counter() - started
    write_json(out, payload)
    base = results.get("plain", {})
    print("\nSummary (tokens/s over the timed steps; MFU = tokens/s x llama_flops_per_token / peak; "
          "'vs plain': tokens/s over plain PyTorch's eager run)")
    print(table)
    if base.get("status") == "ok":
        print(f"MFU peak: {base['peak_flops'] / 1e12:.0f} TFLOP/s ({base['peak_flops_source']})")
    print(f"done in {payload['elapsed_s']:.0f} s; results in {out}", flush=True)


if __name__ == "__main__":
    main()
