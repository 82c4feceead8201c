"""The gradient noise scale against linear regression with Gaussian inputs and noise, where it
has a closed form: per-sample gradients g = x (x.(w - w*) - e), x ~ N(0, I_d), e ~ N(0, s^2),
so G = w - w* and tr(Sigma) = (d + 1)|G|^2 + d s^2."""

import math

import pytest
import torch

from adaptive_batch import ConfigError
from adaptive_batch.schedule.noise_scale import GradientNoiseScale, NoiseEstimate, estimate_noise


def true_noise_scale(delta, d, sigma):
    g2 = float(delta.pow(2).sum())
    return ((d + 1) * g2 + d * sigma**2) / g2


def micro_batch_gradients(w, w_star, sigma, sizes, generator):
    """Each micro-batch's mean gradient of 0.5 (x.w - y)^2, by autograd."""
    grads = []
    for n in sizes:
        x = torch.randn(n, w.numel(), generator=generator, dtype=torch.float64)
        y = x @ w_star + sigma * torch.randn(n, generator=generator, dtype=torch.float64)
        w_ = w.clone().requires_grad_(True)
        (0.5 * (x @ w_ - y).pow(2).mean()).backward()
        grads.append(w_.grad)
    return grads


@pytest.mark.parametrize("sizes", [[4, 4, 4, 4], [8, 3, 5]], ids=["equal", "unequal"])
def test_moving_averages_recover_the_closed_form_within_five_percent(sizes):
    d, sigma = 8, 1.0
    g = torch.Generator().manual_seed(0)
    w_star = torch.zeros(d, dtype=torch.float64)
    w = torch.full((d,), 1 / math.sqrt(d), dtype=torch.float64)  # |G| = 1
    expected = true_noise_scale(w - w_star, d, sigma)
    assert expected == pytest.approx(17.0)
    scale = GradientNoiseScale(ema_decay=0.999)
    for _ in range(4000):
        parts = micro_batch_gradients(w, w_star, sigma, sizes, g)
        step = sum(n * p for n, p in zip(sizes, parts)) / sum(sizes)  # the step's mean gradient
        scale.update(estimate_noise([float(p.pow(2).sum()) for p in parts], sizes, float(step.pow(2).sum()), sum(sizes)))
    assert scale.value == pytest.approx(expected, rel=0.05)
    assert scale.gradient_sq == pytest.approx(1.0, rel=0.05)


def test_one_step_is_unbiased_but_noisy_and_the_averages_are_bias_corrected():
    est = estimate_noise([2.0, 4.0], [1, 1], big_sq_norm=2.5, big_size=2)
    # trace = (3 - 2.5) / (1 - 1/2) = 1; |G|^2 = 2.5 - 1/2 = 2
    assert (est.trace, est.gradient_sq) == (1.0, 2.0)
    scale = GradientNoiseScale(ema_decay=0.9)
    assert scale.value is None
    assert scale.update(est) == pytest.approx(0.5)  # one update: the estimate itself, not 10% of it
    scale.update(NoiseEstimate(gradient_sq=float("nan"), trace=1.0))  # skipped
    assert scale.updates == 1
    assert GradientNoiseScale().update(NoiseEstimate(gradient_sq=-1.0, trace=1.0)) is None  # |G|^2 <= 0 so far


def test_state_round_trip_keeps_the_averages():
    a = GradientNoiseScale(0.9)
    for k in range(5):
        a.update(NoiseEstimate(gradient_sq=1.0 + k, trace=10.0))
    b = GradientNoiseScale(0.9)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value and b.updates == 5
    assert b.update(NoiseEstimate(2.0, 3.0)) == a.update(NoiseEstimate(2.0, 3.0))


@pytest.mark.parametrize("decay", [1.0, -0.1, "0.9", True])
def test_bad_decay(decay):
    with pytest.raises(ConfigError, match="noise_scale_ema="):
        GradientNoiseScale(decay)


def test_needs_two_parts():
    with pytest.raises(ValueError, match="at least two parts"):
        estimate_noise([1.0], [4], 1.0, 4)


def test_the_controller_measures_it_from_micro_batches_and_keeps_it_across_a_resume(tmp_path):
    from adaptive_batch import AdaptiveBatchController, AdaptiveBatchOptions
    from adaptive_batch.schedule.noise_scale import NOISE_SCALE_STATE_KEY, NoiseScaleOptions

    def make():
        return AdaptiveBatchController(
            AdaptiveBatchOptions(noise=NoiseScaleOptions(measure_noise_scale=True, noise_scale_ema=0.5)),
            batch_size=3, input_key="tokens", gradient_accumulation_steps=2, device=torch.device("cpu"), output_dir=str(tmp_path),
            max_seq_len=4,
        )

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    tokens_per_row = torch.tensor([3, 4, 2, 4, 1, 3])  # tokens that carry a loss, per row

    def forward_backward(piece):
        n = piece["n"].sum()
        loss = (model(piece["tokens"]).squeeze(-1) * piece["n"]).sum() ** 2 / n  # a per-token mean
        (loss * n).backward()
        return (loss * n).detach(), n

    batch = {"tokens": torch.randn(6, 4), "labels": torch.zeros(6, 4), "n": tokens_per_row.float()}
    ctl = make()
    ctl.track_gradients(model)
    ctl.settle(dataset_size=60)
    step = ctl.step(batch, forward_backward=forward_backward, optimizer_step=lambda tokens: None,
                    zero_grad=lambda: model.zero_grad(set_to_none=True))
    # the same estimate from each micro-batch's own per-token mean gradient, by hand
    parts = []
    for rows in (slice(0, 3), slice(3, 6)):
        model.zero_grad()
        piece = {k: v[rows] for k, v in batch.items()}
        loss, n = forward_backward(piece)
        parts.append((model.weight.grad.clone() / n, float(n)))
    step_mean = sum(g * n for g, n in parts) / sum(n for _, n in parts)
    by_hand = estimate_noise([float(g.pow(2).sum()) for g, _ in parts], [n for _, n in parts],
                             float(step_mean.pow(2).sum()), sum(n for _, n in parts))
    assert ctl.grower.noise_scale.trace == pytest.approx(by_hand.trace, rel=1e-5)
    assert ctl.grower.noise_scale.gradient_sq == pytest.approx(by_hand.gradient_sq, rel=1e-5)
    assert by_hand.gradient_sq > 0  # so a value exists: in samples, x 6 samples / 17 tokens
    assert step.noise_scale == pytest.approx(by_hand.trace / by_hand.gradient_sq * 6 / 17, rel=1e-5)
    state = ctl.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.grower.noise_scale.state_dict() == state[NOISE_SCALE_STATE_KEY] == ctl.grower.noise_scale.state_dict()


def _stats(noise, bound=None):
    from adaptive_batch import GrowthStatistics

    return GrowthStatistics(global_step=5, samples_seen=40, tokens_seen=400, gradient_noise_scale=noise,
                            max_batch_size=bound)


@pytest.mark.parametrize(
    "noise, current, increment",
    [
        (None, 4, 0),  # not measured yet: stay
        (float("nan"), 4, 0),
        (-3.0, 4, 0),  # a negative average |G|^2 estimate: stay
        (3.5, 4, 0),  # at or under the batch: never shrinks
        (4.9, 4, 0),  # toward 4.9: not a whole sample more
        (6.7, 4, 2),  # toward 6.7, floored
        (100.0, 4, 4),  # bounded by max_factor=2 a boundary
        (100.0, 50, 50),
    ],
)
def test_noise_scale_growth_decisions_on_scripted_statistics(noise, current, increment):
    from adaptive_batch import noise_scale_growth

    assert noise_scale_growth()(3, current, stats=_stats(noise)) == increment


def test_noise_scale_growth_fraction_factor_and_the_clamp():
    from adaptive_batch import noise_scale_growth
    from adaptive_batch.schedule.growth import grow_batch_size

    half = noise_scale_growth(max_factor=1.5, target_fraction=0.5)
    assert half(1, 10, stats=_stats(100.0)) == 5  # 1.5 x 10 before 0.5 x 100
    assert half(1, 10, stats=_stats(24.0)) == 2  # 0.5 x 24
    decision = grow_batch_size(noise_scale_growth(), epoch=1, current_batch_size=8, bound=12, stats=_stats(64.0))
    assert (decision.requested, decision.batch_size) == (16, 12)


@pytest.mark.parametrize("kwargs", [{"max_factor": 1.0}, {"max_factor": float("inf")}, {"target_fraction": 0},
                                    {"target_fraction": True}])
def test_noise_scale_growth_bad_arguments(kwargs):
    from adaptive_batch import noise_scale_growth

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        noise_scale_growth(**kwargs)


def _controller(tmp_path, noise, max_batch_size=None, **growth):
    from adaptive_batch import AdaptiveBatchController, AdaptiveBatchOptions, ProbeOptions
    from adaptive_batch.schedule.growth import GrowthOptions
    from adaptive_batch.schedule.noise_scale import NoiseScaleOptions

    lines = []
    ctl = AdaptiveBatchController(
        AdaptiveBatchOptions(noise=NoiseScaleOptions(**noise), growth=GrowthOptions(**growth),
                             probe=ProbeOptions(max_batch_size=max_batch_size)),
        batch_size=4, input_key="tokens", device=torch.device("cpu"), output_dir=str(tmp_path), max_seq_len=4, log=lines.append,
    )
    ctl.lines = lines
    return ctl


def test_noise_scale_growth_without_the_measurement_is_refused(tmp_path):
    from adaptive_batch import noise_scale_growth

    with pytest.raises(ConfigError, match="measure_noise_scale=True"):
        _controller(tmp_path, {}, batch_increase_function=noise_scale_growth(), batch_increase_interval="1 steps")
    with pytest.raises(ConfigError, match="noise_scale_split_step=True with measure_noise_scale=False"):
        _controller(tmp_path, {"noise_scale_split_step": True})


def _linear_batch(rows=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randn(rows, 4, generator=g), "labels": torch.zeros(rows, 4), "n": torch.ones(rows) * 2}


def _step_parts(model):
    def forward_backward(piece):
        n = piece["n"].sum()
        loss = (model(piece["tokens"]).squeeze(-1) - 1).pow(2).sum()
        loss.backward()
        return loss.detach(), n

    return forward_backward


def test_split_step_measures_one_micro_batch_steps_with_the_same_gradient(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    batch = _linear_batch(4)
    grads = {}
    for split in (False, True):
        ctl = _controller(tmp_path, {"measure_noise_scale": True, "noise_scale_split_step": split})
        ctl.track_gradients(model)
        ctl.settle(dataset_size=60)
        model.zero_grad(set_to_none=True)
        step = ctl.step(batch, forward_backward=_step_parts(model), optimizer_step=lambda tokens: None, zero_grad=lambda: model.zero_grad(set_to_none=True))
        grads[split] = model.weight.grad.clone()
        assert step.accumulated.micro_batch_sizes == ([2, 2] if split else [4])
        assert ctl.grower.noise_scale.updates == (1 if split else 0)  # one estimate folded in
        assert ctl.batch.max_micro_batch_size == 4  # the split is the step's, not kept as a limit
    torch.testing.assert_close(grads[True], grads[False])


def test_noise_scale_growth_waits_for_a_measurement_and_says_so_once(tmp_path):
    from adaptive_batch import noise_scale_growth

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    ctl = _controller(tmp_path, {"measure_noise_scale": True}, batch_increase_function=noise_scale_growth(),
                      batch_increase_interval="1 steps", max_batch_size=64)
    from torchdata.stateful_dataloader import StatefulDataLoader

    ctl.track_gradients(model)
    ctl.settle(dataset_size=40)
    rows = list(range(40))
    loader = StatefulDataLoader(rows, batch_sampler=ctl.batch_sampler(rows, shuffle=False), collate_fn=list)
    ctl.start_epoch(0, loader)
    for seed, indices in zip(range(3), loader):
        ctl.step(_linear_batch(len(indices), seed), forward_backward=_step_parts(model),
                 optimizer_step=lambda tokens: model.zero_grad(set_to_none=True), zero_grad=lambda: None)
    assert ctl.batch.batch_size == 4
    assert sum("no gradient noise scale yet" in line and "noise_scale_split_step=True" in line for line in ctl.lines) == 1
