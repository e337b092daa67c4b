"""Parallelized: what :func:`~lightning_par.parallel.compose.parallelize` returns, and what a training loop asks.

The handle answers every question the loop has about the layout, so that no caller re-derives them from the
config: which module to run, the pipeline runner (pp > 1), how to skip gradient communication while gradients
accumulate, what to do after the last backward of a step (average gradients DDP could not, sum the copies of a
tensor that several pipeline stages hold), how to shard the optimizer (ZeRO-1/2, Rajbhandari et al. 2020), which
ranks the gradient norm is summed over, and where the loss must run (on vocabulary-sharded logits). Pure PyTorch:
Lightning's strategies hold one and so can any training loop.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel import ddp, zero
from lightning_par.parallel.clip import clip_grad_norm_, gradient_norm
from lightning_par.parallel.foreach import foreach_over_dtensors
from lightning_par.parallel.pipeline.runner import PipelineRunner
from lightning_par.parallel.record import layout_record
from lightning_par.parallel.tensor import sum_over_tensor_parallel, vocab_parallel_loss
from lightning_par.parallel.pipeline.ties import StageTies

__all__ = ["Parallelized", "parallelized_by_its_author"]


class Parallelized:
    """``module`` (the module to run: wrapped by DDP or not) laid out over ``mesh`` as ``config`` says.

    ``reduces_after_backward``: whether :meth:`after_backward` averages the gradients over the data-parallel
    ranks (the layouts DDP cannot wrap). ``pipeline``: the runner of this rank's stages under pp > 1.
    """

    def __init__(self, module: nn.Module, mesh: ParallelMesh, config: ParallelConfig, *,
                 reduces_after_backward: bool, pipeline: PipelineRunner | None = None) -> None:
        if config.pp > 1 and pipeline is None:
            raise ValueError(f"pp={config.pp!r}: pipeline parallel runs the stages parallelize() cuts from the "
                             "model, and this module parallelized itself; let the strategy lay it out (drop "
                             f"parallelize() and the splitting in configure_model()), or use pp=1")
        self.module, self.mesh, self.config = module, mesh, config
        self.reduces_after_backward = reduces_after_backward
        self.pipeline = pipeline
        self._sync_blocked = False  # inside no_sync()
        # ZeRO-1 (and ZeRO-2 under a pipeline) where gradients are averaged after backward: the rank of the
        # partition group whose optimizer steps each parameter (from shard_optimizer()); gradients go to it only.
        self._owners: dict[Tensor, int] | None = None
        self._unowned: list[Tensor] = []  # and the expert parameters another rank steps (partition_of)
        # ZeRO-2 under a pipeline: the owners' sums of the batches accumulated so far, set aside between batches.
        self._reduced: dict[Tensor, Tensor] = {}

    @classmethod
    def as_given(cls, module: nn.Module, mesh: ParallelMesh, config: ParallelConfig) -> Parallelized:
        """A module its author split and sharded (DTensors, FSDP2), trained as it is. Gradients it leaves unreduced
        (DTensors without FSDP over the data-parallel ranks) are averaged after backward; its replicas are made
        equal first."""
        average = mesh.size("dp") > 1 and not any(isinstance(m, FSDPModule) for m in module.modules())
        if average:
            ddp.broadcast_replicas(module, mesh)
        return cls(module, mesh, config, reduces_after_backward=average)

    @property
    def inner(self) -> nn.Module:
        """The module without its data-parallel wrapper."""
        return ddp.unwrap(self.module)

    @property
    def stages(self) -> list:
        """This rank's pipeline stages (empty without pipeline parallel)."""
        record = layout_record(self.inner)
        return record.stages if record is not None else []

    @property
    def ties(self) -> StageTies | None:
        """The parameters several pipeline ranks hold (a head tied to the embedding), or None."""
        record = layout_record(self.inner)
        return record.ties if record is not None else None

    # ------------------------------------------------------------------------------------- gradients
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """The backward passes inside (all but the last of accumulated batches) skip gradient communication, or, with
        ``sharded_accumulation`` (ZeRO-2/3), reduce as usual so that each rank keeps only its part."""
        inner = self.inner
        skip: AbstractContextManager = (
            zero.no_reduction(inner, sharded=self.config.sharded_accumulation) if zero.is_zero_module(inner)
            else ddp.no_allreduce(self.module))
        self._sync_blocked = True
        try:
            with skip:
                yield
        finally:
            self._sync_blocked = False

    def after_backward(self) -> None:
        """After the last backward of an optimizer step: average what DDP did not (Megatron-LM reduces pipeline
        gradients once per step, Narayanan et al. 2021), and give every copy of a tied tensor the sum. ZeRO-2 under a
        pipeline does so after every batch: each gradient goes to its owner, which keeps the batches' sum aside until
        the last, so that between batches no rank holds more than its part (the schedule holds a stage's whole
        gradients only while it runs, as it does FSDP2's)."""
        every_batch = self._owners is not None and self.config.zero.gradient_reduction == "to owners"
        if self._sync_blocked and not every_batch:
            return
        if self.ties is not None:  # (summing the copies first or averaging over data-parallel ranks first is alike)
            self.ties.sum_gradients()
        if self._owners is not None:
            zero.reduce_gradients_to_owners(self.inner, self.mesh, self._owners,
                                            bucket_cap_mb=self.config.ddp_bucket_cap_mb)
            for param in self._unowned:  # experts: reduced by expert parallel, kept by the ranks that step them
                param.grad = None
            if every_batch:
                self._keep_reduced(last=not self._sync_blocked)
        elif self.reduces_after_backward:
            ddp.reduce_gradients(self.inner, self.mesh, bucket_cap_mb=self.config.ddp_bucket_cap_mb)
        if self.config.sequence_parallel and self.mesh.size("tp") > 1:  # layers that routed this rank's tokens
            sum_over_tensor_parallel(self.inner, self.mesh, bucket_cap_mb=self.config.ddp_bucket_cap_mb)

    def _keep_reduced(self, *, last: bool) -> None:
        """The owner's side of ZeRO-2 under a pipeline: set this batch's reduced gradients aside (the next batch
        starts from none), or, on the last batch, add the ones set aside back."""
        for p in self.inner.parameters():
            if p.grad is not None:
                zero.keep_reduced_sum(p, self._reduced, last=last)

    def shard_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer to step: sharded over the data-parallel ranks under ZeRO stages 1 and 2. (Under stage 3 it
        already is: it was built on FSDP2's sharded parameters.) DTensor parameters on a CPU are stepped with the
        optimizer's foreach implementation where its ``foreach`` was left to torch (:mod:`~.foreach`)."""
        if type(optimizer).__module__.startswith("torchao.optim") and self.config.tp > 1:
            raise ValueError(
                f"{type(optimizer).__name__} quantises each rank's shard of a state in blocks of values, and a "
                f"tensor-parallel shard (tp={self.config.tp}) groups other values than the whole matrix does: the run "
                "would not train what one process trains. Use optimizer adamw_bf16 (bf16 moments) under tensor "
                "parallel, or the quantised states with ZeRO-1/2/3 and tp=1 (docs/optimizers.md)")
        foreach_over_dtensors(optimizer)
        sharded = zero.shard_optimizer(optimizer, self.inner, self.mesh, stage=self.config.zero,
                                       sharded_accumulation=self.config.sharded_accumulation,
                                       reduce_in_backward=not self.reduces_after_backward)
        if sharded is not optimizer and self.reduces_after_backward:  # ZeRO-1/2 (stage 3's FSDP2 keeps its own)
            self._owners, self._unowned = zero.partition_of(sharded)
        return sharded

    @property
    def norm_groups(self) -> dict[str, ProcessGroup | None]:
        """The groups the gradient norm sums squared norms over (:func:`~lightning_par.parallel.clip.gradient_norm`).

        ``partition_group``: under ZeRO-2, and ZeRO-1 that reduces to owners, the ranks whose gradients make up one
        whole gradient.
        ``stage_group``: under pipeline parallel, the ranks holding the other stages (every kind of gradient).
        DTensor gradients (tensor parallel, ZeRO-3, experts) know their own placements.
        """
        owned = self.config.zero.gradient_reduction == "to owners" or self._owners is not None
        partitioned = owned and self.mesh.size(zero.PARTITION_GROUP) > 1
        return {"partition_group": self.mesh.group(zero.PARTITION_GROUP) if partitioned else None,
                "stage_group": self.mesh.group("pp") if self.mesh.size("pp") > 1 else None}

    def counted_once(self, parameters: list[Tensor]) -> list[Tensor]:
        """``parameters`` without the copies of a tensor that another pipeline rank counts in the norm."""
        ties = self.ties
        return ties.counted(parameters) if ties is not None else parameters

    def gradient_norm(self, parameters: list[Tensor]) -> float:
        """The 2-norm of the whole gradient of ``parameters`` (every shard, stage and partition). Collective."""
        return gradient_norm(self.counted_once(parameters), **self.norm_groups)

    def clip_grad_norm_(self, parameters: list[Tensor], max_norm: float) -> float:
        """Scale the gradients so that the norm of the whole gradient is at most ``max_norm``; returns the norm
        before. Collective."""
        return clip_grad_norm_(parameters, max_norm, counted=self.counted_once(parameters), **self.norm_groups)

    def loss_context(self) -> AbstractContextManager:
        """Where the loss and its backward run: with loss parallel, on vocabulary-sharded logits."""
        return vocab_parallel_loss(self.config.loss_parallel and self.mesh.size("tp") > 1)

    def token_share(self, count: Tensor) -> Tensor:
        """The factor that makes a batch's mean loss over its ``count`` loss-taking tokens this rank's part of the
        global batch's token mean (``parallel.ddp.token_share``). Collective over the data-parallel ranks."""
        return ddp.token_share(count, self.mesh)


def parallelized_by_its_author(module: nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters or FSDP2 modules that :func:`parallelize` did not put there
    (Lightning's ``ModelParallelStrategy`` idiom: ``configure_model()`` split and sharded it)."""
    if layout_record(module) is not None:
        return False
    return any(isinstance(p, DTensor) for p in module.parameters()) or any(
        isinstance(m, FSDPModule) for m in module.modules())
