"""The session's decisions on their own: epochs, steps, growth, LR factors and resume, with no
model, optimizer or sampler anywhere (what a framework adapter drives)."""

import math
from typing import List, Tuple

import pytest
import torch

from adaptive_batch.probe.service import ProbeOptions
from adaptive_batch.run.options import AdaptiveBatchOptions
from adaptive_batch.run.progress import BATCH_STATE_KEY
from adaptive_batch.run.session import BatchSession, BatchScaling, Resize, StepRecord
from adaptive_batch.schedule.global_batch import GlobalBatchOptions
from adaptive_batch.schedule.growth import GrowthOptions
from adaptive_batch.schedule.lr_scaling import LRScalingOptions
from adaptive_batch.schedule.noise_scale import NoiseScaleOptions

CPU = torch.device("cpu")
DOUBLE = "adaptive_batch.double_every_epoch"


def session(tmp_path, *, batch_size=4, accumulation=1, **sections) -> BatchSession:
    return BatchSession(
        AdaptiveBatchOptions(**sections), batch_size=batch_size, gradient_accumulation_steps=accumulation,
        device=CPU, output_dir=str(tmp_path), log=lambda line: None,
    )


def run_epoch(s: BatchSession, epoch: int, tokens_per_sample: int = 10) -> Tuple[List[int], List[Resize]]:
    """What an adapter does with an epoch: the batch the epoch starts with, steps until the epoch's
    samples are spent (the last may be short), each recorded."""
    start = s.begin_epoch(epoch)
    left = min(s.batch.samples_per_epoch, s.dataset_size) - s.batch.epoch_samples
    at_most = s.steps_left(0)  # at the epoch's batch: growth inside the epoch only shortens it
    steps, resizes = [], []
    while left:
        rows = min(s.batch.batch_size, left)
        micro = s.split_step(rows)
        assert sum(micro.micro_batch_sizes) == rows and max(micro.micro_batch_sizes) <= micro.micro_batch_limit
        resize = s.record_step(StepRecord(rows, rows, rows * tokens_per_sample, micro.micro_batch_limit))
        steps.append(rows)
        left -= rows
        resizes += [resize] if resize is not None else []
    assert start.epoch == epoch and start.batch_size == steps[0] and len(steps) <= at_most
    return steps, resizes


def test_the_probe_is_told_what_the_noise_scale_holds_and_the_settings_a_trial_depends_on(tmp_path):
    """The copy of the gradients the micro-batch estimator keeps was not counted under a soft
    budget, and answers cached without the noise scale came back beside it."""
    s = BatchSession(AdaptiveBatchOptions(probe=ProbeOptions(use_maximum_batch_size=True),
                                          noise=NoiseScaleOptions(measure_noise_scale=True)),
                     batch_size=4, gradient_accumulation_steps=2, device=CPU, output_dir=str(tmp_path), max_seq_len=0,
                     log=lambda line: None)
    model = torch.nn.Linear(8, 4)
    s.grower.track_gradients(model)
    told = {}

    def probe(options, **kwargs):
        told.update(kwargs)
        from adaptive_batch.probe.report import ProbeReport
        return ProbeReport(max_batch_size=4, batch_size=4, budget_bytes=2**30)

    s.settle(dataset_size=40, probe=probe)
    assert sum(t.numel() * t.element_size() for t in told["held"]) == sum(p.numel() * 4 for p in model.parameters())
    assert told["trial_fields"]["measure_noise_scale"] is True and told["trial_fields"]["gradient_accumulation_steps"] == 2


def test_growth_at_each_epoch_is_the_epochs_batch_and_every_sample_is_trained_once(tmp_path):
    s = session(tmp_path, growth=GrowthOptions(batch_increase_function=DOUBLE), probe=ProbeOptions(max_batch_size=16))
    s.settle(dataset_size=40)
    epochs = [run_epoch(s, epoch)[0] for epoch in range(4)]
    # 4, then doubled at each epoch's start, held at the largest micro-batch (16)
    assert [steps[0] for steps in epochs] == [4, 8, 16, 16]
    assert all(sum(steps) == 40 for steps in epochs)
    assert s.global_step == sum(len(steps) for steps in epochs)
    assert s.batch.global_samples_seen == 160 and s.batch.tokens_seen == 1600


def test_an_interval_in_steps_answers_a_resize_at_the_step_that_reaches_it(tmp_path):
    s = session(
        tmp_path, growth=GrowthOptions(batch_increase_function=DOUBLE, batch_increase_interval="2 steps"),
        probe=ProbeOptions(max_batch_size=64),
    )
    s.settle(dataset_size=100)
    steps, resizes = run_epoch(s, 0)
    # every 2 steps, the next step takes the new batch
    assert steps == [4, 4, 8, 8, 16, 16, 32, 12]
    assert resizes == [Resize(4, 8), Resize(8, 16), Resize(16, 32), Resize(32, 64)]
    # at the bound a boundary leaves the batch as it was: nothing to resize
    s.begin_epoch(1)
    assert [s.record_step(StepRecord(64, 64, 640, 64)) for _ in range(4)] == [None] * 4


def test_a_step_splits_into_the_fewest_micro_batches_that_fit_and_keeps_a_limit_lowered_by_a_retry(tmp_path):
    s = session(tmp_path, batch_size=5, accumulation=2)  # torchtune: 5 a micro-batch, 2 a step
    s.settle(dataset_size=100)
    assert s.begin_epoch(0).micro_batches == 2
    assert s.split_step(10).micro_batch_sizes == (5, 5)
    assert s.split_step(7).micro_batch_sizes == (4, 3)  # an epoch's short last step
    s.record_step(StepRecord(10, 10, 100, micro_batch_limit=3, oom_retries=1, micro_batch_sizes=(3, 3, 2, 2)))
    assert s.split_step(10).micro_batch_sizes == (3, 3, 2, 2)
    assert s.batch.oom_retries == 1


def test_a_split_step_for_the_noise_scale_has_two_micro_batches_where_rows_allow(tmp_path):
    s = session(tmp_path, noise=NoiseScaleOptions(measure_noise_scale=True, noise_scale_split_step=True))
    s.settle(dataset_size=100)
    assert s.split_step(4).micro_batch_sizes == (2, 2)
    assert s.split_step(1).micro_batch_sizes == (1,)


@pytest.mark.parametrize(
    "rule, unit, reference, samples, tokens, expected",
    [
        ("linear", "samples", None, 16, 0, 4.0),  # against the configured 4 samples
        ("sqrt", "samples", None, 16, 0, 2.0),
        ("linear", "tokens", 1000, 3, 4000, 4.0),
        ("none", "samples", None, 16, 0, 1.0),
    ],
)
def test_the_lr_factor_follows_the_rule_against_its_reference(tmp_path, rule, unit, reference, samples, tokens, expected):
    s = session(tmp_path, lr_scaling=LRScalingOptions(lr_scaling=rule, lr_scaling_unit=unit, lr_scaling_reference=reference))
    s.settle(dataset_size=100)
    assert s.scaling(global_samples=samples, tokens=tokens).lr_factor == pytest.approx(expected)


def test_the_weight_decay_factor_keeps_the_timescale(tmp_path):
    options = LRScalingOptions(lr_scaling="sqrt", weight_decay_scaling="timescale")
    s = session(tmp_path, lr_scaling=options)
    s.settle(dataset_size=100)
    scaling = s.scaling(global_samples=16, tokens=0)
    # lr x weight_decay grows with the batch: 4x the samples, 2x the LR, 2x the decay
    assert scaling == BatchScaling(pytest.approx(2.0), pytest.approx(2.0))
    assert scaling.lr_factor * scaling.weight_decay_factor == pytest.approx(16 / 4)


def test_a_global_batch_sets_the_lr_reference_to_a_ranks_share(tmp_path):
    s = session(
        tmp_path, batch_size=2, global_batch=GlobalBatchOptions(global_batch_size=12),
        lr_scaling=LRScalingOptions(lr_scaling="linear"),
    )
    s.settle(dataset_size=100)
    assert s.lr_rule.reference == 12
    assert s.scaling(global_samples=12, tokens=0).lr_factor == pytest.approx(1.0)
    assert s.scaling(global_samples=6, tokens=0).lr_factor == pytest.approx(0.5)  # a short last step


def test_a_session_resumed_inside_an_epoch_continues_its_steps_and_batch(tmp_path):
    growth = GrowthOptions(batch_increase_function=DOUBLE)
    first = session(tmp_path, growth=growth, probe=ProbeOptions(max_batch_size=16))
    first.settle(dataset_size=40)
    run_epoch(first, 0)
    first.begin_epoch(1)
    for _ in range(2):
        first.record_step(StepRecord(8, 8, 80, 16))
    state = first.state_dict()

    resumed = session(tmp_path, growth=growth, probe=ProbeOptions(max_batch_size=16))
    resumed.load_state_dict(state)
    resumed.settle(dataset_size=40)
    start = resumed.begin_epoch(1)
    # growth at epoch 1's start was applied before the checkpoint: not again
    assert start.resumed_after_step == 2 and start.batch_size == 8
    assert resumed.steps_left(0) == math.ceil((40 - 16) / 8)
    assert resumed.state_dict()[BATCH_STATE_KEY] == state[BATCH_STATE_KEY]
    assert first.begin_epoch(1).resumed_after_step == 2  # the same answer as the run that wrote it


@pytest.mark.parametrize("max_steps, fresh, resumed", [(None, 5, 3), (4, 4, 2)])
def test_steps_left_is_what_the_sampler_yields_fresh_and_resumed(tmp_path, max_steps, fresh, resumed):
    # The session counts from settle's dataset_size, the sampler from the dataset: they agree.
    dataset = list(range(23))
    s = session(tmp_path, batch_size=5)
    s.settle(dataset_size=len(dataset), max_steps_per_epoch=max_steps)
    sampler = s.mode.batch_sampler(dataset, s.batch, s.ranks, shuffle=False)
    s.begin_epoch(0)
    assert s.steps_left(0) == len(sampler) == fresh
    batches = iter(sampler)
    for _ in range(2):
        rows = len(next(batches))
        s.record_step(StepRecord(rows, rows, rows, micro_batch_limit=5))
    again = s.mode.batch_sampler(dataset, s.batch, s.ranks, shuffle=False)
    again.load_state_dict(sampler.state_dict())
    assert s.steps_left(0) == len(again) == resumed


def test_the_lr_rule_is_decided_once_by_settle(tmp_path):
    s = session(tmp_path, lr_scaling=LRScalingOptions(lr_scaling="sqrt"))
    with pytest.raises(RuntimeError, match=r"decided by settle\(\)"):
        s.lr_rule
    s.settle(dataset_size=100)
    assert s.lr_rule is s.lr_rule and s.lr_rule.reference == 4  # one object, read every step
