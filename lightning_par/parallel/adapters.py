"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") as ``peft`` puts them on a
model, seen from the layouts.

peft replaces an adapted projection with a layer that keeps the original, frozen, as ``base_layer`` and adds per
adapter ``lora_A`` (in features -> r) and ``lora_B`` (r -> out features): ``base(x) + lora_B(lora_A(x)) *
scaling``. Nothing here builds adapters (peft does); these helpers tell the layouts which layers are adapted, which
parameters are the adapters, what a frozen base weight is called in the pretrained checkpoint, and give every
layout the same initial adapters. Tensor parallel splits an adapted layer with its own styles
(``Colwise``/``Rowwise`` in ``lightning_par.parallel.tensor``). No peft import: the checks go by the
structure peft gives its layers, so a model without peft never needs it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

# The submodules and parameters of a peft LoRA layer that hold adapter weights (peft's LoraLayer.adapter_layer_names)
# beyond the plain lora_A/lora_B pair: embedding adapters and DoRA's magnitude.
OTHER_LORA_WEIGHTS = ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_PEFT_MODEL_PREFIX = "base_model.model."  # a PeftModel keeps the model it adapts at base_model (the tuner).model


def is_adapted(module: nn.Module) -> bool:
    """Whether ``module`` is an adapter layer wrapping a base layer (peft's ``BaseTunerLayer``: any tuner type)."""
    return isinstance(module._modules.get("base_layer"), nn.Module)


def is_lora(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer: a base layer with ``lora_A``/``lora_B`` adapters."""
    return (is_adapted(module) and isinstance(module._modules.get("lora_A"), nn.ModuleDict)
            and isinstance(module._modules.get("lora_B"), nn.ModuleDict))


def base_layer(module: nn.Module) -> nn.Module:
    """The layer an adapter layer wraps (through nested adapter layers), or ``module`` itself."""
    while is_adapted(module):
        module = module._modules["base_layer"]
    return module


def adapted_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of every outermost adapter layer in ``module``."""
    inside: list[str] = []
    for name, sub in module.named_modules():
        if any(name.startswith(outer + ".") for outer in inside):
            continue
        if is_adapted(sub):
            inside.append(name)
            yield name, sub


def outside_adapters(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``modules`` (``named_modules`` pairs) without those inside an adapter layer: an adapted projection counts as
    the one projection it computes, not as its base layer and adapters besides."""
    adapted = [name for name, sub in modules if is_adapted(sub)]

    def inside(name: str) -> bool:  # below an adapter layer ("" is the root: everything else is below it)
        return any(name != layer and (not layer or name.startswith(layer + ".")) for layer in adapted)

    return [(n, m) for n, m in modules if not inside(n)]


def unused_lora_weights(layer: nn.Module) -> list[str]:
    """The adapter kinds a LoRA ``layer`` holds beyond ``lora_A``/``lora_B``: its non-empty ``OTHER_LORA_WEIGHTS``."""
    held = []
    for kind in OTHER_LORA_WEIGHTS:
        part = getattr(layer, kind, None)
        if isinstance(part, (nn.ModuleDict, nn.ParameterDict)) and len(part) > 0:
            held.append(kind)
    return held


def adapter_parameter_names(module: nn.Module) -> set[str]:
    """Names (as ``module.named_parameters`` gives them) of the parameters adapter layers add: everything inside an
    adapter layer but its base layer."""
    names: set[str] = set()
    for name, layer in adapted_layers(module):
        for inner, _ in layer.named_parameters():
            if not (inner == "base_layer" or inner.startswith("base_layer.")):
                names.add(f"{name}.{inner}" if name else inner)
    return names


def checkpoint_name(name: str, *, peft_model: bool) -> str:
    """What a base parameter of an adapted model is called in the model's own checkpoint: without peft's
    ``base_layer`` segments and, for a ``PeftModel``, without its ``base_model.model.`` prefix.
    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` -> ``model.layers.0.self_attn.q_proj.weight``.
    """
    if peft_model and name.startswith(_PEFT_MODEL_PREFIX):
        name = name[len(_PEFT_MODEL_PREFIX):]
    return ".".join(part for part in name.split(".") if part != "base_layer")


def is_peft_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``PeftModel``: it holds a tuner (with the adapters' configs) at ``base_model``, and the
    tuner the adapted model at ``model``."""
    tuner = module._modules.get("base_model")
    return (tuner is not None and isinstance(tuner.__dict__.get("peft_config"), dict)
            and isinstance(tuner._modules.get("model"), nn.Module))


def initialize_lora(module: nn.Module, seed: int) -> None:
    """Initialise every LoRA adapter of ``module`` as peft does by default (``lora_A`` Kaiming-uniform like
    ``nn.Linear``, ``lora_B`` and its bias zero, so training starts from the base model), from ``seed`` and each
    parameter's name: the same values in every layout and on every rank, whatever each rank holds of them (a
    tensor-parallel or ZeRO-3 shard, a pipeline stage's layers)."""
    with torch.no_grad():
        for name, layer in adapted_layers(module):
            if not is_lora(layer):
                continue
            for adapter, down in layer.lora_A.items():
                generator = torch.Generator().manual_seed(seed ^ zlib.crc32(f"{name}.lora_A.{adapter}".encode()))
                _fill(down.weight, lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator))
                for parameter in layer.lora_B[adapter].parameters():
                    parameter.zero_()


def _fill(parameter: Tensor, init: Callable[[Tensor], object]) -> None:
    """Set ``parameter`` to its part of a whole tensor ``init`` fills (on the CPU, where the generator draws)."""
    local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
    whole = torch.empty(parameter.shape, dtype=torch.float32)  # a DTensor's shape is the global one
    init(whole)
    whole = whole.to(device=local.device, dtype=parameter.dtype)
    if isinstance(parameter, DTensor):
        # Each rank's piece of the whole, cut locally as the parameter is laid out (no collective).
        piece = distribute_tensor(whole, parameter.device_mesh, parameter.placements, src_data_rank=None)
        local.copy_(piece.to_local())
    else:
        parameter.copy_(whole)


__all__ = ["OTHER_LORA_WEIGHTS", "adapted_layers", "adapter_parameter_names", "base_layer", "checkpoint_name",
           "initialize_lora", "is_adapted", "is_lora", "is_peft_model", "outside_adapters", "unused_lora_weights"]
