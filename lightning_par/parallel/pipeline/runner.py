"""PipelineRunner: this rank's pipeline stages driven by a ``torch.distributed.pipelining`` schedule, one batch at a
time. Pure PyTorch (no lightning): the strategies call it from their step methods, and it can be driven alone.

A training step runs forward, loss and backward of every micro-batch inside the schedule (GPipe, Huang et al.
2019; 1F1B, Narayanan et al. 2021; ZB-V, Qi et al. 2024). The loss of a micro-batch is divided by the number of
micro-batches and accumulated batches, so the summed gradients are those of the mean loss. The gradients the
schedule produced are kept aside (:meth:`take_gradients` hands them back), because a trainer may zero gradients
between its step and its backward. Evaluation runs the stages forward only; the loss, computed on the last stage,
is broadcast over the pipeline group so every rank reports the same value. The runner also measures the bubble
(``parallel/pipeline/bubble.py``) and counts the bytes the stages send (``parallel/comm.py``). Under the schedules that
split backward into input- and weight-gradient halves (ZB-V, DualPipeV) the linear layers' weight gradients are
set aside for the weight half (``parallel/pipeline/weight_grad.py``) rather than left to PyTorch's generic split.

A layer that adds a loss of its own (a mixture-of-experts router's load-balancing loss) cannot hand it to the loss
function, which sees only the last stage's output. Such a layer takes part in a protocol: it has the attributes
``loss_scale_in_backward`` and ``losses_in_backward``; the runner sets the first to the factor it applies to a
micro-batch's loss, the layer then adds the gradient of its loss times that factor in backward itself
(Megatron-Core's way) and appends the loss's value to the second, and the runner adds the mean of those values,
summed over the pipeline's stages, to the loss it reports.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.pipeline.bubble import BubbleMeter
from lightning_par.parallel.comm import PipelineSends
from lightning_par.parallel.ddp import global_tokens
from lightning_par.parallel.pipeline.split import (build_schedule, check_microbatches, forward_through_stages,
                                                  last_stage_rank)
from lightning_par.parallel.pipeline.weight_grad import DeferredWeightGradients
from lightning_par.parallel.tensor import vocab_parallel_loss

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """Runs ``stages`` (this rank's, from ``parallelize``) with ``config``'s schedule and micro-batches.

    ``loss_fn(logits, targets)`` is the model's mean loss; ``accumulate`` the batches accumulated per optimizer
    step (a hand-written loop may change both between steps). ``loss_tokens(targets)``, when the model says how many
    positions of ``targets`` take a loss (its loss being their mean), weighs each micro-batch's mean by its share of
    the batch's tokens over every data-parallel rank (``parallel.ddp.token_share``), so that the loss is the mean over
    the whole batch's tokens, as one process's.
    """

    #: Under ZB-V and DualPipeV, compute the linear layers' weight gradients in the W actions from what their
    #: backward kept (``DeferredWeightGradients``); False leaves the split to PyTorch (benchmarks compare the two).
    defer_weight_gradients = True

    def __init__(self, stages: list, mesh: ParallelMesh, config: ParallelConfig,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], *, accumulate: int = 1,
                 device: torch.device | None = None,
                 loss_tokens: Callable[[Tensor], Tensor] | None = None) -> None:
        check_microbatches(config)
        self.stages, self.mesh, self.config, self.loss_fn, self.accumulate = stages, mesh, config, loss_fn, accumulate
        self.loss_tokens = loss_tokens
        self._batch_tokens: Tensor | None = None  # loss-taking tokens of the batch in the step, over the dp ranks
        micro = config.microbatches

        def scaled_loss(logits: Tensor, targets: Tensor) -> Tensor:
            # Summed over micro-batches and accumulated batches, the gradients are those of the mean loss: each
            # micro-batch's mean weighs 1 / micro, or its share of the batch's loss-taking tokens.
            if self.loss_tokens is None or self._batch_tokens is None:
                return self.loss_fn(logits, targets) / (micro * self.accumulate)
            return self.loss_fn(logits, targets) * (self.loss_tokens(targets) / self._batch_tokens) / self.accumulate

        self._make_schedule = {"train": lambda: build_schedule(stages, config.pp_schedule, micro, scaled_loss),
                               "eval": lambda: build_schedule(stages, config.pp_schedule, micro, None)}
        self._schedules: dict[str, Any] = {}
        # The micro-batch shape each schedule was first stepped with, and the one the stages last ran.
        self._schedule_shape: dict[str, tuple[int, ...]] = {}
        self._stages_prepared_for: tuple[str, tuple[int, ...]] | None = None  # (schedule kind, micro-batch shape)
        self._pending: list[tuple[Tensor, Tensor]] = []
        self.bubble = BubbleMeter(stages, device or torch.device(mesh.device_type))
        self.bubble_fraction: float | None = None  # idle share of this rank's last training step
        self.sends = PipelineSends(stages)
        self.deferred = (DeferredWeightGradients(stages) if self.defer_weight_gradients
                         and config.splits_backward else None)
        # Fixed for the run: whether this rank feeds the inputs or computes the loss, and which rank does.
        self.holds_first = any(stage.is_first for stage in stages)
        self.holds_last = any(stage.is_last for stage in stages)
        self._own_losses = _layers_with_own_loss(stages, mesh, device or torch.device(mesh.device_type))
        last = last_stage_rank(config.pp, config.pp_schedule, config.pp_virtual_stages)
        self.last_stage_global_rank = dist.get_global_rank(mesh.group("pp"), last)

    # ------------------------------------------------------------------------------------------ steps
    def train_step(self, inputs: Tensor, targets: Tensor, parameters: list[Tensor]) -> Tensor:
        """Forward, loss and backward of every micro-batch of the batch; returns the batch's mean loss (every
        rank). The gradients it produced for ``parameters`` are set aside for :meth:`take_gradients`; the ones
        they held before are left in place."""
        earlier = [p.grad for p in parameters]
        for p in parameters:
            p.grad = None
        for layer in self._own_losses or ():
            layer.loss_scale_in_backward = 1 / (self.config.microbatches * self.accumulate)
        if self.loss_tokens is not None:  # each micro-batch's share of the whole batch's tokens
            self._batch_tokens = (global_tokens(self.loss_tokens(targets), self.mesh) / self.mesh.size("dp")).float()
        losses: list[Tensor] = []
        loss = torch.zeros((), device=inputs.device)
        schedule = self._ready("train", inputs)
        if self.deferred is not None:
            self.deferred.stepping = True
        self.bubble.start()
        try:
            with self._loss_context(), self._autocast_for_schedule():
                schedule.step(*self._stage_inputs(inputs), target=targets if self.holds_last else None,
                              losses=losses, return_outputs=False, tokens=inputs)
        finally:
            if self.deferred is not None:
                self.deferred.stepping = False
                self.deferred.flush()
        self.bubble_fraction = self.bubble.stop()
        if self.holds_last:  # each micro-batch loss was divided by micro x accumulate: report the batch's mean
            loss = torch.stack(losses).sum().detach() * self.accumulate
        self._pending = [(p, p.grad) for p in parameters if p.grad is not None]
        for p, grad in zip(parameters, earlier):
            p.grad = grad
        return self._broadcast(loss) + self._layers_own_loss(loss)

    def take_gradients(self) -> None:
        """Add the gradients of the last :meth:`train_step` to the parameters' (as a backward would)."""
        for p, grad in self._pending:
            p.grad = grad if p.grad is None else p.grad + grad
        self._pending = []

    def evaluate(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Forward only, then the loss on the whole batch's logits (every rank)."""
        loss = torch.zeros((), device=inputs.device)
        with torch.no_grad():
            logits = self.forward(inputs)
            if self.holds_last:
                with self._loss_context():
                    loss = self.loss_fn(logits, targets).detach()
        return self._broadcast(loss) + self._layers_own_loss(loss)

    def predict(self, inputs: Tensor) -> Tensor:
        """The last stage's logits, handed to every rank."""
        with torch.no_grad():
            logits = self.forward(inputs)
        carrier = [logits.full_tensor() if isinstance(logits, DTensor) else logits]  # vocabulary-split logits
        dist.broadcast_object_list(carrier, src=self.last_stage_global_rank, group=self.mesh.group("pp"))
        return carrier[0]

    def forward(self, inputs: Tensor) -> Tensor | None:
        """The last stage's output of a forward-only pass (on its rank; None elsewhere).

        A batch that does not split into the micro-batches (an epoch's short last batch) is padded with copies of
        its last sample to the next multiple and the output cut back: samples do not interact in a forward, so the
        output of the batch's own samples is what it would have been."""
        config = self.config
        samples, short = inputs.shape[0], -inputs.shape[0] % config.microbatches
        if short:
            inputs = torch.cat([inputs, inputs[-1:].expand(short, *inputs.shape[1:])])
        if config.splits_backward:
            # torch 2.13's ZB-V and DualPipeV, whose backward is split, run backward actions when asked to evaluate:
            # forward_through_stages stands in.
            output = forward_through_stages(self.stages, inputs, self.mesh, config.pp_schedule,
                                            config.pp_virtual_stages)
        else:
            output = self._ready("eval", inputs).eval(*self._stage_inputs(inputs), tokens=inputs)
        return output[:samples] if output is not None else None

    # ------------------------------------------------------------------------------------------ helpers
    def _layers_own_loss(self, like: Tensor) -> Tensor | float:
        """The mean over micro-batches of the losses layers added themselves, summed over the pipeline's stages
        (0 for a model without such layers); empties the layers' records. A batch's micro-batches are the last
        forwards: a schedule's first step runs each stage once before, on stand-in inputs, to learn the shapes."""
        if self._own_losses is None:
            return 0.0
        total = torch.zeros((), dtype=like.dtype, device=like.device)
        for layer in self._own_losses:
            if layer.losses_in_backward:
                recorded = layer.losses_in_backward[-self.config.microbatches:]
                total = total + torch.stack(recorded).mean().to(total.dtype)
            layer.losses_in_backward.clear()
        dist.all_reduce(total, group=self.mesh.group("pp"))
        return total

    def _autocast_for_schedule(self) -> Any:
        """Autocast without its weight cache while every block is recomputed.

        Autocast keeps the low-precision copy of each weight it casts until the outermost autocast region ends: here
        the whole schedule, so every micro-batch's graph reaches the weight through the one cast node made in the
        first micro-batch's forward. The autograd engine runs the oldest nodes last (it orders ready nodes by
        creation), so from the second micro-batch on, each weight's low-precision gradient waits at that node until
        the stage's whole backward is done: all of them at once, 2 bytes a parameter at bf16, on top of the cached
        copies themselves (another 2). With every block recomputed nothing saves a cast weight for backward, so
        casting afresh at each use (a copy per weight per use, cheap beside the matmul) holds neither. Without full
        recomputation the cache stays: each micro-batch in flight would keep its own copies."""
        device = self.mesh.device_type
        if not (self.config.pipeline_casts_without_cache and torch.is_autocast_enabled(device)):
            return contextlib.nullcontext()
        return torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)

    def _loss_context(self) -> Any:
        """Under loss parallel the last stage's logits are split over the vocabulary: the loss, forward and backward
        (inside the schedule's step), runs on the shards."""
        return vocab_parallel_loss(self.config.loss_parallel and self.mesh.size("tp") > 1)

    def _broadcast(self, loss: Tensor) -> Tensor:
        dist.broadcast(loss, src=self.last_stage_global_rank, group=self.mesh.group("pp"))
        return loss

    def _stage_inputs(self, inputs: Tensor) -> tuple[Tensor, ...]:
        """What this rank passes to the schedule: the inputs on the first stage's rank, nothing elsewhere.
        Every stage also gets them as ``tokens`` (a keyword, split into micro-batches like the inputs)."""
        config = self.config
        check_microbatches(config, inputs.shape[0])
        return (inputs,) if self.holds_first else ()

    def _ready(self, kind: str, inputs: Tensor) -> Any:
        """The ``"train"`` or ``"eval"`` schedule, prepared for this batch's micro-batch shape.

        PyTorch's pipeline stages size their receive buffers when a schedule first steps, for that step's
        micro-batch shape, and keep them: a batch of another shape (validation batches of another size) would be
        received into buffers of the old one, silently, or hang. The buffers also follow the schedule that prepared
        them: an evaluation's do not require gradients, so a training step received into them would send no
        gradient back to the stages before it. A schedule is therefore built anew, and so prepares the stages again,
        whenever the stages were last prepared by the other kind of schedule or for another shape. Every rank of a
        pipeline reads the same batch, so they all rebuild together.
        """
        shape = (-(-inputs.shape[0] // self.config.microbatches), *inputs.shape[1:])
        if self._schedule_shape.get(kind) != shape or self._stages_prepared_for != (kind, shape):
            self._schedules[kind] = self._make_schedule[kind]()
            self._schedule_shape[kind] = shape
        self._stages_prepared_for = (kind, shape)
        return self._schedules[kind]


def _layers_with_own_loss(stages: list, mesh: ParallelMesh, device: torch.device) -> list | None:
    """This rank's layers that add a loss of their own (the protocol above), or None when no stage of the
    pipeline has one. Stages hold different layers, so whether any has one is agreed over the pipeline group."""
    layers = list({id(m): m for stage in stages for m in stage.submod.modules()
                   if hasattr(m, "loss_scale_in_backward") and hasattr(m, "losses_in_backward")}.values())
    anywhere = torch.tensor([len(layers)], device=device)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=mesh.group("pp"))
    return layers if int(anywhere) else None
