"""What pipeline parallel derives of a module written for Lightning's own strategies
(lightning_par/strategies/pipeline_contract.py), on one process; tests/test_clients.py trains it against Lightning's
ddp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from clients import VOCAB, PlainPairs

from lightning_par.strategies.pipeline_contract import complete_pipeline_contract


class TwoPasses(PlainPairs):
    """R-drop: the loss compares two passes."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        first, second = self(inputs), self(inputs)
        return F.cross_entropy(first.reshape(-1, VOCAB), targets.reshape(-1)) + (first - second).pow(2).mean()


class ReadsItsInputs(PlainPairs):
    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return F.cross_entropy(self(inputs).reshape(-1, VOCAB), targets.reshape(-1)) * (inputs.shape[1] / 16)


def test_the_loss_is_the_steps_on_the_last_stages_logits_and_a_step_it_cannot_be_taken_from_is_refused() -> None:
    torch.manual_seed(0)
    module = PlainPairs()
    complete_pipeline_contract(module)
    inputs, targets = torch.randint(0, VOCAB, (2, 4, 8))
    assert module.split_batch((inputs, targets)) == (inputs, targets)
    logits = torch.randn(4, 8, VOCAB)
    assert torch.equal(module.loss_fn(logits, targets), F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)))
    assert module.forward.__func__ is PlainPairs.forward  # the module's own forward again after the loss
    for kind, message in ((TwoPasses, "calls self\\(...\\) 2 times"), (ReadsItsInputs, "uses its inputs otherwise")):
        module = kind()
        complete_pipeline_contract(module)
        with pytest.raises(TypeError, match=message):
            module.loss_fn(logits, targets)
    with pytest.raises(TypeError, match="needs PlainPairs to define split_batch\\(\\) and loss_fn\\(\\)"):
        module = PlainPairs()
        complete_pipeline_contract(module)
        module.split_batch(inputs)
