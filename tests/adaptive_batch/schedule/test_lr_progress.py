import math

import pytest
import torch
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

from adaptive_batch import ConfigError
from adaptive_batch.schedule.lr_progress import SampleProgressLR


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_constant_batch_matches_the_step_counted_schedule():
    opt_steps, opt_samples = optimizer(), optimizer()
    by_steps = get_cosine_schedule_with_warmup(opt_steps, num_warmup_steps=3, num_training_steps=20)
    by_samples = SampleProgressLR(
        get_cosine_schedule_with_warmup(opt_samples, num_warmup_steps=3, num_training_steps=20), samples_per_step=4
    )
    for step in range(20):
        lr = by_samples.set_progress(step * 4)[0]
        assert lr == pytest.approx(opt_steps.param_groups[0]["lr"])
        assert opt_samples.param_groups[0]["lr"] == lr and by_samples.get_last_lr() == [lr]
        opt_steps.step()
        by_steps.step()


def cosine_with_warmup(step: float, warmup: int, total: int) -> float:
    """torchtune's cosine schedule, written out from its definition (0.5 cycles)."""
    if step < warmup:
        return step / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def test_growing_batch_ends_the_schedule_with_the_last_sample():
    opt = optimizer()
    progress = SampleProgressLR(get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=20), samples_per_step=4)
    # 7 steps of a growing batch over the 80 samples the 20-step schedule was written for
    seen = 0
    for batch in [4, 4, 8, 8, 16, 16, 24]:
        lr = progress.set_progress(seen)[0]
        assert lr == pytest.approx(0.1 * cosine_with_warmup(seen / 4, warmup=2, total=20))
        assert opt.param_groups[0]["lr"] == lr
        seen += batch
    assert progress.set_progress(80)[0] == pytest.approx(0.0, abs=1e-12)  # decayed to zero with the last sample
    assert progress.set_progress(4)[0] == pytest.approx(0.05)  # half-way through warmup after 4 of 8 warmup samples


def test_needs_a_lambda_scheduler_and_a_positive_unit():
    with pytest.raises(ConfigError, match="lr_scheduler: StepLR is not a LambdaLR"):
        SampleProgressLR(torch.optim.lr_scheduler.StepLR(optimizer(), step_size=2), 4)
    with pytest.raises(ValueError, match="samples_per_step=0"):
        SampleProgressLR(get_cosine_schedule_with_warmup(optimizer(), 0, 10), 0)
