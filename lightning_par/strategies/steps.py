"""Each step of a run through the handle ``parallelize()`` returned (:class:`~lightning_par.parallel.Parallelized`):
under pipeline parallel its runner runs the stages, otherwise the module runs inside the handle's loss context; the
handle also says when gradients are reduced. Lightning's hooks only, no decision about the layout
(docs/architecture.md, "The flow of a run")."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.parallel.parallelized import Parallelized
from lightning_par.strategies.checkpointing import ShardedCheckpoints


class StepsThroughTheHandle(ShardedCheckpoints):
    """The step hooks of :class:`~lightning_par.strategies.base.MeshStrategy`, which sets ``_parallelized`` up."""

    _parallelized: Parallelized | None = None

    @property
    def parallelized(self) -> Parallelized:
        """What ``parallelize()`` made of the model: the handle every step asks (from set-up on)."""
        return self._made(self._parallelized, "parallelized", "when the model is set up (setup)")

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._enter(f"training step {self.lightning_module.trainer.global_step}")
        super().on_train_batch_start(batch, batch_idx)

    # Under pipeline parallel the runner runs the stages (the model's split_batch -> forward -> loss_fn) and every
    # rank logs the same loss; training_step, validation_step and test_step of the module are not called.
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.parallelized.pipeline is not None:
            inputs, targets = self.lightning_module.split_batch(args[0])
            loss = self.parallelized.pipeline.train_step(inputs, targets, list(self.lightning_module.parameters()))
            self.lightning_module.log("train_loss", loss, prog_bar=True, sync_dist=True)
            return loss
        share = self._token_share(args[0])
        with self.parallelized.loss_context():
            output = super().training_step(*args, **kwargs)
        if share is None:
            return output
        if isinstance(output, Tensor):
            return output * share
        return {**output, "loss": output["loss"] * share}

    def _token_share(self, batch: Any) -> Tensor | None:
        """For a model whose loss is the mean over the positions ``loss_tokens(targets)`` counts (masked prompts,
        padding, packed documents): the factor that makes this rank's mean its part of the global batch's token mean
        (``Parallelized.token_share``). None for other models, and when one rank reads all the data."""
        count = getattr(self.lightning_module, "loss_tokens", None)
        if count is None or self.mesh.size("dp") == 1:
            return None
        return self.parallelized.token_share(count(self.lightning_module.split_batch(batch)[1]))

    @override
    def on_validation_end(self) -> None:
        # What fails next (a step, setting up the training data) is no longer part of the validation.
        trainer = self.lightning_module.trainer
        self._enter(f"training after step {trainer.global_step}" if trainer.state.fn == TrainerFn.FITTING
                    else "after validation")
        super().on_validation_end()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._enter("validation")
        return self._evaluation_step("val_loss", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_loss", super().test_step, args, kwargs)

    def _evaluation_step(self, name: str, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.parallelized.pipeline is not None:
            loss = self.parallelized.pipeline.evaluate(*self.lightning_module.split_batch(args[0]))
            self.lightning_module.log(name, loss, prog_bar=name == "val_loss", sync_dist=True)
            return loss
        with self.parallelized.loss_context():
            return step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.parallelized.pipeline is not None:  # the batch is the model's input; every rank gets the logits
            return self.parallelized.pipeline.predict(args[0])
        # Predictions leave the strategy whole: vocabulary-sharded logits are gathered.
        return apply_to_collection(super().predict_step(*args, **kwargs), DTensor, DTensor.full_tensor)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.parallelized.pipeline is not None:  # the schedule ran backward in training_step: take its gradients
            self.parallelized.pipeline.take_gradients()
            self.post_backward(closure_loss)
            return closure_loss
        with self.parallelized.loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self.parallelized.no_sync():
            yield

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.parallelized.after_backward()


__all__ = ["StepsThroughTheHandle"]
