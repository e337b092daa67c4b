"""Per-block compilation with ``torch.compile`` (Ansel et al. 2024, "PyTorch 2"), after the blocks are sharded.

Every transformer block of the model map is compiled in place (``nn.Module.compile``), as torchtitan compiles its
blocks: the blocks of a decoder share their code, so one graph serves them all, and the code between blocks
(embedding, head, the pipeline's stand-ins) stays eager. Compiling in place keeps the module tree and its names:
state dicts hold no ``_orig_mod.`` prefix, so compiled and uncompiled checkpoints load into each other
(Lightning #21357 is the problem this avoids). It runs after tensor/sequence/context/expert parallel and
activation checkpointing, which it compiles with the block, and before FSDP2 and DDP wrap it: their hooks stay
outside the compiled region (dynamo skips FSDP2's hooks by default). A mixture-of-experts layer's routed part
(dispatch, experts, combine) is marked to run eagerly between the block's graphs: its sizes change with the routing
every step (``MoEFeedForward._routed``, and ``_RoutedExperts`` in ``experts.py``). On CPU the backend is inductor's
C++ code, which needs a C compiler.
"""

from __future__ import annotations

from torch import nn

from lightning_par.parallel.model_map import ModelMap


def apply_compile(module: nn.Module, model_map: ModelMap | None, *, enabled: bool = True) -> nn.Module:
    """Compile every block of ``model_map`` in ``module`` (in place); returns ``module``."""
    if not enabled:
        return module
    if model_map is None:
        raise ValueError("compile=True compiles each transformer block, and no model map says where the blocks "
                         "are: give the strategy a model map (model_map: {blocks: ...}), use a standard decoder "
                         "layout, or compile the model yourself in configure_model() and set compile=False")
    for block in module.get_submodule(model_map.blocks).children():
        if next(block.parameters(), None) is not None:  # a pipeline stage's stand-in has nothing to compile
            block.compile()
    return module


__all__ = ["apply_compile"]
