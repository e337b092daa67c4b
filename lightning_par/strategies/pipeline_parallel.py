"""PipelineParallelStrategy (``pipeline_parallel``): stages of blocks on successive ranks, micro-batched."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.config import ParallelConfig
from lightning_par.parallel.compose import pipeline_stages
from lightning_par.parallel.pipeline import build_schedule, check_microbatches, last_stage_rank
from lightning_par.strategies.base import MeshStrategy


class PipelineParallelStrategy(MeshStrategy):
    """Pipeline parallelism on ``torch.distributed.pipelining``: each rank holds consecutive blocks.

    The first stage owns the embedding, the last the final norm, the head and the loss. Each batch is
    split into ``microbatches`` that flow through the stages in the order of ``schedule`` (see
    ``lightning_par.parallel.pipeline``).

    Model contract (the schedule runs forward and loss itself, so ``training_step`` and
    ``validation_step`` are not called): the LightningModule provides ``split_batch(batch) -> (inputs,
    targets)``, ``forward(inputs) -> logits`` through a network submodule that holds the blocks, embedding
    and head, and ``loss_fn(logits, targets) -> mean loss``. The strategy logs ``train_loss`` /
    ``val_loss`` / ``test_loss`` (the same value on every rank).

    Args:
        pipeline_parallel_size: number of ranks the stages are spread over.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` (``virtual_stages`` stages per rank) or ``zbv``
            (two stages per rank in a V, zero-bubble).
        microbatches: micro-batches per batch (the batch size must divide by it; 1F1B-type schedules need
            at least ``pipeline_parallel_size``).
        virtual_stages: stages per rank for ``interleaved_1f1b``.
        balance: how blocks are assigned to stages without split points in the plan: ``parameters``
            (equal parameter counts, embedding and head included) or ``profile`` (measured forward +
            backward time per block, embedding and head/loss).
        plan: where the model keeps its blocks; ``split_points`` names the blocks that start stages.
        save_distributed_checkpoint: must be true (each rank saves its stages; ``lightning-par-export``
            consolidates).
    """

    strategy_name = "pipeline_parallel"
    strategy_description = "pipeline parallel (GPipe, 1F1B, interleaved, ZB-V)"

    def __init__(
        self,
        pipeline_parallel_size: int = 2,
        schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"] = "1f1b",
        microbatches: int = 4,
        virtual_stages: int = 2,
        balance: Literal["parameters", "profile"] = "parameters",
        activation_checkpointing: Literal["none", "full", "selective"] = "none",
        activation_checkpointing_every: int = 1,
        plan: dict[str, Any] | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        if save_distributed_checkpoint is not True:
            raise ValueError("pipeline_parallel saves sharded checkpoints (each rank its own stages); "
                             "save_distributed_checkpoint=False is not supported - export a single file with "
                             "lightning-par-export instead")
        config = ParallelConfig(pp=pipeline_parallel_size, dp_shard=1, pp_schedule=schedule,
                                pp_microbatches=microbatches, pp_virtual_stages=virtual_stages, pp_balance=balance,
                                activation_checkpointing=activation_checkpointing,
                                activation_checkpointing_every=activation_checkpointing_every)
        super().__init__(config, plan=plan, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self._schedule: Any = None
        self._forward_schedule: Any = None  # predict: no targets, no loss
        self._accumulate = 1
        self._pending_grads: list[tuple[Tensor, Tensor]] = []
        self._holds_first = self._holds_last = False
        self._last_stage_global_rank = 0

    @override
    def setup(self, trainer: Trainer) -> None:
        self._accumulate = trainer.accumulate_grad_batches
        config = self.parallel_config
        for name in ("split_batch", "loss_fn"):
            if not callable(getattr(self.lightning_module, name, None)):
                raise TypeError(f"pipeline_parallel needs the LightningModule to define {name}(); the schedule runs "
                                "split_batch -> forward -> loss_fn itself (see docs/pipeline_parallel.md)")
        check_microbatches(config.pp_microbatches, config.pp_schedule, config.pp)
        super().setup(trainer)
        module = self.lightning_module
        micro, accumulate = config.pp_microbatches, self._accumulate

        def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
            # Summed over micro-batches and accumulated batches, the gradients are those of the mean loss.
            return module.loss_fn(logits, targets) / (micro * accumulate)

        stages = pipeline_stages(module)
        self._schedule = build_schedule(stages, config.pp_schedule, micro, loss_fn)
        self._forward_schedule = build_schedule(stages, config.pp_schedule, micro, None)
        # Fixed for the run: whether this rank feeds the inputs or computes the loss, and which rank does.
        self._holds_first = any(stage.is_first for stage in stages)
        self._holds_last = any(stage.is_last for stage in stages)
        last = last_stage_rank(config.pp, config.pp_schedule, config.pp_virtual_stages)
        self._last_stage_global_rank = dist.get_global_rank(self.mesh.group("pp"), last)

    @override
    def _profile_batch(self) -> tuple[Tensor, Tensor] | None:
        # Balancing by profile times one micro-batch of the first training batch.
        datamodule = self.lightning_module.trainer.datamodule
        if self.parallel_config.pp_balance != "profile" or datamodule is None:
            return None
        inputs, targets = self.lightning_module.split_batch(next(iter(datamodule.train_dataloader())))
        size = max(1, inputs.shape[0] // self.parallel_config.pp_microbatches)
        return inputs[:size], targets[:size]

    def _stage_inputs(self, inputs: Tensor) -> tuple[Tensor, ...]:
        """What this rank passes to the schedule: the inputs on the first stage's rank, nothing elsewhere."""
        config = self.parallel_config
        check_microbatches(config.pp_microbatches, config.pp_schedule, config.pp, inputs.shape[0])
        return (inputs,) if self._holds_first else ()

    def _run(self, batch: Any, *, train: bool) -> Tensor:
        inputs, targets = self.lightning_module.split_batch(batch)
        args = self._stage_inputs(inputs)
        target = targets if self._holds_last else None
        losses: list[Tensor] = []
        if train:
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            with torch.no_grad():
                self._schedule.eval(*args, target=target, losses=losses)
        # Each micro-batch loss was divided by micro x accumulate: undo it to report the batch's mean.
        loss = (torch.stack(losses).sum().detach() * self._accumulate if self._holds_last
                else torch.zeros((), device=inputs.device))
        dist.broadcast(loss, src=self._last_stage_global_rank, group=self.mesh.group("pp"))
        return loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
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
        loss = self._run(args[0], train=False)
        self.lightning_module.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        loss = self._run(args[0], train=False)
        self.lightning_module.log("test_loss", loss, sync_dist=True)
        return loss

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        # The batch is the model's input; the last stage's logits are handed to every rank.
        with torch.no_grad():
            logits = self._forward_schedule.eval(*self._stage_inputs(args[0]))
        carrier = [logits]
        dist.broadcast_object_list(carrier, src=self._last_stage_global_rank, group=self.mesh.group("pp"))
        return carrier[0]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # The schedule ran backward already: hand its gradients back.
        for p, grad in self._pending_grads:
            p.grad = grad if p.grad is None else p.grad + grad
        self._pending_grads = []
        return closure_loss
