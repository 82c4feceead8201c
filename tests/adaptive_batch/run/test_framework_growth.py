"""FrameworkGrowth: the batch of a framework's run across its epochs, decided once an epoch, its LR
factor, and the state a checkpoint keeps."""

import pytest
import torch

from adaptive_batch import ConfigError
from adaptive_batch.run.framework_growth import FrameworkGrowth
from adaptive_batch.schedule.growth import GrowthOptions
from adaptive_batch.schedule.lr_scaling import LRScalingOptions


def double(epoch, current_batch_size):
    return current_batch_size


def _growth(fn=double, accumulate=False, rule="linear", **kwargs):
    return FrameworkGrowth(GrowthOptions(batch_increase_function=fn, grow_with_accumulation=accumulate),
                       LRScalingOptions(lr_scaling=rule), **kwargs)


def test_the_first_batch_is_fixed_the_configured_clamped_to_what_fits_or_the_answer():
    assert _growth().start(6, 4, {}) == 4
    lines = []
    from adaptive_batch.logs import lines_to

    with lines_to(lines.append):
        assert _growth().start(3, 4, {}) == 3
    assert lines == ["adaptive-batch: the configured batch of 4 does not fit; growth starts at 3."]
    assert _growth(accumulate=True).start(3, 4, {}) == 4
    assert _growth(fn=None).start(6, 4, {}) == 6
    assert _growth().start(6, 4, {}, first=16) == 16


def test_growth_is_decided_once_an_epoch_up_to_the_answer_unless_it_accumulates():
    growth = _growth()
    growth.start(6, 2, {})
    assert growth.grow_at(0).batch_size == 4 and growth.grow_at(0) is None  # once an epoch
    decision = growth.grow_at(1)
    assert (decision.requested, decision.batch_size, decision.clamped) == (8, 6, True)
    assert growth.grow_at(2) is None and growth.state.effective == 6  # 12 asked, 6 kept
    accumulating = _growth(accumulate=True)
    accumulating.start(6, 2, {})
    assert [accumulating.grow_at(e).batch_size for e in range(3)] == [4, 8, 16]


def test_on_several_ranks_the_function_and_the_lr_rule_see_the_batch_over_every_rank():
    """As the recipes call it: 2 ranks of 3 are a batch of 6 to the function, which adds 5 (each
    rank's share rounded down, so ranks stay equal), and to the LR rule against 2 x 3."""
    seen = []

    def add_five(epoch, current_batch_size):
        seen.append(current_batch_size)
        return 5

    growth = _growth(fn=add_five, accumulate=True)
    assert growth.start(8, 3, {}, ranks=2) == 3 and growth.state.reference == 6
    assert growth.grow_at(0).batch_size == 5 and seen == [6]  # 3 + 5 // 2 a rank: 10 in all
    model = torch.nn.Linear(2, 1)
    growth.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), None)
    assert growth.lr_factor() == pytest.approx(10 / 6)
    resumed = _growth(fn=add_five, accumulate=True)
    resumed.resume(growth.state.to_dict(), {}, ranks=2)
    assert resumed.grow_at(1).batch_size == 7 and seen == [6, 10]


def test_a_checkpoint_from_before_ranks_were_kept_resumes_on_one_rank_alone():
    growth = _growth()
    growth.start(6, 2, {"lr_scaling": "linear"})
    saved = growth.state.to_dict()  # settings without world_size, as every fit wrote them before
    assert _growth().resume(saved, {"lr_scaling": "linear", "world_size": 1}) == 2
    with pytest.raises(ConfigError, match=r"world_size=2, but the checkpoint's fit ran with world_size=1"):
        _growth().resume(saved, {"lr_scaling": "linear", "world_size": 2}, ranks=2)


def test_a_resume_takes_the_checkpoints_batch_and_decided_boundaries_or_refuses_other_settings():
    growth = _growth()
    growth.start(6, 2, {"lr_scaling": "linear"})
    growth.grow_at(0)
    saved = growth.state.to_dict()
    resumed = _growth()
    assert resumed.resume(saved, {"lr_scaling": "linear"}) == 4 and resumed.grow_at(0) is None
    with pytest.raises(ConfigError, match=r"lr_scaling='sqrt', but the checkpoint's fit ran with lr_scaling='linear'"):
        _growth().resume(saved, {"lr_scaling": "sqrt"})
    # a checkpoint written before the field's rename resumes the same
    older = {("decided_epoch" if key == "decided_boundary" else key): value for key, value in saved.items()}
    resumed = _growth()
    assert resumed.resume(older, {"lr_scaling": "linear"}) == 4 and resumed.grow_at(0) is None
    # the growth function as the adapters record it: a factory bound to other values is another
    from adaptive_batch import linear_ramp
    from adaptive_batch.run.framework_growth import growth_settings

    def recorded(fn):
        return growth_settings(GrowthOptions(batch_increase_function=fn), LRScalingOptions())

    growth = _growth()
    growth.start(6, 2, recorded(linear_ramp(8)))
    with pytest.raises(ConfigError, match=r"batch_increase_function='.*ramp \[linear_ramp\(increment=56, "
                                          r"every_n_epochs=1\)\]', but the checkpoint's fit ran with .*increment=8, "):
        _growth().resume(growth.state.to_dict(), recorded(linear_ramp(56)))


def test_the_lr_in_force_is_the_schedules_times_the_factor_and_the_hooks_leave_with_detach():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    growth = _growth()
    growth.start(8, 2, {})
    growth.grow_at(0)  # 4: twice the reference
    growth.attach_optimizer(optimizer, schedule, hold_before_step=True)
    assert growth.lr_factor() == 2
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # at 0.2, then the unscaled 0.1 back for the scheduler
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    schedule.step()
    growth.hold_lr()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # 0.05 x 2, not compounded
    growth.detach()
    optimizer.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # no hook left to change it


def test_a_skipped_step_leaves_the_scheduler_the_unscaled_lr():
    """A GradScaler skips optimizer.step() on inf gradients, so no step hook runs: the adapter puts
    the unscaled LR back before the step (Lightning's on_before_optimizer_step), and a chainable
    schedule then multiplies that, not the scaled one."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    growth = _growth()
    growth.start(8, 2, {})
    growth.grow_at(0)
    growth.attach_optimizer(optimizer, schedule, hold_before_step=True)
    growth.hold_lr()  # the batch starts: 0.2 in force
    growth.release_lr()  # before the step, which is skipped
    schedule.step()
    growth.hold_lr()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # 0.05 x 2; 0.2 compounded would be 0.2


def test_growth_toward_the_noise_scale_is_refused_where_nothing_measures_it():
    from adaptive_batch.schedule.noise_scale import noise_scale_growth

    with pytest.raises(ConfigError, match="grows toward the gradient noise scale, which a framework's loop"):
        _growth(fn=noise_scale_growth())


def _every(interval, fn=double, accumulate=False):
    return FrameworkGrowth(GrowthOptions(batch_increase_function=fn, batch_increase_interval=interval,
                                     grow_with_accumulation=accumulate), LRScalingOptions(lr_scaling="linear"),
                       within_epochs=True)


def test_within_epochs_each_batch_cut_counts_and_the_boundaries_it_reaches_are_decided_in_order():
    """Every 8 samples, doubling up to the 6 that fit: boundary 0 before the first step (2 -> 4),
    boundary 1 at 8 samples (4 -> 6, 8 asked); a partial batch counts its own rows."""
    growth = _every("8 samples")
    assert growth.start(6, 2, {}) == 4 and growth.state.decided_boundary == 0
    cut = []
    for rows in (4, 4, 6, 3):
        cut.append(growth.next_batch_size())
        growth.cut_batch(rows)
    assert cut == [4, 4, 6, 6] and (growth.state.steps, growth.state.samples) == (4, 17)
    assert growth.state.decided_boundary == 2  # 17 samples: boundaries 1 (8) and 2 (16)
    # the loader cuts ahead: the LR follows the samples of the step trained, as the recipes' does
    growth.attach_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), None)
    growth.train_samples(3)
    assert growth.lr_factor() == pytest.approx(3 / 2) and growth.lr_factor_for(6) == pytest.approx(3)


def test_an_epochs_length_is_simulated_without_cutting_and_its_end_taken_on_a_resume():
    growth = _every("2 steps", accumulate=True)
    growth.start(64, 2, {})  # 4 after boundary 0
    before = growth.state.to_dict()
    assert growth.batches_in_epoch(30, drop_last=False) == 5  # 4, 4 | 8, 8 | 16 asked, 6 left
    assert growth.batches_in_epoch(30, drop_last=True) == 4
    assert growth.state.to_dict() == before  # nothing cut
    growth.finish_epoch(30, drop_last=False)
    assert (growth.state.steps, growth.state.samples, growth.state.effective) == (5, 30, 16)


def test_intervals_a_loop_cannot_follow_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"batch_increase_interval='2 steps': this loop builds each epoch's batches"):
        FrameworkGrowth(GrowthOptions(batch_increase_function=double, batch_increase_interval="2 steps"),
                    LRScalingOptions())
    with pytest.raises(ConfigError, match=r"'100 tokens': .* grow every N steps or N samples"):
        _every("100 tokens")
    with pytest.raises(ConfigError, match=r"'3 steps' without a batch_increase_function: nothing would grow"):
        _every("3 steps", fn=None)
