"""parallelize() keeps what it did beside the module (lightning_par.parallel.parallelized), never on it."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed


def _lightning_par_state_on(module: torch.nn.Module) -> list[str]:
    """Attributes of ``module`` and its submodules (the user's: not the stand-ins a pipeline stage puts in place
    of the parts it does not run) that hold lightning_par's parallel or strategy objects."""
    found = []
    for name, sub in module.named_modules():
        if type(sub).__module__.startswith("lightning_par.parallel"):
            continue
        for attribute, value in vars(sub).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            kinds = {type(v).__module__ for v in values}
            if "lightning_par" in attribute or any(k.startswith(("lightning_par.parallel", "lightning_par.strategies"))
                                                   for k in kinds):
                found.append(f"{name or type(module).__name__}.{attribute}")
    return found


def _fit(rank: int, world_size: int, strategy: str) -> dict:
    import lightning

    from lightning_par import Hybrid3DStrategy, ZeroStrategy
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM
    from lightning_par.parallel.compose import applied_layout, pipeline_stages, stage_ties

    make = {"pp2xtp2": lambda: Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2),
            "zero2": lambda: ZeroStrategy(stage=2)}[strategy]
    module = LlamaLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=True)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy=make(), max_steps=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0)
    trainer.fit(module, datamodule=TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=4,
                                                   num_samples=32))
    return {"on_module": _lightning_par_state_on(module), "layout": applied_layout(module) is not None,
            "stages": len(pipeline_stages(module)), "ties": stage_ties(module) is not None}


@pytest.mark.parametrize(("layout", "world_size"), [("pp2xtp2", 4), ("zero2", 2)])
def test_nothing_of_lightning_par_is_set_on_the_users_module(layout: str, world_size: int) -> None:
    for result in run_distributed(_fit, world_size, layout):
        assert result["on_module"] == []
        assert result["layout"]
        if layout == "pp2xtp2":  # stages and the tied embedding's copies are found through the record
            assert result["stages"] == 1 and result["ties"]
