import pytest
import torch
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

from adaptive_batch import SampleProgressLR


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


def test_growing_batch_ends_the_schedule_with_the_last_sample():
    opt = optimizer()
    total_samples = 80  # 20 steps at the configured batch of 4
    progress = SampleProgressLR(
        get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=total_samples / 4), samples_per_step=4
    )
    seen, lrs = 0, []
    for batch in [4, 4, 8, 8, 16, 16, 24]:  # 7 steps instead of 20
        lrs.append(progress.set_progress(seen)[0])
        seen += batch
    assert seen == total_samples
    assert lrs[1] == pytest.approx(0.1 * 0.5)  # half-way through warmup after 4 of 8 warmup samples
    assert lrs[0] < lrs[1] < lrs[2] == pytest.approx(0.1)  # warmup ends after 8 samples
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # then decays every step
    assert progress.set_progress(total_samples)[0] == pytest.approx(0.0, abs=1e-12)  # decayed to the end


def test_needs_a_lambda_scheduler_and_a_positive_unit():
    with pytest.raises(TypeError, match="StepLR is not a LambdaLR"):
        SampleProgressLR(torch.optim.lr_scheduler.StepLR(optimizer(), step_size=2), 4)
    with pytest.raises(ValueError, match="samples_per_step=0"):
        SampleProgressLR(get_cosine_schedule_with_warmup(optimizer(), 0, 10), 0)
