"""Bad inputs and what lightning-par says about each: the table behind docs/errors.md.

Each entry names an input a user might give, how to give it in this process (``make``, called in a fresh working
directory with the good checkpoints of :func:`good_checkpoints` beside it), and the words the message must contain:
the offending value and what would fit. tests/test_bad_inputs.py raises each one; ``python tests/bad_inputs.py``
prints the Markdown table that docs/errors.md holds (a test keeps the two equal).

Inputs that only show once processes run (a layout that does not fit the world size, micro-batches against the
batch size) are checked here through the same functions the strategies call at set-up, on the sizes they would see;
tests/test_bad_inputs.py also runs the set-up ones in real processes.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from lightning_par.checkpoint import format as ckpt


@dataclass(frozen=True)
class BadInput:
    given: str  # the input, as a user writes it
    says: str  # words the message must contain
    make: Callable[[], Any]  # gives the input (raises)


def _strategy(name: str, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        import lightning_par

        return getattr(lightning_par, name)(**kwargs)

    return make


def _on_processes(world_size: int, name: str, **kwargs: Any) -> Callable[[], Any]:
    """The sizes check a strategy runs when ``world_size`` processes start (before any collective)."""

    def make() -> Any:
        _strategy(name, **kwargs)().parallel_config.validate(world_size)

    return make


def _at_set_up(name: str, *, batch_size: int, seq_len: int, **kwargs: Any) -> Callable[[], Any]:
    """What a strategy checks at set-up on the first batch of (batch_size, seq_len) tokens."""

    def make() -> Any:
        from lightning_par.strategies.setup_checks import check_batch

        check_batch(_strategy(name, **kwargs)().parallel_config, batch_size=batch_size, seq_len=seq_len)

    return make


def _cli_strategy(name: str) -> Callable[[], Any]:
    def make() -> Any:
        from lightning_par.cli.main import check_strategy_name

        check_strategy_name(name)

    return make


def _module(**changes: Any) -> torch.nn.Module:
    from lightning_par.models import LlamaLM

    return LlamaLM(**{"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 16, **changes})


HF_MODEL = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def good_checkpoints(directory: Path) -> None:
    """``good.ckpt`` (one file) and ``good-sharded.ckpt`` (a directory) of :func:`_module` and its AdamW state, and
    ``hf-model`` (a tiny Hugging Face model directory), in ``directory``: the bad inputs below are made from them."""
    import transformers
    from hf_directories import save_tokenizer

    arguments = dict(HF_MODEL)
    config = transformers.AutoConfig.for_model(arguments.pop("model_type"), **arguments)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory / "hf-model")
    save_tokenizer(directory / "hf-model")
    (directory / "notes.jsonl").write_text('{"title": "a", "body": "the quick brown fox"}\n')
    (directory / "latin1.txt").write_bytes("café crème\n".encode("latin-1"))
    module = _module()
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    for name, sharded in (("good.ckpt", False), ("good-sharded.ckpt", True)):
        checkpoint = {"state_dict": ckpt.model_state_dict(module, full=not sharded),
                      "optimizer_states": [ckpt.optimizer_state_dict(module, optimizer, full=not sharded)],
                      "global_step": 3}
        ckpt.save_checkpoint(checkpoint, directory / name, sharded=sharded)


class Payload:
    """Pickled into a checkpoint: unpickling it would write a file."""

    def __reduce__(self) -> tuple:
        return Path.write_text, (Path("payload-ran"), "the payload ran")


def _checkpoint(name: str, prepare: Callable[[Path], Any] | None = None, **changes: Any) -> Callable[[], Any]:
    """Load checkpoint ``name`` (after ``prepare(path)`` made it from a good one) into a model of ``changes``."""

    def make() -> Any:
        path = Path(name)
        if prepare is not None:
            prepare(path)
        module = _module(**changes)
        ckpt.load_checkpoint(path, module, [torch.optim.AdamW(module.parameters())])

    return make


def _copy_of(source: str, then: Callable[[Path], Any] | None = None) -> Callable[[Path], Any]:
    def prepare(path: Path) -> None:
        (shutil.copytree if Path(source).is_dir() else shutil.copy)(source, path)
        if then is not None:
            then(path)

    return prepare


def _rewritten(change: Callable[[dict], Any]) -> Callable[[Path], Any]:
    def prepare(path: Path) -> None:
        checkpoint = torch.load("good.ckpt", weights_only=False)
        saved = change(checkpoint)
        torch.save(checkpoint if saved is None else saved, path)

    return prepare


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _largest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda shard: shard.stat().st_size)


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def change(checkpoint: dict) -> None:
        checkpoint[key] = value

    return change


def _model_map(spec: dict, **changes: Any) -> Callable[[], Any]:
    def make() -> Any:
        from lightning_par.parallel.model_map import ModelMap

        ModelMap.from_dict(spec).validate(_module(**changes))

    return make


def _call(target: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """Call ``module:attribute`` (dotted) with the arguments."""

    def make() -> Any:
        import importlib

        module, attribute = target.split(":")
        function = functools.reduce(getattr, attribute.split("."), importlib.import_module(module))
        return function(*args, **kwargs)

    return make


def _hf_model(name: str, prepare: Callable[[Path], Any] | None = None) -> Callable[[], Any]:
    """HFCausalLM(pretrained=name), after ``prepare(path)`` made the directory."""

    def make() -> Any:
        from lightning_par.models import HFCausalLM

        if prepare is not None:
            prepare(Path(name))
        return HFCausalLM(pretrained=name)

    return make


def _load_into_other_shape() -> None:
    from lightning_par.checkpoint.huggingface import load_huggingface_weights
    from lightning_par.models import HFCausalLM

    module = HFCausalLM(config={**HF_MODEL, "hidden_size": 48})
    module.configure_model()
    load_huggingface_weights(module.model, "hf-model")


def _load_hf_model(prepare: Callable[[Path], Any]) -> Callable[[], Any]:
    """Read the tiny model directory, as ``prepare(path)`` changed a copy of it, into the model."""

    def make() -> Any:
        from lightning_par.checkpoint.huggingface import load_huggingface_weights
        from lightning_par.models import HFCausalLM

        shutil.copytree("hf-model", "changed")
        prepare(Path("changed"))
        module = HFCausalLM(pretrained="changed")
        module.configure_model()
        load_huggingface_weights(module.model, "changed")

    return make


def _truncate_weights(path: Path) -> None:
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def _weights_as_integers(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int8)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def _text_data(prepare: Callable[[], Any] | None = None, **kwargs: Any) -> Callable[[], Any]:
    """TextDataModule(**kwargs) built and set up (the tokenizer of the tiny model directory unless given), after
    ``prepare()``."""

    def make() -> Any:
        from lightning_par.data import TextDataModule

        if prepare is not None:
            prepare()
        data = TextDataModule(**{"tokenizer": "hf-model", **kwargs})
        data.setup("fit")

    return make


def _streamed(data_dir: Any = "shards", module: Any = None, truncate: bool = False,
              edit_index: Callable[[list], list] | None = None, **kwargs: Any) -> Callable[[], Any]:
    """StreamingTokenDataModule(data_dir, **kwargs) set up under ``module``, on byte shards of notes.jsonl prepared
    into ``shards`` first (with the shard file cut short: ``truncate``; with the index's shard list edited:
    ``edit_index``)."""

    def make() -> Any:
        from types import SimpleNamespace

        from lightning_par.data import StreamingTokenDataModule
        from lightning_par.data.prepare import prepare

        prepare("notes.jsonl", "shards", "bytes", text_field="body", num_workers=1, verbose=False)
        if truncate:
            shard = Path("shards/train/chunk-0-0.bin")
            shard.write_bytes(shard.read_bytes()[:10])
        if edit_index is not None:
            index_path = Path("shards/train/index.json")
            index = json.loads(index_path.read_text())
            index["chunks"] = edit_index(index["chunks"])
            index_path.write_text(json.dumps(index))
        data = StreamingTokenDataModule(data_dir, **{"seq_len": 4, "batch_size": 1, **kwargs})
        data.trainer = SimpleNamespace(strategy=None, lightning_module=module)
        data.setup("fit")

    return make


def _prepare(inputs: str, output: str) -> Callable[[], Any]:
    def make() -> Any:
        from lightning_par.data.prepare import prepare

        prepare(inputs, output, "bytes", num_workers=1, verbose=False)

    return make


def _config_only(path: Path) -> None:
    path.mkdir()
    shutil.copy(Path("hf-model") / "config.json", path / "config.json")


BAD_INPUTS: list[BadInput] = [
    # ------------------------------------------------------------------ strategy arguments (at construction)
    BadInput("`DataParallelStrategy(data_parallel_size=-1)`",
             "data_parallel_size must be a positive integer or 'auto', got -1", _strategy("DataParallelStrategy", data_parallel_size=-1)),
    BadInput("`DataParallelStrategy(data_parallel_size='all')`",
             "data_parallel_size must be a positive integer or 'auto', got 'all'",
             _strategy("DataParallelStrategy", data_parallel_size="all")),
    BadInput("`DataParallelStrategy(bucket_cap_mb=0)`", "bucket_cap_mb must be a positive number of MiB, got 0",
             _strategy("DataParallelStrategy", bucket_cap_mb=0)),
    BadInput("`DataParallelStrategy(gradient_compression='int8')`",
             "gradient_compression='int8' is not one of ('none', 'bf16', 'fp16')",
             _strategy("DataParallelStrategy", gradient_compression="int8")),
    BadInput("`DataParallelStrategy(static_graph=True, find_unused_parameters=True)`",
             "static_graph=True and find_unused_parameters=True exclude each other",
             _strategy("DataParallelStrategy", static_graph=True, find_unused_parameters=True)),
    BadInput("`DataParallelStrategy(activation_checkpointing='some')`",
             "activation_checkpointing='some' is not one of ('none', 'full', 'selective', 'op')",
             _strategy("DataParallelStrategy", activation_checkpointing="some")),
    BadInput("`DataParallelStrategy(activation_checkpointing_every=0)`",
             "activation_checkpointing_every must be a positive integer, got 0",
             _strategy("DataParallelStrategy", activation_checkpointing_every=0)),
    BadInput("`ZeroStrategy(zero_stage=4)`", "zero_stage=4 is not one of (0, 1, 2, 3)", _strategy("ZeroStrategy", zero_stage=4)),
    BadInput("`ZeroStrategy(zero_stage=1, param_dtype='bf16')`",
             "param_dtype='bf16' needs zero_stage=3 (FSDP2 keeps fp32 shards and casts per block); with zero_stage=1 use "
             "Trainer(precision='bf16-mixed')", _strategy("ZeroStrategy", zero_stage=1, param_dtype="bf16")),
    BadInput("`ZeroStrategy(zero_stage=2, cpu_offload=True)`", "cpu_offload=True needs zero_stage=3",
             _strategy("ZeroStrategy", zero_stage=2, cpu_offload=True)),
    BadInput("`ZeroStrategy(zero_stage=1, sharded_accumulation=True)`",
             "sharded_accumulation=True with zero_stage=1: only ZeRO-2 and ZeRO-3 shard gradients",
             _strategy("ZeroStrategy", zero_stage=1, sharded_accumulation=True)),
    BadInput("`ZeroStrategy(param_dtype='fp8')`", "param_dtype='fp8' is not one of ('fp32', 'bf16', 'fp16')",
             _strategy("ZeroStrategy", param_dtype="fp8")),
    BadInput("`ZeroStrategy(data_parallel_size=4, replicate_size=3)`",
             "replicate_size=3 does not divide data_parallel_size=4",
             _strategy("ZeroStrategy", data_parallel_size=4, replicate_size=3)),
    BadInput("`ZeroStrategy(reshard_after_forward='no')`", "reshard_after_forward must be true or false, got 'no'",
             _strategy("ZeroStrategy", reshard_after_forward="no")),
    BadInput("`TensorParallelStrategy(tensor_parallel_size='auto')`",
             "tensor_parallel_size='auto' is not supported: only the data-parallel sizes can be 'auto'",
             _strategy("TensorParallelStrategy", tensor_parallel_size="auto")),
    BadInput("`TensorParallelStrategy(loss_parallel='yes')`", "loss_parallel must be true or false, got 'yes'",
             _strategy("TensorParallelStrategy", loss_parallel="yes")),
    BadInput("`ContextParallelStrategy(context_parallel_method='zigzag')`",
             "context_parallel_method='zigzag' is not one of ('ulysses', 'ring', 'allgather')",
             _strategy("ContextParallelStrategy", context_parallel_method="zigzag")),
    BadInput("`ContextParallelStrategy(context_parallel_size=0)`",
             "context_parallel_size must be a positive integer, got 0",
             _strategy("ContextParallelStrategy", context_parallel_size=0)),
    BadInput("`PipelineParallelStrategy(pipeline_schedule='dualpipe')`",
             "pipeline_schedule='dualpipe' is not one of ('gpipe', '1f1b'",  # and the rest of layout.schedules.SCHEDULES
             _strategy("PipelineParallelStrategy", pipeline_schedule="dualpipe")),
    BadInput("`PipelineParallelStrategy(microbatches=0)`", "microbatches must be an integer >= 1, got 0",
             _strategy("PipelineParallelStrategy", microbatches=0)),
    BadInput("`PipelineParallelStrategy(virtual_stages=1)`", "virtual_stages must be an integer >= 2, got 1",
             _strategy("PipelineParallelStrategy", virtual_stages=1)),
    BadInput("`PipelineParallelStrategy(pipeline_balance='flops')`", "pipeline_balance='flops' is not one of ('parameters', 'profile')",
             _strategy("PipelineParallelStrategy", pipeline_balance="flops")),
    BadInput("`PipelineParallelStrategy(pipeline_parallel_size=2, save_distributed_checkpoint=False)`",
             "pipeline_parallel_size=2: each rank saves its own stages, so checkpoints are sharded",
             _strategy("PipelineParallelStrategy", pipeline_parallel_size=2, save_distributed_checkpoint=False)),
    BadInput("`Hybrid3DStrategy(context_parallel_method='flash')`",
             "context_parallel_method='flash' is not one of ('ulysses', 'ring', 'allgather')",
             _strategy("Hybrid3DStrategy", context_parallel_method="flash")),
    BadInput("`Hybrid3DStrategy(pipeline_schedule='dualpipe')`", "pipeline_schedule='dualpipe' is not one of",
             _strategy("Hybrid3DStrategy", pipeline_schedule="dualpipe")),
    BadInput("`AutoParallelStrategy(model_spec='llama9')`", "unknown model preset 'llama9'; presets:",
             _strategy("AutoParallelStrategy", model_spec="llama9")),
    BadInput("`AutoParallelStrategy(model_spec={'hidden': 64, 'depth': 2})`",
             "model_spec={'hidden': 64, 'depth': 2}: unknown fields ['depth']; missing ['ffn_hidden', 'heads', "
             "'kv_heads', 'layers', 'vocab_size']", _strategy("AutoParallelStrategy", model_spec={"hidden": 64,
                                                                                                  "depth": 2})),
    BadInput("`AutoParallelStrategy(calibrate='yes')`", "calibrate must be true or false, got 'yes'",
             _strategy("AutoParallelStrategy", calibrate="yes")),
    BadInput("`DataParallelStrategy(compile='yes')`", "compile must be true or false, got 'yes'",
             _strategy("DataParallelStrategy", compile="yes")),
    BadInput("`ZeroStrategy(zero_stage=2, keep_gathered_blocks=2)`", "keep_gathered_blocks=2 schedules ZeRO-3's "
             "parameter all-gathers, and zero_stage=2 keeps parameters whole; use zero_stage=3 or keep_gathered_blocks=0",
             _strategy("ZeroStrategy", zero_stage=2, keep_gathered_blocks=2)),
    BadInput("`ZeroStrategy(zero_stage=1, blocks_per_unit=2)`", "blocks_per_unit=2 schedules ZeRO-3's parameter "
             "all-gathers, and zero_stage=1 keeps parameters whole; use zero_stage=3 or blocks_per_unit=1",
             _strategy("ZeroStrategy", zero_stage=1, blocks_per_unit=2)),
    BadInput("`ZeroStrategy(blocks_per_unit=0)`", "blocks_per_unit must be an integer >= 1, got 0",
             _strategy("ZeroStrategy", blocks_per_unit=0)),
    BadInput("`Hybrid3DStrategy(pipeline_parallel_size=2, zero_stage=3, prefetch_blocks=1)`",
             "pipeline_parallel_size=2 with prefetch_blocks=1: a pipeline schedule runs its blocks for several "
             "micro-batches in its own order", _strategy("Hybrid3DStrategy", pipeline_parallel_size=2, zero_stage=3,
                                                           prefetch_blocks=1)),
    BadInput("`ZeroStrategy(float8='e4m3')`", "float8='e4m3' is not one of ('tensorwise', 'rowwise')",
             _strategy("ZeroStrategy", float8="e4m3")),
    BadInput("`TensorParallelStrategy(tensor_parallel_size=2, async_tp=True)`",
             "async_tp=True with tensor_parallel_size=2, sequence_parallel=False, compile=False: async tensor parallel "
             "splits sequence parallel's all-gathers", _strategy("TensorParallelStrategy", tensor_parallel_size=2,
                                                                   async_tp=True)),
    BadInput("`ZeroStrategy(async_save=True, save_distributed_checkpoint=False)`",
             "async_save=True writes through torch.distributed.checkpoint.async_save, which writes the sharded format: "
             "keep save_distributed_checkpoint=True, or save synchronously",
             _strategy("ZeroStrategy", async_save=True, save_distributed_checkpoint=False)),
    BadInput("`DataParallelStrategy(float8_emulate=True)`", "float8_emulate=True emulates float8 matmuls, and float8 "
             "is None; set float8 to one of ('tensorwise', 'rowwise')", _strategy("DataParallelStrategy",
                                                                                  float8_emulate=True)),
    BadInput("`AutoParallelStrategy(device='tpu-v9')`",
             "unknown device preset 'tpu-v9'; presets: ['a100-40gb', 'a100-80gb', 'cpu', 'h100-80gb', 'h100-96gb-500w', 'h200-141gb']",
             _strategy("AutoParallelStrategy", device="tpu-v9")),
    # ------------------------------------------------------------------ sizes against the processes (at start)
    BadInput("`Hybrid3DStrategy(data_parallel_size=2, tensor_parallel_size=2)` on 3 processes",
             "data_parallel_size=2 x tensor_parallel_size=2 = 4 does not equal the world size 3: the mesh sizes must "
             "multiply to the number of processes; no tensor_parallel_size fits with the other sizes",
             _on_processes(3, "Hybrid3DStrategy", data_parallel_size=2, tensor_parallel_size=2)),
    BadInput("`TensorParallelStrategy(tensor_parallel_size=4)` on 6 processes",
             "tensor_parallel_size=4 = 4 does not divide the world size 6; try tensor_parallel_size=2 or "
             "tensor_parallel_size=3 or tensor_parallel_size=6",
             _on_processes(6, "TensorParallelStrategy", tensor_parallel_size=4)),
    BadInput("`DataParallelStrategy(data_parallel_size=3)` on 2 processes",
             "data_parallel_size=3 = 3 does not equal the world size 2",
             _on_processes(2, "DataParallelStrategy", data_parallel_size=3)),
    BadInput("`ExpertParallelStrategy(expert_parallel_size=4, data_parallel_size=2)` on 2 processes",
             "expert_parallel_size=4 does not divide data_parallel_size x context_parallel_size = 2 x 1 = 2",
             _on_processes(2, "ExpertParallelStrategy", expert_parallel_size=4, data_parallel_size=2)),
    # ------------------------------------------------------------------ the data against the layout (at set-up)
    BadInput("`PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=3)`, batch size 8",
             "a batch of 8 samples does not split into microbatches=3; use a batch size divisible by 3",
             _at_set_up("PipelineParallelStrategy", pipeline_parallel_size=2, microbatches=3, batch_size=8, seq_len=16)),
    BadInput("`PipelineParallelStrategy(pipeline_parallel_size=4, microbatches=2, pipeline_schedule='1f1b')`",
             "schedule '1f1b' needs at least pipeline_parallel_size=4 micro-batches to fill the pipeline, got "
             "microbatches=2", _at_set_up("PipelineParallelStrategy", pipeline_parallel_size=4, microbatches=2,
                                          batch_size=8, seq_len=16)),
    BadInput("`PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, pipeline_schedule='dualpipev')`",
             "schedule 'dualpipev' needs at least 2 x pipeline_parallel_size=2 = 4 micro-batches (one per stage), "
             "got microbatches=2", _at_set_up("PipelineParallelStrategy", pipeline_parallel_size=2, microbatches=2,
                                          pipeline_schedule="dualpipev", batch_size=8, seq_len=16)),
    BadInput("`ContextParallelStrategy(context_parallel_size=2, context_parallel_method='ring')`, sequences of 30 "
             "tokens",
             "sequence length 30 is not divisible by 4 (2 x context_parallel_size: causal load balancing gives each rank 2 of 4 "
             "chunks), which context_parallel_size=2 with context_parallel_method='ring' needs; nearest lengths that "
             "fit: [28, 32]",
             _at_set_up("ContextParallelStrategy", context_parallel_size=2, context_parallel_method="ring",
                        batch_size=2, seq_len=30)),
    BadInput("`TensorParallelStrategy(tensor_parallel_size=2, sequence_parallel=True)`, sequences of 15 tokens",
             "sequence_parallel=True splits the sequence over tensor_parallel_size=2 ranks, but a sequence of 15 "
             "tokens cannot be split into 2", _at_set_up("TensorParallelStrategy", tensor_parallel_size=2,
                                                     sequence_parallel=True, batch_size=2, seq_len=15)),
    # ------------------------------------------------------------------ the lightning-par command
    BadInput("`lightning-par fit --trainer.strategy hybird3d`",
             "trainer.strategy='hybird3d' is not a strategy name: did you mean 'hybrid3d'?", _cli_strategy("hybird3d")),
    BadInput("`lightning-par fit --trainer.strategy zero`", "trainer.strategy='zero' is not a strategy name: did you "
             "mean 'zero3' or 'zero2' or 'zero1'?", _cli_strategy("zero")),
    BadInput("`lightning-par fit --trainer.strategy dpp`", "trainer.strategy='dpp' is not a strategy name: did you mean "
             "'ddp'?", _cli_strategy("dpp")),
    # ------------------------------------------------------------------ model maps and models
    BadInput("`model_map: {blocks: model.nope}`", "ModelMap.blocks='model.nope' is not a module of LlamaLM",
             _model_map({"blocks": "model.nope"})),
    BadInput("`model_map: {blocks: model.layers, tensor_parallel: ...}`",
             "unknown ModelMap keys ['tensor_parallel']; expected blocks, embedding, final_norm, head, styles, "
             "split_points", _model_map({"blocks": "model.layers", "tensor_parallel": {}})),
    BadInput("`model_map: {blocks: model.layers, styles: {attention.wq: colwize}}`",
             "ModelMap style 'colwize' for 'attention.wq' is not one of",
             _model_map({"blocks": "model.layers", "styles": {"attention.wq": "colwize"}})),
    BadInput("`LlamaLM(dim=30, n_heads=4)`", "LlamaConfig.dim (30) must be divisible by n_heads (4)",
             _call("lightning_par.models:LlamaLM", dim=30, n_heads=4)),
    BadInput("`TokenDataModule(source='nowhere')`", "source='nowhere' is not one of ['stdlib', 'synthetic']",
             _call("lightning_par.data:TokenDataModule", source="nowhere")),
    BadInput("`TokenDataModule(batch_size=0)`", "batch_size=0 must be positive",
             _call("lightning_par.data:TokenDataModule", batch_size=0)),
    BadInput("`lightning-par plan --device tpu-v9`", "unknown device preset 'tpu-v9'",
             _call("lightning_par.planner:ClusterSpec.from_preset", "tpu-v9")),
    # ------------------------------------------------------------------ checkpoints (fit(ckpt_path=...))
    BadInput("`ckpt_path='missing.ckpt'`", "checkpoint 'missing.ckpt' does not exist", _checkpoint("missing.ckpt")),
    BadInput("an 8-byte garbage file", "'garbage.ckpt' is not a checkpoint: it is neither a directory written by "
             "torch.distributed.checkpoint nor a file written by torch.save (it starts with b'garbage\\n', 8 bytes)",
             _checkpoint("garbage.ckpt", lambda path: path.write_bytes(b"garbage\n"))),
    BadInput("a truncated full checkpoint", "checkpoint 'truncated.ckpt' is truncated or corrupt: the archive's index "
             "at its end is missing", _checkpoint("truncated.ckpt", _copy_of("good.ckpt", _truncate))),
    BadInput("a sharded checkpoint without `meta.pt`", "sharded checkpoint 'no-meta.ckpt' has no meta.pt",
             _checkpoint("no-meta.ckpt", _copy_of("good-sharded.ckpt", lambda path: os.remove(path / "meta.pt")))),
    BadInput("a sharded checkpoint with a truncated shard", "sharded checkpoint 'short.ckpt': the shard '__0_0.distcp' "
             "is truncated", _checkpoint("short.ckpt", _copy_of("good-sharded.ckpt", lambda path: _truncate(
                 _largest_shard(path))))),
    BadInput("a sharded checkpoint missing a shard", "sharded checkpoint 'lost.ckpt' is missing the shard "
             "'__0_0.distcp' that its index names", _checkpoint("lost.ckpt", _copy_of(
                 "good-sharded.ckpt", lambda path: os.remove(_largest_shard(path))))),
    BadInput("a directory that is not a checkpoint", "'empty.ckpt' is a directory but not a sharded checkpoint: it "
             "has no .metadata", _checkpoint("empty.ckpt", lambda path: path.mkdir())),
    BadInput("a checkpoint of another model shape (sharded)", "checkpoint 'good-sharded.ckpt' was written by another "
             "model: model.embed_tokens.weight is (64, 32) there and (64, 48) here",
             _checkpoint("good-sharded.ckpt", dim=48)),
    BadInput("a checkpoint of another model depth (full)", "checkpoint 'good.ckpt' was written by another model: 9 of "
             "this model's names are not in it (model.layers.2.attention_norm.weight, ",
             _checkpoint("good.ckpt", n_layers=3)),
    BadInput("a checkpoint of a newer lightning-par", "checkpoint 'newer.ckpt' was written by a newer lightning-par "
             "(checkpoint format 99; this version reads format 1 and older): upgrade lightning-par",
             _checkpoint("newer.ckpt", _rewritten(_set(ckpt.validation.FORMAT_KEY, 99)))),
    BadInput("a weights-only checkpoint (`ModelCheckpoint(save_weights_only=True)`)",
             "checkpoint 'weights.ckpt' holds the model but no optimizer state",
             _checkpoint("weights.ckpt", _rewritten(lambda checkpoint: checkpoint.pop("optimizer_states") and None))),
    BadInput("a plain state dict (`torch.save(model.state_dict())`)", "'plain.pt' is not a Lightning checkpoint: it has "
             "no 'state_dict' entry", _checkpoint("plain.pt", _rewritten(lambda checkpoint: checkpoint["state_dict"]))),
    # ------------------------------------------------------------------ Hugging Face models
    BadInput("`HFCausalLM(pretrained='nowhere')`", "pretrained='nowhere' is not a directory: give a local model "
             "directory as save_pretrained writes it", _hf_model("nowhere")),
    BadInput("`HFCausalLM(pretrained=...)`, a directory without `config.json`", "pretrained='empty' has no "
             "config.json", _hf_model("empty", lambda path: path.mkdir())),
    BadInput("`HFCausalLM(pretrained=...)`, a directory without safetensors", "pretrained='config-only' holds no "
             ".safetensors weights (it holds ['config.json'])", _hf_model("config-only", _config_only)),
    BadInput("`HFCausalLM()`", "HFCausalLM needs exactly one of pretrained (a local model directory) and config",
             _call("lightning_par.models:HFCausalLM")),
    BadInput("`HFCausalLM(config={'vocab_size': 64})`", "config={'vocab_size': 64} needs model_type",
             _call("lightning_par.models:HFCausalLM", config={"vocab_size": 64})),
    BadInput("a Hugging Face model directory of another shape", "model directory 'hf-model' was written by another "
             "model: model.embed_tokens.weight is (64, 32) there and (64, 48) here", _load_into_other_shape),
    BadInput("a Hugging Face model directory with a truncated `model.safetensors`", "model directory 'changed' cannot "
             "be read: SafetensorError: Error while deserializing header", _load_hf_model(_truncate_weights)),
    BadInput("a Hugging Face model directory of integer (quantized) weights", "model directory 'changed' stores "
             "model.norm.weight as torch.int8, and the model's parameter is torch.float32",
             _load_hf_model(_weights_as_integers)),
    # ------------------------------------------------------------------ fine-tuning data
    BadInput("`TextDataModule(train_files='missing.jsonl')`", "train_files: 'missing.jsonl' does not exist",
             _text_data(train_files="missing.jsonl")),
    BadInput("`TextDataModule(train_files=...)`, an empty file", "train_files: 'empty.txt' is empty",
             _text_data(train_files="empty.txt", prepare=lambda: Path("empty.txt").write_text(""))),
    BadInput("`TextDataModule(text_field='text')` on records without it", "text_field='text' is not a field of "
             "train_files ['notes.jsonl']: its fields are ['title', 'body']", _text_data(train_files="notes.jsonl")),
    BadInput("`TextDataModule(tokenizer=...)`, a directory without a tokenizer", "tokenizer='.' holds no tokenizer",
             _text_data(train_files="notes.jsonl", text_field="body", tokenizer=".")),
    # ------------------------------------------------------------------ pretraining data (docs/data.md)
    BadInput("`lightning-par prepare --input missing.jsonl ...`", "input 'missing.jsonl' does not exist",
             _prepare("missing.jsonl", "out")),
    BadInput("`lightning-par prepare --input latin1.txt ...`, text in latin-1", "latin1.txt: the byte at offset 3 "
             "(0xe9) is not utf-8 (invalid continuation byte): name the file's encoding (--encoding latin-1)",
             _prepare("latin1.txt", "out")),
    BadInput("`lightning-par prepare --output .` into a directory of other files", "'.' is not empty and holds no "
             "prepare: give a new or empty output directory", _prepare("notes.jsonl", ".")),
    BadInput("`StreamingTokenDataModule(data_dir='corpus')`, never prepared", "'corpus' holds no prepared data (no "
             "prepared.json): prepare it with `lightning-par prepare", _streamed("corpus")),
    BadInput("`StreamingTokenDataModule(data_dir={'code': 0.7, 'prose': 0})`", "the weight of 'prose' is 0; weights "
             "must be positive finite numbers", _streamed({"code": 0.7, "prose": 0})),
    BadInput("`StreamingTokenDataModule(data_dir={'shards': 1, 'shards/': 1})`", "data_dir names one directory "
             "twice, as 'shards' and 'shards/'", _streamed({"shards": 1, "shards/": 1})),
    BadInput("a shard file cut short", "the shard 'shards/train/chunk-0-0.bin' holds 10 bytes where its index.json "
             "records", _streamed(truncate=True)),
    BadInput("shards whose `index.json` lost an entry", "'shards/train/index.json' does not list the shard "
             "'chunk-0-0.bin' that prepared.json records (0 shards listed, 1 made)",
             _streamed(edit_index=lambda chunks: chunks[1:])),
    BadInput("an `index.json` whose token count was edited", "'shards/train/index.json' lists the shard 'chunk-0-0.bin' "
             "with tokens 120 where prepared.json records 20",
             _streamed(edit_index=lambda chunks: [{**chunk, "dim": chunk["dim"] + 100} for chunk in chunks])),
    BadInput("shards prepared with another tokenizer than the model's", "'shards' was prepared with the tokenizer "
             "'bytes', which gives other ids than the model's ('hf-model'): prepare it again with --tokenizer hf-model",
             _streamed(tokenizer="hf-model")),
    BadInput("shards of a vocabulary larger than the model's", "'shards' was prepared with the tokenizer 'bytes' of "
             "256 tokens, more than the model's vocab_size=64",
             _streamed(module=SimpleNamespace(config=SimpleNamespace(vocab_size=64), hparams={}))),
    BadInput("a checkpoint carrying pickled code", "checkpoint 'payload.ckpt' holds getattr, which unpickling would "
             "have to construct and which can run code: it was not loaded",
             _checkpoint("payload.ckpt", _rewritten(_set("hyper_parameters", {"innocent": Payload()})))),
]


def markdown_table() -> str:
    """The table of docs/errors.md: each input and the words its message contains."""
    rows = ["| Input | The message says |", "|---|---|"]
    rows += [f"| {bad.given} | {bad.says.replace('|', '&#124;')} |" for bad in BAD_INPUTS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
