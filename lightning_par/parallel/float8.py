"""Float8 training of the blocks' linear layers with torchao (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"; the recipes are torchao's, as torchtitan uses them).

Each converted ``nn.Linear`` casts its input and weight to ``float8_e4m3fn`` with a dynamic scale (the amax of
the tensor now, not a history) and multiplies with ``torch._scaled_mm``, accumulating in high precision; the
output, the weights the optimizer sees and the checkpoint names stay as they were (``Float8Linear`` is an
``nn.Linear``). Two recipes:

* ``tensorwise``: one scale per tensor; gradients in ``e5m2``. Under ZeRO-3 FSDP2 all-gathers the weights
  already cast to float8 (one byte per element instead of the parameter dtype's), their scales from one amax
  all-reduced over the shards.
* ``rowwise``: one scale per row of each operand (per token, per output feature), all in ``e4m3``: more
  accurate where rows differ in range, gathered in the parameter dtype (torchao casts after the gather).

What is converted: the ``nn.Linear`` layers inside the map's blocks. What is not, and why, is returned and
logged: the head and embeddings (outside the blocks: the logits are where low precision hurts most), a
mixture-of-experts router (a rounding must not change which expert a token goes to), layers whose sizes are not
multiples of 16 (``_scaled_mm``'s tiles), GPT-2's ``Conv1D`` and stacked expert weights (not ``nn.Linear``).

``torch._scaled_mm`` runs on CUDA devices of compute capability 8.9 and above (Ada, Hopper; rowwise scales on
9.0 and above) and on CPUs; elsewhere it is refused before training with torch's reason, unless ``emulate``
asks torchao to round the operands to float8 and multiply them in high precision (what the CPU tests use).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_par.layout.config import FLOAT8_RECIPES
from lightning_par.parallel.model_map import ModelMap, is_conv1d

# Linear layers that route tokens to experts: a changed rounding would change the routing, not just a product.
ROUTER_NAMES = ("router", "gate")
# torch._scaled_mm multiplies in tiles of 16 along every dimension.
FLOAT8_MULTIPLE = 16


@dataclass
class Float8Conversion:
    """What :func:`apply_float8` converted, and what it left in high precision with the reason."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        text = f"float8 ({self.recipe}): {len(self.converted)} linear layers converted"
        if self.skipped:
            text += "; kept in high precision: " + "; ".join(f"{name} ({why})" for name, why in self.skipped.items())
        return text


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ValueError("float8 training needs torchao (pip install torchao, or pip install 'lightning-par[float8]'); "
                         f"it could not be imported: {error}") from error
    return float8


def float8_linear_config(recipe: str, *, emulate: bool = False, fsdp_all_gather: bool = False):
    """torchao's ``Float8LinearConfig`` for ``recipe``; ``fsdp_all_gather`` (tensorwise only) makes FSDP2 gather
    the weights in float8."""
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8={recipe!r} is not one of {FLOAT8_RECIPES}")
    config = _torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise")


def check_float8_device(device: torch.device, recipe: str, log: Callable[[str], None] | None = None) -> None:
    """Raise ``ValueError`` with torch's reason when ``device`` cannot run a float8 matmul with ``recipe``'s scales.

    A 16 x 16 product is tried rather than a table of devices consulted: what decides is whether this build of
    torch has the kernel for this device. On a CPU it runs, slowly: ``log`` is told."""
    a = torch.ones(FLOAT8_MULTIPLE, FLOAT8_MULTIPLE, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(FLOAT8_MULTIPLE, FLOAT8_MULTIPLE, device=device).to(torch.float8_e4m3fn).t()
    if recipe == "rowwise":
        scale_a = torch.ones(FLOAT8_MULTIPLE, 1, device=device)
        scale_b = torch.ones(1, FLOAT8_MULTIPLE, device=device)
    else:
        scale_a = scale_b = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"float8={recipe!r}: this device ({name}) cannot multiply in float8 ({reason}). Float8 "
                         "needs a CUDA GPU of compute capability 8.9 or above (9.0 for rowwise), or a CPU; set "
                         "float8_emulate=True to round to float8 and multiply in high precision, or "
                         "float8=None") from error
    if device.type == "cpu" and log is not None:
        log(f"float8={recipe!r} on a CPU: torch._scaled_mm's CPU kernel is a reference, about 1,000x slower than a "
            "matmul; float8_emulate=True rounds to float8 at matmul speed")


def float8_candidates(module: nn.Module, model_map: ModelMap) -> Float8Conversion:
    """Which linear layers of the blocks :func:`apply_float8` would convert, and why the others are not."""
    if model_map is None:
        raise ValueError("float8 converts the linear layers of the transformer blocks, and no model map says where "
                         "the blocks are: give the strategy a model map (model_map: {blocks: ...}) or use a standard "
                         "decoder")
    report = Float8Conversion(recipe="")
    blocks = module.get_submodule(model_map.blocks)
    float8_linear = _torchao_float8().float8_linear.Float8Linear
    # nn.MultiheadAttention reads its out_proj's weight in a functional call, never calling the layer.
    read_directly = {id(m.out_proj) for m in blocks.modules() if isinstance(m, nn.MultiheadAttention)}
    for name, child in blocks.named_modules():
        full = f"{model_map.blocks}.{name}"
        if isinstance(child, float8_linear):
            report.converted.append(full)  # by the user, with torchao: trained in float8 as it is
        elif is_conv1d(child):
            report.skipped[full] = "Conv1D, not an nn.Linear"
        elif isinstance(child, nn.Linear):
            if id(child) in read_directly:
                report.skipped[full] = "nn.MultiheadAttention multiplies by its weight itself"
            elif name.rsplit(".", 1)[-1] in ROUTER_NAMES:
                report.skipped[full] = "expert router"
            elif child.in_features % FLOAT8_MULTIPLE or child.out_features % FLOAT8_MULTIPLE:
                report.skipped[full] = (f"{child.in_features} x {child.out_features} is not a multiple of "
                                        f"{FLOAT8_MULTIPLE}")
            else:
                report.converted.append(full)
        elif name and any(p.dim() == 3 for p in child.parameters(recurse=False)):
            report.skipped[full] = "stacked expert weights, not an nn.Linear"
    return report


def apply_float8(module: nn.Module, model_map: ModelMap | None, recipe: str | None, *, emulate: bool = False,
                 fsdp_all_gather: bool = False) -> Float8Conversion | None:
    """Swap the blocks' eligible ``nn.Linear`` layers of ``module`` for torchao's ``Float8Linear`` (in place, same
    parameters and names); returns what was converted and what was not (None when ``recipe`` is None).

    Raises ``ValueError`` when no layer can be converted: float8 asked for and nothing trained in it would be
    another run than the one asked for."""
    if recipe is None:
        return None
    config = float8_linear_config(recipe, emulate=emulate, fsdp_all_gather=fsdp_all_gather)
    report = float8_candidates(module, model_map)
    report.recipe = recipe
    if not report.converted:
        kept = "; ".join(f"{name}: {why}" for name, why in report.skipped.items()) or "no nn.Linear in them"
        raise ValueError(f"float8={recipe!r} found no linear layer to convert in the blocks {model_map.blocks!r} "
                         f"({kept}); set float8=None")
    torchao_float8 = _torchao_float8()
    converted_already = torchao_float8.float8_linear.Float8Linear
    chosen = {name for name in report.converted if not isinstance(module.get_submodule(name), converted_already)}
    torchao_float8.convert_to_float8_training(
        module.get_submodule(model_map.blocks), config=config,
        module_filter_fn=lambda _layer, name: f"{model_map.blocks}.{name}" in chosen)
    return report


class _PrecomputeScales:
    """Forward pre-hooks: the scales of every weight below a module that FSDP2 gathers in float8, from their amaxes
    over all their shards in one all-reduce.

    Without them torchao computes each weight's scale as FSDP2 gathers it, over the data-parallel shards only: a
    tensor-parallel weight would get one scale per tensor-parallel piece, and the run would round otherwise than
    one process does. Before every forward, not after the optimizer step as torchtitan does, so that weights loaded
    from a checkpoint or changed by the user are never multiplied with stale scales.

    Installed before FSDP2's root pre-forward hook (whose prefetch gathers the first blocks with the scales at
    hand) and on the network the root runs, for a training step that calls the network directly; once a forward."""

    def __init__(self) -> None:
        self.fresh = False  # computed by the root's hook for the network's forward now running

    def before_root(self, module: nn.Module, args: tuple) -> None:
        _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(module)
        self.fresh = True

    def before_network(self, module: nn.Module, args: tuple) -> None:
        if not self.fresh:
            _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(module)

    def after_network(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.fresh = False


def precompute_scales_before_forward(root: nn.Module, network: nn.Module) -> None:
    """Install :class:`_PrecomputeScales` on an FSDP2 ``root`` (the model, or a pipeline stage) whose float8 layers
    FSDP2 gathers in float8, and on the ``network`` below it that runs them (the root itself where it is one)."""
    hooks = _PrecomputeScales()
    root.register_forward_pre_hook(hooks.before_root, prepend=True)  # FSDP2's own hook was prepended before
    if network is not root:
        network.register_forward_pre_hook(hooks.before_network)
        network.register_forward_hook(hooks.after_network, always_call=True)


__all__ = ["FLOAT8_RECIPES", "Float8Conversion", "apply_float8", "check_float8_device", "float8_candidates",
           "float8_linear_config", "precompute_scales_before_forward"]
