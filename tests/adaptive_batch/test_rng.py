"""One RNG capture: every generator, through a weights_only checkpoint, old states refused."""

import random

import numpy as np
import pytest
import torch

from adaptive_batch import ConfigError
from adaptive_batch.rng import rng_state, set_rng_state
from adaptive_batch.run.step_checkpoints import StepCheckpoints


def _draws():
    return torch.rand(4), random.random(), np.random.rand(3), np.random.randn()


def test_every_generator_round_trips_through_a_step_checkpoint(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    np.random.randn()  # a cached Gaussian is part of NumPy's state
    saved = rng_state()
    expected = _draws()
    ckpts = StepCheckpoints(str(tmp_path))
    ckpts.save(1, {"rng": [saved]})
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    set_rng_state(StepCheckpoints.load(ckpts.latest()[1])["rng"][0])  # weights_only=True
    again = _draws()
    assert torch.equal(again[0], expected[0]) and again[1] == expected[1]
    assert np.array_equal(again[2], expected[2]) and again[3] == expected[3]


def test_a_state_without_numpy_is_refused_in_one_line():
    old = rng_state()
    del old["numpy"]
    with pytest.raises(ConfigError, match="no numpy generator: it was written by an older adaptive-batch"):
        set_rng_state(old)


def test_an_epochs_generator_draws_the_same_order_in_any_run_and_another_each_epoch():
    from adaptive_batch.rng import epoch_generator

    torch.manual_seed(123)  # the global RNG plays no part
    order = torch.randperm(16, generator=epoch_generator(7, 2))
    assert torch.equal(order, torch.randperm(16, generator=epoch_generator(7, 2)))
    assert not torch.equal(order, torch.randperm(16, generator=epoch_generator(7, 3)))
    epoch_generator(2**64 - 1, 5)  # a seed near torch's largest still seeds
