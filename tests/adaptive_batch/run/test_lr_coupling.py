"""The LR coupled to the batch, for one optimizer or torchtune's optimizer per parameter."""

import pytest
import torch

from adaptive_batch.errors import ConfigError
from adaptive_batch.run.lr_coupling import LRCoupling, ParamGroupsOf
from adaptive_batch.run.progress import BatchProgress
from adaptive_batch.schedule.lr_scaling import LRRule, LRScalingOptions


def _per_parameter_optimizers(lr=1.0):
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    return [torch.optim.SGD([p], lr=lr) for p in params]


def _coupling(optimizer, scheduler, options=LRScalingOptions(), batch_size=4):
    return LRCoupling(
        LRRule.of(options, batch_size), optimizer=optimizer, lr_scheduler=scheduler, read_lr=lambda: 0.0,
        batch=BatchProgress(batch_size=batch_size, max_micro_batch_size=batch_size, grow_with_accumulation=False, samples_per_epoch=64),
        count_in_samples=False,
    )


def test_a_schedule_of_the_first_parameters_optimizer_sets_every_parameters_lr():
    # optimizer_in_bwd: torchtune's scheduler drives the first parameter's optimizer only;
    # the others kept the initial LR for the whole run.
    optimizers = _per_parameter_optimizers()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizers[0], lambda step: 0.5 ** (step + 1))
    coupling = _coupling(ParamGroupsOf(optimizers), scheduler)
    assert [o.param_groups[0]["lr"] for o in optimizers] == [0.5, 0.5, 0.5]
    for expected in (0.25, 0.125):
        coupling.before_optimizer_step(LRRule.of(LRScalingOptions(), 4).factors(samples=4, tokens=40))
        coupling.after_optimizer_step()
        assert [o.param_groups[0]["lr"] for o in optimizers] == [expected] * 3


def test_scaling_sets_every_parameters_lr_from_the_schedule():
    optimizers = _per_parameter_optimizers()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizers[0], lambda step: 0.5)
    coupling = _coupling(ParamGroupsOf(optimizers), scheduler, LRScalingOptions(lr_scaling="linear"))
    coupling.before_optimizer_step(LRRule.of(LRScalingOptions(lr_scaling="linear"), 4).factors(samples=8, tokens=80))  # twice the configured batch of 4
    assert [o.param_groups[0]["lr"] for o in optimizers] == [1.0, 1.0, 1.0]
    coupling.after_optimizer_step()
    # Between steps the optimizers hold the LR in force (the schedule's 0.5, x 2); the
    # schedule itself stays unscaled.
    assert [o.param_groups[0]["lr"] for o in optimizers] == [1.0, 1.0, 1.0]
    assert scheduler.get_last_lr() == [0.5]


def test_scaling_without_an_optimizer_is_one_line_not_an_attribute_error():
    with pytest.raises(ConfigError, match="lr_scaling='linear' needs the optimizer whose LR it scales"):
        _coupling(None, None, LRScalingOptions(lr_scaling="linear"))
    assert _coupling(None, None).scaler is None  # nothing to scale: no optimizer needed
