"""Every row of layout/dimensions.py, given a bad value: the message names what the user wrote, a strategy's argument
(``tensor_parallel_size=3``) or, for a ParallelConfig built directly, its field (``tp=3``)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from lightning_par.layout.config import ParallelConfig
from lightning_par.layout.dimensions import DIMENSIONS, MESH_DIM_NAMES, dimension

STRATEGIES = ("DataParallelStrategy", "ZeroStrategy", "TensorParallelStrategy", "ContextParallelStrategy",
              "ExpertParallelStrategy", "PipelineParallelStrategy", "Hybrid3DStrategy")
# A bad value of each knob whose argument is spelled otherwise than its field, and the words its message starts with
# after the name.
BAD_KNOBS = {"pp_schedule": ("zigzag", "='zigzag' is not one of"), "pp_balance": ("flops", "='flops' is not one of"),
             "pp_virtual_stages": (1, " must be an integer >= 2"), "cp_method": ("flash", "='flash' is not one of"),
             "ddp_bucket_cap_mb": (0, " must be a positive number of MiB"),
             "ddp_static_graph": ("yes", " must be true or false"),
             "ddp_find_unused_parameters": ("yes", " must be true or false")}


def _strategy(name: str) -> Any:
    import lightning_par

    return getattr(lightning_par, name)


def _takes(name: str, argument: str) -> bool:
    return argument in inspect.signature(_strategy(name).__init__).parameters


def _message(make: Any) -> str:
    with pytest.raises(ValueError) as raised:
        make()
    return str(raised.value)


SIZE_CASES = [(name, row.argument) for name in STRATEGIES for row in DIMENSIONS if _takes(name, row.argument)]
KNOB_CASES = [(name, knob, argument) for name in STRATEGIES for row in DIMENSIONS
              for knob, argument in row.knobs.items() if knob in BAD_KNOBS and _takes(name, argument)]


def test_every_dimension_and_knob_is_some_strategys_argument() -> None:
    assert {argument for _, argument in SIZE_CASES} == {row.argument for row in DIMENSIONS}
    assert {knob for _, knob, _ in KNOB_CASES} == set(BAD_KNOBS)


@pytest.mark.parametrize(("name", "argument"), SIZE_CASES)
def test_a_strategy_names_a_bad_size_by_its_argument(name: str, argument: str) -> None:
    assert f"{argument} must be a positive integer" in _message(lambda: _strategy(name)(**{argument: 0}))


@pytest.mark.parametrize(("name", "argument"), [(name, argument) for name, argument in SIZE_CASES
                                                if argument != dimension("ep").argument])
def test_a_strategy_names_a_size_that_does_not_fit_the_world_by_its_argument(name: str, argument: str) -> None:
    message = _message(lambda: _strategy(name)(**{argument: 3}).parallel_config.validate(2))
    assert f"{argument}=3" in message and "the world size 2" in message


@pytest.mark.parametrize("name", [name for name in STRATEGIES if _takes(name, dimension("ep").argument)])
def test_a_strategy_names_what_expert_parallel_must_divide_by_its_arguments(name: str) -> None:
    row = dimension("ep")
    message = _message(lambda: _strategy(name)(**{row.argument: 4, "data_parallel_size": 2})
                       .parallel_config.validate(2))
    hosts = " x ".join(dimension(host).argument for host in row.divides)
    assert f"{row.argument}=4 does not divide {hosts} = 2 x 1 = 2" in message


@pytest.mark.parametrize(("name", "knob", "argument"), KNOB_CASES)
def test_a_strategy_names_a_bad_knob_by_its_argument(name: str, knob: str, argument: str) -> None:
    value, says = BAD_KNOBS[knob]
    assert _message(lambda: _strategy(name)(**{argument: value})).startswith(argument + says)


@pytest.mark.parametrize("row", DIMENSIONS, ids=[row.field for row in DIMENSIONS])
def test_a_config_built_directly_names_its_fields(row) -> None:
    assert _message(lambda: ParallelConfig(**{row.field: 0}).validate()).startswith(f"{row.field} must be")
    if row.in_mesh:
        others = {"dp_shard": 1} if row.field != "dp_shard" else {}
        message = _message(lambda: ParallelConfig(**{row.field: 3, **others}).validate(2))
        assert message.startswith(f"{row.field}=3 = 3 does not equal the world size 2")
    for knob, (value, says) in BAD_KNOBS.items():
        if knob in row.knobs:
            assert _message(lambda: ParallelConfig(**{knob: value}).validate()).startswith(knob + says)


def test_the_mesh_order_is_the_tables() -> None:
    assert MESH_DIM_NAMES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert [row.field for row in DIMENSIONS if not row.in_mesh] == ["ep"]
