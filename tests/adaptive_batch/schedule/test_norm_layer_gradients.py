"""Per-example gradient norms of the normalisation layers, against each example's own backward."""

import pytest
import torch
from torch import nn

from adaptive_batch import ConfigError
from adaptive_batch.distributed import RankGroup
from adaptive_batch.run.step import accumulate_gradients
from adaptive_batch.schedule.noise_scale import NoiseScaleOptions, estimate_noise
from adaptive_batch.schedule.norm_layer_gradients import NormLayerGradients, find_norm_layers

IGNORE = -100


class LlamaStyleRMSNorm(nn.Module):
    """transformers' Llama RMSNorm: ``weight`` and ``variance_epsilon``, computed in float32."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


def _model(d=6):
    from torchtune.modules import RMSNorm as TorchtuneRMSNorm

    torch.manual_seed(0)
    layers = [nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d), TorchtuneRMSNorm(d), nn.GELU(), nn.Linear(d, d),
              nn.RMSNorm(d, eps=1e-5), nn.Linear(d, d), LlamaStyleRMSNorm(d), nn.Linear(d, 1)]
    model = nn.Sequential(*layers)
    with torch.no_grad():  # weights and biases away from their initial ones, so each term counts
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _batch(rows=5, seq=4, d=6):
    """Sequences of ``seq`` tokens, or with ``seq=None`` one vector a sample (an MLP's rows)."""
    g = torch.Generator().manual_seed(1)
    if seq is None:
        labels = torch.randn(rows, generator=g)
        labels[3] = IGNORE
        return {"tokens": torch.randn(rows, d, generator=g), "labels": labels}
    labels = torch.randn(rows, seq, generator=g)
    labels[0, 2:] = IGNORE  # uneven lengths, and a sample with no counted token
    labels[3, :] = IGNORE
    return {"tokens": torch.randn(rows, seq, d, generator=g), "labels": labels}


def _summed_loss(model, batch):
    counted = batch["labels"] != IGNORE
    out = model(batch["tokens"]).squeeze(-1)
    return ((out - batch["labels"]).pow(2) * counted).sum(), counted.sum()


def _row_tokens(batch):
    return (batch["labels"] != IGNORE).reshape(batch["labels"].shape[0], -1).sum(1)


def _norm_params(model):
    return [p for layer in find_norm_layers(model) for p in (layer.weight, layer.bias) if p is not None]


def test_finds_every_kind_of_layer_norm_and_rms_norm_and_skips_batch_norm():
    layers = find_norm_layers(_model())
    assert [(type(layer.module).__name__, layer.rms, layer.bias is not None) for layer in layers] == [
        ("LayerNorm", False, True), ("RMSNorm", True, False), ("RMSNorm", True, False),
        ("LlamaStyleRMSNorm", True, False),
    ]
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ConfigError, match="noise_scale_estimator='norm_layers' found no LayerNorm.*micro_batches"):
        NormLayerGradients(conv, _row_tokens)


@pytest.mark.parametrize("seq", [4, None], ids=["sequences", "vectors"])
@pytest.mark.parametrize("micro_batch_limit", [5, 2], ids=["one_micro_batch", "three_micro_batches"])
def test_each_examples_norm_and_the_steps_equal_their_own_backward(micro_batch_limit, seq):
    model, batch = _model(), _batch(seq=seq)
    expected_rows = []
    for i in range(5):  # each sample's own gradient of the norm layers' weights
        model.zero_grad(set_to_none=True)
        _summed_loss(model, {k: v[i : i + 1] for k, v in batch.items()})[0].backward()
        expected_rows.append(sum(float(p.grad.pow(2).sum()) for p in _norm_params(model)))
    model.zero_grad(set_to_none=True)
    _summed_loss(model, batch)[0].backward()
    expected_step = sum(float(p.grad.pow(2).sum()) for p in _norm_params(model))

    model.zero_grad(set_to_none=True)
    observer = NormLayerGradients(model, _row_tokens)
    observer.attach()

    def forward_backward(piece):
        loss, tokens = _summed_loss(model, piece)
        loss.backward()
        return loss.detach(), tokens

    step = accumulate_gradients(forward_backward, batch, rows=5, micro_batch_limit=micro_batch_limit,
                                zero_grad=lambda: model.zero_grad(set_to_none=True), observer=observer)
    observer.detach()
    assert len(step.micro_batch_sizes) == len(observer.row_sq_norms)
    torch.testing.assert_close(torch.cat(observer.row_sq_norms).double(), torch.tensor(expected_rows, dtype=torch.float64),
                               rtol=1e-4, atol=1e-6)
    assert float(observer.step_sq_norm()) == pytest.approx(expected_step, rel=1e-4)
    tokens = [int(t) for t in torch.cat(observer.tokens)]
    assert tokens == ([2, 4, 4, 0, 4] if seq else [1, 1, 1, 0, 1])

    # The step's estimate: each counted sample a small batch of its tokens, the step the big one.
    noise = observer.step_noise(RankGroup.alone())
    kept = [(sq / t**2, t) for sq, t in zip(expected_rows, tokens) if t]
    total = sum(tokens)
    reference = estimate_noise([m for m, _ in kept], [t for _, t in kept], expected_step / total**2, total)
    assert noise.tokens == total
    assert noise.estimate.trace == pytest.approx(reference.trace, rel=1e-4)
    assert noise.estimate.gradient_sq == pytest.approx(reference.gradient_sq, rel=1e-4)


def test_an_rms_norm_without_eps_normalises_as_torch_does_in_bf16():
    norm = nn.RMSNorm(4, eps=None)
    (layer,) = find_norm_layers(norm)
    x = torch.tensor([[1e-3, -1e-3, 2e-3, 0.0]], dtype=torch.bfloat16)
    torch.testing.assert_close(layer.normalised(x), norm(x).float(), rtol=1e-2, atol=1e-2)


def test_the_micro_batch_estimator_still_takes_the_parameters_and_the_per_example_one_needs_the_model(tmp_path):
    from adaptive_batch.run.grower import Grower
    from adaptive_batch.schedule.growth import GrowthOptions

    model = _model()
    grower = Grower(GrowthOptions(), NoiseScaleOptions(measure_noise_scale=True), ranks=RankGroup.alone())
    grower.track_gradients(model.parameters())  # as callers before the estimator option did
    assert len(grower.gradients.params) == len(list(model.parameters()))
    per_example = Grower(GrowthOptions(), NoiseScaleOptions(measure_noise_scale=True, noise_scale_estimator="norm_layers"),
                         ranks=RankGroup.alone())
    with pytest.raises(ValueError, match="needs the model .* and row_tokens"):
        per_example.track_gradients(model.parameters(), row_tokens=_row_tokens)


def test_a_step_outside_a_micro_batch_and_a_detached_observer_record_nothing():
    model, batch = _model(), _batch()
    observer = NormLayerGradients(model, _row_tokens)
    observer.attach()
    observer.start()
    _summed_loss(model, batch)[0].backward()  # an evaluation or the probe's own step: no micro-batch begun
    assert observer.row_sq_norms == [] and observer.step_noise(RankGroup.alone()) is None
    observer.detach()
    observer.before_micro_batch(batch)
    _summed_loss(model, batch)[0].backward()
    observer.after_micro_batch(14)
    assert float(torch.cat(observer.row_sq_norms).sum()) == 0.0  # no hooks left


def test_activation_checkpointing_counts_each_layer_once():
    from torch.utils.checkpoint import checkpoint

    model, batch = _model(), _batch()
    observer = NormLayerGradients(model, _row_tokens)
    observer.attach()
    results = []
    for use_checkpoint in (False, True):
        model.zero_grad(set_to_none=True)
        observer.start()
        observer.before_micro_batch(batch)
        counted = batch["labels"] != IGNORE
        out = checkpoint(model, batch["tokens"], use_reentrant=False) if use_checkpoint else model(batch["tokens"])
        ((out.squeeze(-1) - batch["labels"]).pow(2) * counted).sum().backward()
        observer.after_micro_batch(14)
        results.append(observer.row_sq_norms[0])
    torch.testing.assert_close(results[1], results[0])


def test_the_options_refuse_a_split_with_per_example_norms_and_an_unknown_estimator():
    with pytest.raises(ConfigError, match="noise_scale_split_step=True with noise_scale_estimator='norm_layers'"):
        NoiseScaleOptions(measure_noise_scale=True, noise_scale_estimator="norm_layers", noise_scale_split_step=True)
    with pytest.raises(ConfigError, match="noise_scale_estimator='layers': use one of 'micro_batches', 'norm_layers'"):
        NoiseScaleOptions(measure_noise_scale=True, noise_scale_estimator="layers")
