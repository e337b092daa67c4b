"""async_tp=True: torch's micro-pipelined tensor parallel where symmetric memory exists (CUDA),
refused with the reason everywhere else and without the techniques it rewrites."""

from __future__ import annotations

import functools

import pytest
import torch
from parity import assert_fails_on_every_rank
from test_data_parallel import MODEL, SGDLlamaLM, make_datamodule


@pytest.mark.parametrize("knobs", [dict(tensor_parallel_size=2, compile=True),
                                   dict(tensor_parallel_size=2, sequence_parallel=True),
                                   dict(data_parallel_size=2, compile=True)])
def test_async_tp_needs_tensor_and_sequence_parallel_and_compile(knobs: dict) -> None:
    from lightning_par import Hybrid3DStrategy

    with pytest.raises(ValueError, match=r"async_tp=True with tensor_parallel_size=\d, sequence_parallel=\w+, "
                                         r"compile=\w+: .* it needs tensor_parallel_size > 1, "
                                         r"sequence_parallel=True and compile=True"):
        Hybrid3DStrategy(async_tp=True, **knobs)


def _strategy():
    from lightning_par import Hybrid3DStrategy

    return Hybrid3DStrategy(tensor_parallel_size=2, sequence_parallel=True, compile=True, async_tp=True)


def test_async_tp_off_cuda_is_refused_on_every_rank_before_training() -> None:
    from lightning_par.parallel.async_tp import enable_async_tensor_parallel

    with pytest.raises(ValueError, match="CUDA symmetric memory .* which a cpu device does not have"):
        enable_async_tensor_parallel(torch.device("cpu"))
    assert_fails_on_every_rank(functools.partial(SGDLlamaLM, **MODEL), make_datamodule, _strategy, world_size=2,
                               message="async_tp=True overlaps collectives through CUDA symmetric memory")
