"""Hugging Face model directories in and out: pretrained safetensors read into any layout, checkpoints written back
as a directory ``from_pretrained`` reads.

In: :func:`load_huggingface_weights` reads through ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``,
so each rank reads only the slices of the safetensors its shards and stages hold. Out:
:func:`export_huggingface` consolidates a checkpoint of any layout (one process, as ``lightning-par-export``) and
writes ``config.json`` and safetensors (sharded with an index above ``max_shard_size``) with transformers' own
``save_pretrained``, plus the tokenizer files of the directory the model was fine-tuned from. No parser of ours.

transformers is imported only here, and only when called (the ``hf`` extra). No lightning import.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from lightning_par.checkpoint import validation
from lightning_par.checkpoint.atomic import move_into_place, staging_path
from lightning_par.checkpoint.format import FROZEN_BASE_KEY, consolidated_weights, with_aliases
from lightning_par.parallel.adapters import adapter_parameter_names, checkpoint_name, is_peft_model
from lightning_par.parallel.modules import clean_name, materialize_meta_parameters, tied_aliases

__all__ = ["load_huggingface_weights", "export_huggingface", "save_huggingface", "model_config",
           "config_from_arguments", "directory_fingerprint", "TOKENIZER_FILES"]

# What a tokenizer saved with save_pretrained leaves in the model directory (those present are copied on export).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
_MODULE_PREFIX = "model."  # HFCausalLM keeps the Hugging Face model as ``self.model``
# What defines a pretrained model in its directory: its configuration and its weights (one file, or shards and their
# index); the tokenizer and README do not change what the model computes.
_MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")


def load_huggingface_weights(module: nn.Module, directory: str | os.PathLike, *,
                             device: torch.device | str = "cpu") -> None:
    """Read a Hugging Face model directory's safetensors (one file, or sharded with an index) into ``module`` as
    this rank holds it: its tensor-parallel and FSDP shards, its pipeline stages. Each rank reads only the slices
    it needs; parameters still on the meta device are allocated on ``device`` first. Names, shapes and dtypes are
    checked before anything is read, with the same message on every rank: floating-point weights of another
    precision (bf16 safetensors into fp32 parameters) are converted, integer ones refused. Collective when a process
    group is up."""
    directory = Path(directory)
    materialize_meta_parameters(module, torch.device(device))
    aliases = tied_aliases(module)  # safetensors stores a tied head once, under the embedding's name
    # Fused projections regrouped for tensor parallel are read in the directory's order (their state_dict hooks).
    state = {name: value for name, value in get_model_state_dict(module).items() if name not in aliases}
    # Under LoRA (peft) the directory holds the base model: adapters are not in it, and each base weight is read
    # under the name it has there (without peft's base_layer and PeftModel prefix).
    adapters = {clean_name(name) for name in adapter_parameter_names(module)}
    peft_model = is_peft_model(module)
    base = {checkpoint_name(name, peft_model=peft_model): value for name, value in state.items()
            if name not in adapters}
    expected = validation.expected_shapes(base)
    try:
        metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
        saved = validation.saved_shapes(metadata, prefix="")
        problem = (validation.model_problem(directory, saved, expected, strict=True, what="model directory")
                   or validation.dtype_problem(directory, metadata, base, prefix="", what="model directory"))
    except Exception as error:  # noqa: BLE001 - a directory the reader cannot index is the problem to report
        problem = f"model directory {str(directory)!r} cannot be read: {validation.one_line(error)}"
    validation.agree(problem)
    dcp.load(base, storage_reader=HuggingFaceStorageReader(str(directory)))  # into the tensors of ``state``
    set_model_state_dict(module, with_aliases(state, aliases))


def directory_fingerprint(directory: str | os.PathLike) -> str:
    """The sha256 of a pretrained model directory's model files (:data:`_MODEL_FILES`), names and contents in name
    order: equal for two copies of a model, different once a weight changes. Reads every weight file once."""
    directory = Path(directory)
    digest = hashlib.sha256()
    for path in sorted({path for pattern in _MODEL_FILES for path in directory.glob(pattern)}):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as file:
            while block := file.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def config_from_arguments(arguments: dict[str, Any]) -> Any:
    """A transformers config from ``AutoConfig.for_model``'s arguments, ``model_type`` among them."""
    from transformers import AutoConfig

    arguments = dict(arguments)
    model_type = arguments.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"config={arguments!r} needs model_type (e.g. 'llama', 'qwen2', 'gpt2')")
    return AutoConfig.for_model(model_type, **arguments)


def model_config(hyper_parameters: dict[str, Any]) -> Any:
    """The transformers config of an HFCausalLM from its hyper-parameters: the pretrained directory's
    ``config.json``, or the ``config`` arguments."""
    from transformers import AutoConfig

    pretrained, arguments = hyper_parameters.get("pretrained"), hyper_parameters.get("config")
    if pretrained is not None and (Path(pretrained) / "config.json").is_file():
        return AutoConfig.from_pretrained(pretrained)
    if arguments is not None:
        return config_from_arguments(arguments)
    raise ValueError("the checkpoint does not say which Hugging Face model it holds: its hyper-parameters have "
                     f"neither config nor a pretrained directory that still exists (pretrained={pretrained!r}); "
                     "export checkpoints of lightning_par.models.HFCausalLM")


def export_huggingface(checkpoint: str | os.PathLike, output: str | os.PathLike, *, weights_only: bool | None = None,
                       max_shard_size: str | int = "5GB") -> Path:
    """Write an HFCausalLM checkpoint of any layout (sharded or full) as a Hugging Face model directory (see
    :func:`save_huggingface`). One process; returns ``output``."""
    weights, saved = consolidated_weights(checkpoint, weights_only=weights_only)
    if FROZEN_BASE_KEY in saved:
        raise validation.CheckpointError(f"checkpoint {str(checkpoint)!r} holds a LoRA run's adapters, not a whole model: "
                                    "export the adapters with --format peft, or the merged model with --format hf "
                                    "--merge")
    hyper_parameters = saved.get("hyper_parameters", {})
    return save_huggingface(weights, model_config(hyper_parameters), output, source=checkpoint,
                            tokenizer_from=hyper_parameters.get("pretrained"), max_shard_size=max_shard_size)


def save_huggingface(weights: dict[str, torch.Tensor], config: Any, output: str | os.PathLike, *,
                     source: str | os.PathLike | None = None, tokenizer_from: str | os.PathLike | None = None,
                     max_shard_size: str | int = "5GB") -> Path:
    """Write whole ``weights`` (an HFCausalLM's, ``model.``-prefixed, or the bare model's) of the model ``config``
    describes as a Hugging Face model directory: ``config.json``, the weights as safetensors (sharded with
    ``model.safetensors.index.json`` above ``max_shard_size``) and the tokenizer files found in ``tokenizer_from``.
    ``AutoModelForCausalLM.from_pretrained(output)`` then gives that model. Atomic: the directory is written beside
    ``output`` and renamed into place when complete. Names and shapes are checked first (``source``, the checkpoint
    the weights came from, names them in the message)."""
    from transformers import AutoModelForCausalLM

    output = Path(output)
    prefixed = all(name.startswith(_MODULE_PREFIX) for name in weights)
    weights = {name[len(_MODULE_PREFIX):] if prefixed else name: tensor for name, tensor in weights.items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    problem = validation.model_problem(Path(source or output), {n: tuple(t.shape) for n, t in weights.items()}, expected,
                                  strict=True)
    if problem:
        raise validation.CheckpointError(problem)
    model.load_state_dict({name: weights[name] for name in expected}, assign=True)
    model.tie_weights()
    staging = staging_path(output)
    if staging.exists():
        shutil.rmtree(staging)
    model.save_pretrained(staging, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES if tokenizer_from else ():
        if (Path(tokenizer_from) / name).is_file():
            shutil.copy(Path(tokenizer_from) / name, staging / name)
    move_into_place(staging, output)
    return output
