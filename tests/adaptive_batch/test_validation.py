import math

import pytest

from adaptive_batch.errors import ConfigError
from adaptive_batch.validation import (
    check_bool,
    check_choice,
    check_fraction,
    check_known_keys,
    check_positive_int,
    check_positive_number,
)


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="unknown config key 'batch_sise'.*did you mean 'batch_size'"):
        check_known_keys(["batch_size", "batch_sise"], ["batch_size", "epochs"])
    with pytest.raises(ConfigError, match="known keys: batch_size, epochs"):
        check_known_keys(["zzz"], ["batch_size", "epochs"])
    check_known_keys(["epochs"], ["batch_size", "epochs"])


@pytest.mark.parametrize("value", ["yes", 1, 0, None])
def test_bool_takes_only_booleans(value):
    with pytest.raises(ConfigError, match=r"k=.* must be true or false: set k=True or k=False"):
        check_bool("k", value)


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
def test_positive_int_rejects(value):
    with pytest.raises(ConfigError, match="must be a positive integer: e.g. k=8"):
        check_positive_int("k", value)


def test_positive_int_accepts():
    assert check_positive_int("k", 3) == 3
    assert check_positive_int("k", None, allow_none=True) is None
    with pytest.raises(ConfigError, match="positive integer or null"):
        check_positive_int("k", 0, allow_none=True)


@pytest.mark.parametrize("value", [1.0, -0.1, True, "2%", math.nan])
def test_fraction_rejects(value):
    with pytest.raises(ConfigError, match=r"must be a number in \[0, 1\): e.g. k=0.1"):
        check_fraction("k", value, "0.1")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, -1, "3", False])
def test_positive_number_rejects_nan_and_infinity(value):
    with pytest.raises(ConfigError, match="must be a positive finite number: fix it"):
        check_positive_number("k", value, "fix it")


def test_choice():
    assert check_choice("k", "a", ("a", "b"), "use a.") == "a"
    with pytest.raises(ConfigError, match=r"k='c' is not one of \['a', 'b'\]: use a."):
        check_choice("k", "c", ("a", "b"), "use a.")


def test_the_safety_margin_is_checked_by_one_function_at_every_entry():
    import torch

    from adaptive_batch import find_max_batch_size, plan_memory, ProbeOptions
    from adaptive_batch.memory.device import DeviceCapacity
    from adaptive_batch.memory.budget import memory_budget
    from adaptive_batch.validation import check_safety_margin

    assert check_safety_margin(0.05) == 0.05
    model = torch.nn.Linear(2, 2)
    capacity = DeviceCapacity(device="cpu", headroom_bytes=2**30, source="test", hard_limit=True)
    entries = {
        "memory_safety_margin": lambda: ProbeOptions(memory_safety_margin=1.0),
        "safety_margin": lambda: find_max_batch_size(lambda b: None, make_batch=lambda b: b, model=model,
                                                     safety_margin=1.0),
        "memory_safety_margin ": lambda: memory_budget(max_memory_bytes=None, capacity=capacity, live_bytes=0,
                                                      safety_margin=1.0),
        "safety_margin ": lambda: plan_memory(build_model=lambda: model, build_optimizer=lambda p: None,
                                              forward_backward=lambda m, b: None, seq_len=8, device_memory_bytes=2**30,
                                              safety_margin=1.0),
    }
    for key, call in entries.items():
        with pytest.raises(ConfigError, match=rf"^{key.strip()}=1.0 must be a number in \[0, 1\): e.g. "
                                              rf"{key.strip()}=0.05 keeps 5% of the budget back\.$"):
            call()


def test_a_positive_number_may_be_numpys():
    import numpy as np

    from adaptive_batch.validation import check_positive_number

    assert check_positive_number("clip_grad_norm", np.float32(1.5), "e.g. 1.0") == 1.5
    with pytest.raises(ConfigError, match="clip_grad_norm=True must be a positive finite number"):
        check_positive_number("clip_grad_norm", True, "e.g. 1.0")
