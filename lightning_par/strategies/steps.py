"""Each step of a run through the handle ``parallelize()`` returned (:class:`~lightning_par.parallel.Parallelized`):
under pipeline parallel its runner runs the stages, otherwise the module runs inside the handle's loss context; the
handle also says when gradients are reduced. Lightning's hooks only, no decision about the layout
(docs/architecture.md, "The flow of a run")."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.health.bad_steps import BadStepGuard, BadSteps
from lightning_par.parallel.parallelized import Parallelized
from lightning_par.strategies.checkpointing import ShardedCheckpoints

BAD_STEPS_KEY = "lightning_par_bad_steps"  # the guard's counts and recent losses, in every checkpoint
_SKIPPED = "skipped step"  # an LR scheduler's interval while the step it would follow was skipped


class StepsThroughTheHandle(ShardedCheckpoints):
    """The step hooks of :class:`~lightning_par.strategies.base.MeshStrategy`, which sets ``_parallelized`` up."""

    _parallelized: Parallelized | None = None

    def __init__(self, *, bad_steps: BadSteps | dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        rule = BadSteps.of(bad_steps)
        self._bad_steps = BadStepGuard(rule) if rule.checks else None
        self._held_schedulers: list[Any] = []  # step-interval scheduler configs held back after a skipped step

    @property
    def parallelized(self) -> Parallelized:
        """What ``parallelize()`` made of the model: the handle every step asks (from set-up on)."""
        return self._made(self._parallelized, "parallelized", "when the model is set up (setup)")

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._enter(f"training step {self.lightning_module.trainer.global_step}")
        self._release_schedulers()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._bad_steps is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}

        def judged() -> Any:
            loss = closure()
            self._judge_step(loss if isinstance(loss, Tensor) else None, stepped)
            return loss

        return super().optimizer_step(optimizer, judged, model, **kwargs)

    def _judge_step(self, loss: Tensor | None, stepped: set[int]) -> None:
        """Before the optimizer moves (``lightning_par/health/bad_steps.py``): a bad step's gradients (of the parameters the
        optimizer steps, ids in ``stepped``) are dropped, so it moves nothing and none of its states change, and the
        step-interval LR schedulers are held back for this step, so the run goes on as if the batch had not been
        there (the step still counts toward ``max_steps``)."""
        assert self._bad_steps is not None
        module = self.lightning_module
        trainer = module.trainer
        named = [(name, p) for name, p in module.named_parameters() if id(p) in stepped and p.grad is not None]
        verdict = self._bad_steps.judge(
            loss, [(name, p.grad) for name, p in named], trainer.global_step, device=self.root_device,
            last_checkpoint=self._fault_monitor.last_checkpoint if self._fault_monitor is not None else None)
        if verdict is not None:
            for _, parameter in named:
                parameter.grad = None
            self._hold_schedulers()
            rank_zero_warn(f"step {trainer.global_step} skipped: {verdict.reason}")
        module.log("faults/skipped_steps", float(self._bad_steps.skipped), on_step=True, on_epoch=False)

    def _hold_schedulers(self) -> None:
        """Keep the step-interval LR schedulers where they are after this step (its update was not applied)."""
        for config in self.lightning_module.trainer.lr_scheduler_configs:
            if config.interval == "step":  # Lightning steps a scheduler whose interval is the loop's
                self._held_schedulers.append(config)
                config.interval = _SKIPPED

    def _release_schedulers(self) -> None:
        for config in self._held_schedulers:
            config.interval = "step"
        self._held_schedulers = []

    @override
    def on_train_end(self) -> None:
        self._release_schedulers()
        super().on_train_end()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._bad_steps is not None:
            checkpoint[BAD_STEPS_KEY] = self._bad_steps.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        state = checkpoint.pop(BAD_STEPS_KEY, None)
        if state is not None and self._bad_steps is not None:
            self._bad_steps.load_state_dict(state)
        return checkpoint

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
            output = self._through_the_root("training_step", super().training_step, args, kwargs)
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
        return self._evaluation_step("val_loss", "validation_step", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_loss", "test_step", super().test_step, args, kwargs)

    def _evaluation_step(self, name: str, hook: str, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.parallelized.pipeline is not None:
            loss = self.parallelized.pipeline.evaluate(*self.lightning_module.split_batch(args[0]))
            self.lightning_module.log(name, loss, prog_bar=name == "val_loss", sync_dist=True)
            return loss
        with self.parallelized.loss_context():
            return self._through_the_root(hook, step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.parallelized.pipeline is not None:  # the batch is the model's input; every rank gets the logits
            return self.parallelized.pipeline.predict(args[0])
        # Predictions leave the strategy whole: vocabulary-sharded logits are gathered.
        output = self._through_the_root("predict_step", super().predict_step, args, kwargs)
        return apply_to_collection(output, DTensor, DTensor.full_tensor)

    def _through_the_root(self, hook: str, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run the LightningModule's ``hook`` (``training_step``, ...) through the module's own ``forward`` where ZeRO-3
        made the LightningModule itself an FSDP2 root, as Lightning's FSDP strategies route the step through their
        wrapper: FSDP2 gathers the root's parameters (those outside every block: an embedding, a head) in the root's
        forward hooks, which a step that calls a submodule (``self.model(x)``) would never run. Lightning itself routes
        the step through a DDP wrapper, which is not the LightningModule."""
        module = self.lightning_module
        if self.model is not module or not isinstance(module, FSDPModule):
            return step(*args, **kwargs)
        context = {"training_step": self.precision_plugin.train_step_context,
                   "validation_step": self.precision_plugin.val_step_context,
                   "test_step": self.precision_plugin.test_step_context,
                   "predict_step": self.precision_plugin.predict_step_context}[hook]
        with context():
            return self._forward_redirection(module, module, hook, *args, **kwargs)

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
