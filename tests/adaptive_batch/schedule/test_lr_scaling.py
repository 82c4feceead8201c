
import pytest
import torch

from adaptive_batch.schedule.lr_scaling import BatchLRScaler, LRRule, lr_scale_factor


def test_rules():
    assert lr_scale_factor(32, 8, "linear") == 4
    assert lr_scale_factor(32, 8, "sqrt") == 2
    assert lr_scale_factor(32, 8, "none") == 1
    with pytest.raises(ValueError, match="lr_scaling='cubic'"):
        lr_scale_factor(2, 1, "cubic")


def opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_scaler_without_scheduler_scales_the_configured_lr_every_step():
    o = opt()
    s = BatchLRScaler(o, rule="linear", reference=4, unit="samples")
    assert s.apply(samples=8, tokens=100) == pytest.approx(0.2)
    s.restore()
    assert o.param_groups[0]["lr"] == pytest.approx(0.1)
    assert s.apply(samples=2, tokens=100) == pytest.approx(0.05)  # no compounding


def test_scaler_composes_with_a_scheduler_in_tokens():
    o = opt()
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # chainable: multiplies lr
    s = BatchLRScaler(o, rule="sqrt", reference=1000, unit="tokens", lr_scheduler=sched)
    lrs = []
    for _ in range(3):
        lrs.append(s.apply(samples=1, tokens=4000))
        o.step()
        s.restore()
        sched.step()
    assert lrs == pytest.approx([0.2, 0.1, 0.05])


def _steps(optimizer, scheduler, scaler, batches):
    """Steps as the coupling runs them; the LR each used, and the LR held between steps."""
    used, held = [], []
    for samples in batches:
        used.append(scaler.apply(samples=samples, tokens=0))
        optimizer.step()
        scaler.restore()
        scheduler.step()
        scaler.hold()
        held.append(optimizer.param_groups[0]["lr"])
    return used, held


def test_between_steps_the_optimizer_holds_the_lr_in_force_and_a_resume_from_it_continues_exactly():
    def parts():
        o = opt()
        sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # chainable: reads the optimizer's LR
        return o, sched, BatchLRScaler(o, rule="linear", reference=4, lr_scheduler=sched)

    batches = [8, 8, 16, 16, 4]
    o, sched, scaler = parts()
    used, held = _steps(o, sched, scaler, batches)
    assert used == pytest.approx([0.2, 0.1, 0.1, 0.05, 0.00625])  # 0.1 halved each step, x batch / 4
    assert held == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.003125])  # the next schedule LR at the last factor
    # A checkpoint after step 2 holds the scaled LR; loaded into a new optimizer, nothing compounds.
    o, sched, scaler = parts()
    _steps(o, sched, scaler, batches[:2])
    saved = o.state_dict(), sched.state_dict()
    o2 = opt()
    o2.load_state_dict(saved[0])
    sched2 = torch.optim.lr_scheduler.StepLR(o2, step_size=1, gamma=0.5)
    sched2.load_state_dict(saved[1])
    resumed, _ = _steps(o2, sched2, BatchLRScaler(o2, rule="linear", reference=4, lr_scheduler=sched2), batches[2:])
    assert resumed == pytest.approx(used[2:])
    # without a scheduler the base comes from the held LR and its factor
    o3 = opt()
    plain = BatchLRScaler(o3, rule="linear", reference=4)
    plain.apply(samples=16, tokens=0)
    plain.restore()
    plain.hold()
    assert o3.param_groups[0]["lr"] == pytest.approx(0.4)
    o4 = opt()
    o4.load_state_dict(o3.state_dict())
    assert BatchLRScaler(o4, rule="linear", reference=4).apply(samples=2, tokens=0) == pytest.approx(0.05)


def test_bad_reference_and_unit():
    with pytest.raises(ValueError, match="lr_scaling_reference=0"):
        BatchLRScaler(opt(), rule="linear", reference=0)
    with pytest.raises(ValueError, match="lr_scaling_unit='bytes'"):
        BatchLRScaler(opt(), rule="linear", reference=1, unit="bytes")


@pytest.mark.parametrize("rule, decay_at_4x", [("linear", 0.01), ("sqrt", 0.02), ("none", 0.04)])
def test_weight_decay_keeps_the_adamw_timescale(rule, decay_at_4x):
    """Power Lines: B / (lr x weight_decay) stays the configured 8 / (0.1 x 0.01)."""
    o = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1, weight_decay=0.01)
    s = BatchLRScaler(o, rule=rule, reference=8, weight_decay_scaling="timescale")
    lr = s.apply(samples=32, tokens=0)
    assert o.param_groups[0]["weight_decay"] == pytest.approx(decay_at_4x) == s.last_weight_decay
    assert 32 / (lr * o.param_groups[0]["weight_decay"]) == pytest.approx(8 / (0.1 * 0.01))
    s.restore()
    assert o.param_groups[0]["weight_decay"] == 0.01 and o.param_groups[0]["lr"] == 0.1


def test_weight_decay_left_alone_by_default_and_refused_without_one():
    o = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1, weight_decay=0.01)
    s = BatchLRScaler(o, rule="linear", reference=8)
    s.apply(samples=32, tokens=0)
    assert o.param_groups[0]["weight_decay"] == 0.01 and s.last_weight_decay is None
    with pytest.raises(ValueError, match="weight_decay_scaling='timescale' with NoDecay, which has no weight_decay"):
        BatchLRScaler(NoDecay(), rule="none", reference=8, weight_decay_scaling="timescale")
    with pytest.raises(ValueError, match="weight_decay_scaling='always'"):
        BatchLRScaler(o, rule="none", reference=8, weight_decay_scaling="always")
    # was a silent no-op: zero scaled is zero
    none = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1, weight_decay=0.0)
    with pytest.raises(ValueError, match="weight_decay_scaling='timescale' with AdamW's weight_decay=0: scaling zero"):
        BatchLRScaler(none, rule="linear", reference=8, weight_decay_scaling="timescale")


class NoDecay(torch.optim.Optimizer):
    """An optimizer whose param groups have no weight_decay."""

    def __init__(self):
        super().__init__([torch.nn.Parameter(torch.zeros(2))], {"lr": 0.1})

    def step(self, closure=None):
        return None


def test_weight_decay_scaling_option_checks():
    from adaptive_batch import ConfigError
    from adaptive_batch.schedule.lr_scaling import LRScalingOptions

    with pytest.raises(ConfigError, match="weight_decay_scaling='yes'"):
        LRScalingOptions(weight_decay_scaling="yes")
    assert LRScalingOptions(weight_decay_scaling="timescale").scales
    assert not LRScalingOptions().scales


@pytest.mark.parametrize("rule, lr_factor, decay_factor", [("linear", 4.0, 1.0), ("sqrt", 2.0, 2.0)])
def test_the_rule_and_the_scaler_give_the_papers_factors(rule, lr_factor, decay_factor):
    # 4x the reference batch: linear 4x the LR (the decay stays); sqrt 2x the LR and 2x the decay,
    # so lr x weight_decay grows 4x with the batch (the AdamW timescale B / (lr x wd) is kept).
    factors = LRRule(rule=rule, reference=8, weight_decay_scaling="timescale").factors(samples=32, tokens=0)
    assert (factors.lr_factor, factors.weight_decay_factor) == (pytest.approx(lr_factor), pytest.approx(decay_factor))
    o = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1, weight_decay=0.01)
    s = BatchLRScaler(o, rule=rule, reference=8, weight_decay_scaling="timescale")
    assert s.apply(samples=32, tokens=0) == pytest.approx(0.1 * lr_factor)
    assert o.param_groups[0]["weight_decay"] == pytest.approx(0.01 * decay_factor)


def test_a_rule_refuses_a_reference_it_cannot_scale_against():
    with pytest.raises(ValueError, match="lr_scaling_reference=0"):
        LRRule(rule="sqrt", reference=0)
    assert LRRule(rule="none", reference=0).factors(samples=5, tokens=0).lr_factor == 1.0
