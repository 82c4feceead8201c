"""The gradient noise scale against linear regression with Gaussian inputs and noise, where it
has a closed form: per-sample gradients g = x (x.(w - w*) - e), x ~ N(0, I_d), e ~ N(0, s^2),
so G = w - w* and tr(Sigma) = (d + 1)|G|^2 + d s^2."""

import math

import pytest
import torch

from adaptive_batch import ConfigError
from adaptive_batch.noise_scale import estimate_noise, GradientNoiseScale, NoiseEstimate


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
    from adaptive_batch.noise_scale import NOISE_SCALE_STATE_KEY, NoiseScaleOptions

    def make():
        return AdaptiveBatchController(
            AdaptiveBatchOptions(noise=NoiseScaleOptions(measure_noise_scale=True, noise_scale_ema=0.5)),
            batch_size=3, gradient_accumulation_steps=2, device=torch.device("cpu"), output_dir=str(tmp_path),
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
    ctl.track_gradients(model.parameters())
    ctl.settle(dataset_size=60)
    step = ctl.run_step(forward_backward, batch, zero_grad=lambda: model.zero_grad(set_to_none=True))
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
    assert ctl.noise_scale.trace == pytest.approx(by_hand.trace, rel=1e-5)
    assert ctl.noise_scale.gradient_sq == pytest.approx(by_hand.gradient_sq, rel=1e-5)
    assert by_hand.gradient_sq > 0  # so a value exists: in samples, x 6 samples / 17 tokens
    assert step.noise_scale == pytest.approx(by_hand.trace / by_hand.gradient_sq * 6 / 17, rel=1e-5)
    state = ctl.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.noise_scale.state_dict() == state[NOISE_SCALE_STATE_KEY] == ctl.noise_scale.state_dict()
