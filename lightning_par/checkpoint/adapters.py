"""LoRA fine-tuning (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") of a Hugging Face model
through ``peft``: the settings ``HFCausalLM(lora=...)`` takes, the peft model built from them, and what leaves a run:
a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, what
``PeftModel.from_pretrained(base, directory)`` reads) or the merged model (``base + B A x scaling`` folded into each
adapted weight, a plain directory ``AutoModelForCausalLM.from_pretrained`` reads).

A LoRA run's checkpoints hold the adapters (and their optimizer states) and a reference to the base model directory,
by path and by :func:`lightning_par.checkpoint.huggingface.directory_fingerprint`; :func:`export_lora` rebuilds the model from
the two in one process, as ``lightning-par-export`` runs. peft and transformers are imported only when called (the
``hf`` extra). No lightning import.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_par.checkpoint import validation
from lightning_par.checkpoint.atomic import move_into_place, staging_path
from lightning_par.checkpoint.format import FROZEN_BASE_KEY, consolidated_weights
from lightning_par.checkpoint.huggingface import directory_fingerprint, model_config, save_huggingface
from lightning_par.parallel.adapters import adapted_layers, base_layer, checkpoint_name, unused_lora_weights
from lightning_par.parallel.modules import tied_aliases

__all__ = ["LORA_DEFAULTS", "FROZEN_BASE_KEY", "base_reference", "check_base", "export_lora", "lora_model",
           "lora_settings", "merged_weights", "save_adapter", "with_lora"]

# HFCausalLM's LoRA settings and their defaults (peft's LoraConfig: r, lora_alpha, lora_dropout, target_modules, bias).
LORA_DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": None, "bias": "none",
                                 "seed": 0}
_MODULE_PREFIX = "model."  # HFCausalLM keeps the (peft) Hugging Face model as ``self.model``


def lora_settings(lora: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``lora`` with every setting of :data:`LORA_DEFAULTS`, checked; None stays None (full fine-tuning)."""
    if lora is None:
        return None
    if not isinstance(lora, Mapping):
        raise ValueError(f"lora={lora!r} must be a mapping of LoRA settings, e.g. {{r: 8, alpha: 16, target_modules: "
                         "[q_proj, v_proj]}}")
    unknown = sorted(set(lora) - set(LORA_DEFAULTS))
    if unknown:
        raise ValueError(f"lora has unknown settings {unknown}; the settings are {sorted(LORA_DEFAULTS)}")
    settings = {**LORA_DEFAULTS, **lora}
    if not isinstance(settings["r"], int) or settings["r"] < 1:
        raise ValueError(f"lora r={settings['r']!r} must be a positive integer (the adapters' rank), e.g. 8")
    if not 0.0 <= float(settings["dropout"]) < 1.0:
        raise ValueError(f"lora dropout={settings['dropout']!r} must be in [0, 1)")
    if settings["bias"] not in ("none", "all", "lora_only"):
        raise ValueError(f"lora bias={settings['bias']!r} must be one of 'none', 'all', 'lora_only' (peft's)")
    targets = settings["target_modules"]
    if targets is not None and not (isinstance(targets, str) or (isinstance(targets, (list, tuple)) and targets
                                                                  and all(isinstance(t, str) for t in targets))):
        raise ValueError(f"lora target_modules={targets!r} must be module names (e.g. [q_proj, v_proj]), a regular "
                         "expression, 'all-linear', or None for peft's choice by model type")
    settings["target_modules"] = list(targets) if isinstance(targets, (list, tuple)) else targets
    return settings


def with_lora(model: nn.Module, settings: Mapping[str, Any]) -> nn.Module:
    """``model`` as a peft model with LoRA adapters on ``settings['target_modules']`` (everything else frozen)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("HFCausalLM(lora=...) builds the adapters with peft: pip install 'lightning-par[hf]'") from error
    config = LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                        target_modules=settings["target_modules"], bias=settings["bias"])
    try:
        model = get_peft_model(model, config)
    except ValueError as error:  # targets that match nothing, or a model type peft has no default targets for
        raise ValueError(f"lora target_modules={settings['target_modules']!r} on {type(model).__name__}: {error}") \
            from error
    others = sorted({f"{name} ({type(base_layer(layer)).__name__})" for name, layer in adapted_layers(model)
                     if unused_lora_weights(layer)})
    if others:
        raise ValueError(f"lora target_modules={settings['target_modules']!r} adapt layers that are not projections: "
                         f"{others[:3]}; target linear layers (q_proj, v_proj, ...), not embeddings")
    return model


# ------------------------------------------------------------------------------- the base directory
def base_reference(directory: str | os.PathLike) -> dict[str, str]:
    """What a checkpoint records of the base model directory its frozen parameters come from."""
    return {"directory": str(Path(directory).resolve()), "sha256": directory_fingerprint(directory)}


def check_base(reference: Mapping[str, str], directory: str | os.PathLike | None, *, source: str) -> str | None:
    """Why the frozen base of a checkpoint (``reference``, from :func:`base_reference`) cannot be read from
    ``directory`` (None: the one it names), or None. ``source`` names the checkpoint in the message."""
    directory = Path(reference["directory"] if directory is None else directory)
    if not directory.is_dir():
        return (f"checkpoint {source!r} holds LoRA adapters only, for the base model in {reference['directory']!r}, "
                f"and {str(directory)!r} is not a directory: give the base model directory it was trained from")
    found = directory_fingerprint(directory)
    if found != reference["sha256"]:
        return (f"checkpoint {source!r} holds LoRA adapters trained on the base model in {reference['directory']!r} "
                f"(sha256 {reference['sha256'][:12]}...), but the model files in {str(directory)!r} differ (sha256 "
                f"{found[:12]}...): the adapters only fit the base they were trained on; give that directory")
    return None


# ------------------------------------------------------------------------------------ the model out
def lora_model(config: Any, settings: Mapping[str, Any], weights: Mapping[str, torch.Tensor], *,
               base: str | os.PathLike | None = None) -> nn.Module:
    """The peft model of the transformers ``config`` with the LoRA ``settings``, built on the meta device and given
    ``weights``: whole tensors under the peft model's names (HFCausalLM's ``model.`` prefix allowed). With ``base``
    (a pretrained directory), the frozen tensors ``weights`` lacks are read from its safetensors, in the adapters'
    dtype. Every tensor but a tied alias must be found."""
    from transformers import AutoModelForCausalLM

    prefixed = all(name.startswith(_MODULE_PREFIX) for name in weights)
    weights = {name[len(_MODULE_PREFIX):] if prefixed else name: tensor for name, tensor in weights.items()}
    with torch.device("meta"):
        model = with_lora(AutoModelForCausalLM.from_config(config), settings)
    aliases = tied_aliases(model)
    wanted = [name for name in model.state_dict() if name not in aliases]
    if base is not None:
        dtype = next(iter(weights.values())).dtype  # the dtype the adapters trained in: the merged model keeps it
        saved = _safetensors(base)
        for name in wanted:
            if name not in weights and checkpoint_name(name, peft_model=True) in saved:
                weights[name] = saved[checkpoint_name(name, peft_model=True)].to(dtype)
    missing = [name for name in wanted if name not in weights]
    if missing:
        raise validation.CheckpointError(f"the LoRA model of {type(model.get_base_model()).__name__} lacks {len(missing)} "
                                    f"tensors, e.g. {missing[:3]}")
    model.load_state_dict({name: weights[name] for name in wanted}, assign=True, strict=False)
    model.get_base_model().tie_weights()
    return model


def _safetensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a pretrained directory's safetensors (one file or shards), by the name it is saved under."""
    from safetensors.torch import load_file

    return {name: tensor for path in sorted(Path(directory).glob("*.safetensors"))
            for name, tensor in load_file(path).items()}


def save_adapter(model: nn.Module, output: str | os.PathLike) -> Path:
    """Write the adapters of the peft ``model`` as peft's adapter directory, atomically."""
    output = Path(output)
    staging = staging_path(output)
    if staging.exists():
        shutil.rmtree(staging)
    model.save_pretrained(staging)
    move_into_place(staging, output)
    return output


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the peft ``model`` with every adapter folded into its base weight (peft's
    ``merge_and_unload``), under the plain model's names."""
    return dict(model.merge_and_unload().state_dict())


def export_lora(checkpoint: str | os.PathLike, output: str | os.PathLike, *, merge: bool,
                weights_only: bool | None = None, base: str | os.PathLike | None = None,
                max_shard_size: str | int = "5GB") -> Path:
    """Write the LoRA run's ``checkpoint`` (any layout, sharded or full) as peft's adapter directory, or with ``merge``
    as the merged Hugging Face model directory (with the base's tokenizer files). The base model is read from the
    directory the checkpoint names (``base``: from another path, checked to hold the same files). One process."""
    adapters, saved = consolidated_weights(checkpoint, weights_only=weights_only)
    hyper_parameters = saved.get("hyper_parameters", {})
    settings = lora_settings(hyper_parameters.get("lora"))
    reference = saved.get(FROZEN_BASE_KEY)
    if settings is None or reference is None:
        raise validation.CheckpointError(f"checkpoint {str(checkpoint)!r} is not a LoRA run's (it has no lora settings or "
                                    "no base model reference): export it with --format pt or --format hf")
    problem = check_base(reference, base, source=str(checkpoint))
    if problem:
        raise validation.CheckpointError(problem)
    directory = Path(reference["directory"] if base is None else base)
    config = model_config({**hyper_parameters, "pretrained": str(directory)})
    model = lora_model(config, settings, adapters, base=directory)
    if not merge:
        return save_adapter(model, output)
    return save_huggingface(merged_weights(model), config, output, source=checkpoint, tokenizer_from=directory,
                            max_shard_size=max_shard_size)
