"""Third-party models: a Hugging Face Llama inside an ordinary LightningModule, parallelized from the
derived map with no model-specific code, matches one process (tiny config, random weights, no download)."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
from installed import require
import torch
import torch.nn.functional as F
from parity import assert_layout_matches
from test_data_parallel import STEPS, make_datamodule

transformers = require("transformers")

PARITY_RTOL = 1e-5


class CausalLM(pl.LightningModule):
    """Next-token training of any Hugging Face causal LM; nothing here knows which family it is."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        model_config = transformers.AutoConfig.for_model(**config)
        self.model = transformers.AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa")

    def split_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[:, :-1], batch[:, 1:]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs).logits

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = self.split_batch(batch)
        return self.loss_fn(self(inputs), targets)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
             tie_word_embeddings=False)
make_llama = functools.partial(CausalLM, LLAMA)
MIXTRAL = dict(model_type="mixtral", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=16, use_cache=False, tie_word_embeddings=False)
make_mixtral = functools.partial(CausalLM, MIXTRAL)


def make_strategy(name: str, **kwargs):
    import lightning_par

    return getattr(lightning_par, name)(**kwargs)


@pytest.mark.parametrize(
    ("world_size", "strategy", "kwargs"),
    [
        (2, "TensorParallelStrategy", dict(tensor_parallel_size=2)),
        (2, "TensorParallelStrategy", dict(tensor_parallel_size=2, sequence_parallel=True, loss_parallel=True)),
        (2, "ContextParallelStrategy", dict(context_parallel_size=2, context_parallel_method="ulysses")),
        (2, "ContextParallelStrategy", dict(context_parallel_size=2, context_parallel_method="ring")),
        (2, "PipelineParallelStrategy", dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", microbatches=2)),
    ],
    ids=["tp2", "tp2-sp-loss", "cp2-ulysses", "cp2-ring", "pp2-1f1b"],
)
def test_hugging_face_llama_matches_single_process(world_size: int, strategy: str, kwargs: dict) -> None:
    datamodule = functools.partial(make_datamodule, batch_size=4)
    assert_layout_matches(make_llama, datamodule, functools.partial(make_strategy, strategy, **kwargs),
                          world_size=world_size, dp=1, steps=STEPS, rtol=PARITY_RTOL,
                          label=f"HF Llama {strategy} {kwargs}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_hugging_face_mixtral_under_expert_parallel_matches_single_process(world_size: int) -> None:
    """Mixtral's experts (stacked 3-D weights) split over ep ranks by the derived map."""
    assert_layout_matches(make_mixtral, make_datamodule,
                          functools.partial(make_strategy, "ExpertParallelStrategy", expert_parallel_size=world_size),
                          world_size=world_size, dp=world_size, steps=STEPS, rtol=PARITY_RTOL,
                          label=f"HF Mixtral ep={world_size}")
