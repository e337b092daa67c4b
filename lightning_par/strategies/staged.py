"""StagedStrategy: a MeshStrategy that runs pipeline stages with a schedule when the layout has pp > 1.

The shared engine of ``pipeline_parallel`` and ``hybrid3d``. With ``pp == 1`` every step is the plain
MeshStrategy step; with ``pp > 1`` a ``torch.distributed.pipelining`` schedule runs forward, loss and
backward of all micro-batches inside ``training_step`` (DESIGN.md, Lightning integration notes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.parallel.bubble import BubbleMeter
from lightning_par.parallel.comm import PipelineSends
from lightning_par.parallel.compose import pipeline_stages
from lightning_par.parallel.pipeline import (
    build_schedule,
    check_microbatches,
    forward_through_stages,
    last_stage_rank,
)
from lightning_par.strategies.base import MeshStrategy


class StagedStrategy(MeshStrategy):
    """Runs this rank's pipeline stages with the configured schedule when ``pp > 1``.

    Model contract under pipeline parallel (the schedule runs forward and loss itself, so ``training_step``
    and ``validation_step`` are not called): ``split_batch(batch) -> (inputs, targets)``, ``forward(inputs)
    -> logits`` through a network submodule that holds the blocks, embedding and head, and
    ``loss_fn(logits, targets) -> mean loss``. The strategy logs ``train_loss`` / ``val_loss`` /
    ``test_loss`` (the same value on every rank). ``bubble_fraction`` is the idle share of this rank's last
    training step, measured (``parallel/bubble.py``; logged by the monitoring callbacks).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.parallel_config.pp > 1 and not self._save_distributed_checkpoint:
            with self.in_argument_names():
                raise ValueError(f"pp={self.parallel_config.pp}: each rank saves its own stages, so checkpoints are "
                                 "sharded; save_distributed_checkpoint=False is not supported - export a single file "
                                 "with lightning-par-export instead")
        self._schedule: Any = None
        self._forward_schedule: Any = None  # predict: no targets, no loss
        self._make_schedule: dict[str, Callable[[], Any]] = {}
        # The micro-batch shape each schedule was first stepped with, and the one the stages last ran.
        self._schedule_shape: dict[str, tuple[int, ...]] = {}
        self._stage_shape: tuple[int, ...] | None = None
        self._accumulate = 1
        self._pending_grads: list[tuple[Tensor, Tensor]] = []
        self._holds_first = self._holds_last = False
        self._last_stage_global_rank = 0
        self._bubble: BubbleMeter | None = None
        self.bubble_fraction: float | None = None  # idle share of this rank's last training step (pp > 1)
        self.pipeline_sends: PipelineSends | None = None  # bytes the stages send, for the communication monitor

    @property
    def pipelined(self) -> bool:
        return self.parallel_config.pp > 1

    @override
    def setup(self, trainer: Trainer) -> None:
        if not self.pipelined:
            super().setup(trainer)
            return
        self._accumulate = trainer.accumulate_grad_batches
        config = self.parallel_config
        for name in ("split_batch", "loss_fn"):
            if not callable(getattr(self.lightning_module, name, None)):
                raise TypeError(f"pipeline parallel needs the LightningModule to define {name}(); the schedule runs "
                                "split_batch -> forward -> loss_fn itself (see docs/pipeline_parallel.md)")
        check_microbatches(config.pp_microbatches, config.pp_schedule, config.pp)
        super().setup(trainer)
        module = self.lightning_module
        micro, accumulate = config.pp_microbatches, self._accumulate

        def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
            # Summed over micro-batches and accumulated batches, the gradients are those of the mean loss.
            return module.loss_fn(logits, targets) / (micro * accumulate)

        stages = pipeline_stages(module)
        self._make_schedule = {"train": lambda: build_schedule(stages, config.pp_schedule, micro, loss_fn),
                               "eval": lambda: build_schedule(stages, config.pp_schedule, micro, None)}
        self._schedule_shape, self._stage_shape = {}, None
        self._bubble = BubbleMeter(stages, self.root_device)
        self.pipeline_sends = PipelineSends(stages)
        # Fixed for the run: whether this rank feeds the inputs or computes the loss, and which rank does.
        self._holds_first = any(stage.is_first for stage in stages)
        self._holds_last = any(stage.is_last for stage in stages)
        last = last_stage_rank(config.pp, config.pp_schedule, config.pp_virtual_stages)
        self._last_stage_global_rank = dist.get_global_rank(self.mesh.group("pp"), last)

    @override
    def _sample_batch(self) -> tuple[Tensor, Tensor] | None:
        # One micro-batch of the first batch: traced to place the code outside the blocks, timed by
        # balancing by profile.
        sample = super()._sample_batch()
        if not self.pipelined or sample is None:
            return sample
        inputs, targets = sample
        size = max(1, inputs.shape[0] // self.parallel_config.pp_microbatches)
        return inputs[:size], targets[:size]

    def _stage_inputs(self, inputs: Tensor) -> tuple[Tensor, ...]:
        """What this rank passes to the schedule: the inputs on the first stage's rank, nothing elsewhere.
        Every stage also gets them as ``tokens`` (a keyword, split into micro-batches like the inputs)."""
        config = self.parallel_config
        check_microbatches(config.pp_microbatches, config.pp_schedule, config.pp, inputs.shape[0])
        return (inputs,) if self._holds_first else ()

    def _ready_schedule(self, kind: str, inputs: Tensor) -> Any:
        """The ``"train"`` or ``"eval"`` schedule, prepared for this batch's micro-batch shape.

        PyTorch's pipeline stages size their receive buffers when a schedule first steps, for that step's
        micro-batch shape, and keep them: a batch of another shape (validation batches of another size, the short
        last batch of an epoch) would be received into buffers of the old one, silently, or hang. A schedule is
        therefore built anew, and so prepares the stages again, whenever the shape differs from the one the stages
        last ran. Every rank of a pipeline reads the same batch, so they all rebuild together.
        """
        shape = (-(-inputs.shape[0] // self.parallel_config.pp_microbatches), *inputs.shape[1:])
        if self._schedule_shape.get(kind) != shape or self._stage_shape != shape:
            schedule = self._make_schedule[kind]()
            if kind == "train":
                self._schedule = schedule
            else:
                self._forward_schedule = schedule
            self._schedule_shape[kind] = shape
        self._stage_shape = shape
        return self._schedule if kind == "train" else self._forward_schedule

    def _forward(self, inputs: Tensor) -> Tensor | None:
        """The last stage's output of a forward-only pass (on its rank; None elsewhere)."""
        config = self.parallel_config
        if config.pp_schedule == "zbv":
            # torch 2.13's ZB-V runs backward actions when asked to evaluate: forward_through_stages stands in.
            return forward_through_stages(pipeline_stages(self.lightning_module), inputs, self.mesh,
                                          config.pp_schedule, config.pp_virtual_stages)
        return self._ready_schedule("eval", inputs).eval(*self._stage_inputs(inputs), tokens=inputs)

    def _run(self, batch: Any, *, train: bool) -> Tensor:
        inputs, targets = self.lightning_module.split_batch(batch)
        args = self._stage_inputs(inputs)
        target = targets if self._holds_last else None
        losses: list[Tensor] = []
        loss = torch.zeros((), device=inputs.device)
        if train:
            self._bubble.start()
            self._ready_schedule("train", inputs).step(*args, target=target, losses=losses, return_outputs=False,
                                                       tokens=inputs)
            self.bubble_fraction = self._bubble.stop()
            if self._holds_last:  # each micro-batch loss was divided by micro x accumulate: report the batch's mean
                loss = torch.stack(losses).sum().detach() * self._accumulate
        else:
            # Forward only, then the loss on the whole batch's logits (the mean over equal micro-batches).
            with torch.no_grad():
                logits = self._forward(inputs)
                if self._holds_last:
                    loss = self.lightning_module.loss_fn(logits, targets).detach()
        dist.broadcast(loss, src=self._last_stage_global_rank, group=self.mesh.group("pp"))
        return loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelined:
            return super().training_step(*args, **kwargs)
        # The schedule runs backward here, but Lightning zeroes gradients after training_step (at the start
        # of an accumulation window) and then calls backward: keep the schedule's gradients aside and add
        # them in backward, so they meet exactly the gradients a plain backward would meet.
        params = list(self.lightning_module.parameters())
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self._run(args[0], train=True)
        self._pending_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, grad in zip(params, earlier):
            p.grad = grad
        self.lightning_module.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelined:
            return super().validation_step(*args, **kwargs)
        loss = self._run(args[0], train=False)
        self.lightning_module.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelined:
            return super().test_step(*args, **kwargs)
        loss = self._run(args[0], train=False)
        self.lightning_module.log("test_loss", loss, sync_dist=True)
        return loss

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelined:
            return super().predict_step(*args, **kwargs)
        # The batch is the model's input; the last stage's logits are handed to every rank.
        with torch.no_grad():
            logits = self._forward(args[0])
        carrier = [logits]
        dist.broadcast_object_list(carrier, src=self._last_stage_global_rank, group=self.mesh.group("pp"))
        return carrier[0]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if not self.pipelined:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule ran backward already: hand its gradients back.
        for p, grad in self._pending_grads:
            p.grad = grad if p.grad is None else p.grad + grad
        self._pending_grads = []
        self.post_backward(closure_loss)  # data-parallel gradient average, on the last micro-batch of a step
        return closure_loss
