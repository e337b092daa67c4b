"""Pure PyTorch parallel techniques over (module, mesh). This package never imports lightning."""

from lightning_par.parallel.compose import parallelize
from lightning_par.parallel.parallelized import Parallelized
from lightning_par.parallel.pipeline.runner import PipelineRunner
from lightning_par.parallel.ddp import apply_data_parallel
from lightning_par.parallel.experts import apply_expert_parallel
from lightning_par.parallel.pipeline.split import split_pipeline
from lightning_par.parallel.pipeline.trace import trace_network
from lightning_par.parallel.model_map import ModelMap, derive_model_map, huggingface_model_map
from lightning_par.parallel.model_map_check import check_model_map
from lightning_par.parallel.clip import clip_grad_norm_
from lightning_par.parallel.context import apply_context_parallel
from lightning_par.parallel.tensor import apply_tensor_parallel, vocab_parallel_loss
from lightning_par.parallel.zero import fully_shard_model, shard_optimizer

__all__ = [
    "parallelize",
    "Parallelized",
    "PipelineRunner",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "vocab_parallel_loss",
    "apply_context_parallel",
    "apply_expert_parallel",
    "split_pipeline",
    "fully_shard_model",
    "shard_optimizer",
    "clip_grad_norm_",
    "ModelMap",
    "derive_model_map",
    "huggingface_model_map",
    "check_model_map",
    "trace_network",
]
