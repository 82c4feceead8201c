"""A fixed global batch: the split into micro-batches, the fastest split, and the controller
keeping the global batch through an out-of-memory error."""

import json

import pytest
import torch

from adaptive_batch import AdaptiveBatchController, AdaptiveBatchOptions, ConfigError, ProbeOptions
from adaptive_batch.data.token_budget import TokenBatchOptions
from adaptive_batch.probe.report import ProbeReport
from adaptive_batch.schedule.global_batch import GlobalBatchOptions, fastest_split, split_global_batch
from adaptive_batch.schedule.lr_scaling import LRScalingOptions

CPU = torch.device("cpu")


@pytest.mark.parametrize("global_batch,world,largest,expected", [
    (24, 1, 10, (8, 3, True)),    # 3 of 8, not 10 + 10 + 4
    (25, 1, 10, (9, 3, False)),   # 9 + 8 + 8
    (24, 2, 12, (12, 1, True)),   # 12 a rank, one micro-batch
    (24, 2, 64, (12, 1, True)),   # a micro-batch is never more than the share
    (32, 4, 3, (3, 3, False)),    # 8 a rank: 3 + 3 + 2
])
def test_fewest_micro_batches_as_equal_as_possible(global_batch, world, largest, expected):
    plan = split_global_batch(global_batch, world_size=world, largest_micro_batch=largest)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.even) == expected
    assert plan.per_rank == global_batch // world and plan.micro_batch_limit <= largest


def test_fastest_split_prefers_an_even_split_within_the_tolerance():
    trials = [(4, 0.50), (8, 0.80), (10, 1.00)]  # seconds a step at each timed size: the device saturates at 8
    # 40 a step: 10 x 4 = 4.0 s and 8 x 5 = 4.0 s, 4 x 10 = 5.0 s; both fastest are even: fewer wins
    assert fastest_split(40, world_size=1, trials=trials, tolerance=0.02).micro_batch_limit == 10
    # 24 a step: 10 -> 3 uneven micro-batches (3.0 s), 8 -> 3 even (2.4 s)
    plan = fastest_split(24, world_size=1, trials=trials, tolerance=0.02)
    assert (plan.micro_batch_size, plan.even, plan.chosen_by) == (8, True, "throughput")
    # 30 a step: 10 x 3 = 3.0 s even; 8 x 4 = 3.2 s uneven
    assert fastest_split(30, world_size=1, trials=trials, tolerance=0.1).micro_batch_size == 10
    with pytest.raises(ValueError, match="no throughput trials"):
        fastest_split(30, world_size=1, trials=[], tolerance=0.1)


def controller(tmp_path, global_batch, *, batch_size=4, accumulation=1, **sections):
    lines = []
    ctl = AdaptiveBatchController(
        AdaptiveBatchOptions(global_batch=GlobalBatchOptions(global_batch_size=global_batch), **sections),
        batch_size=batch_size, input_key="tokens", gradient_accumulation_steps=accumulation, device=CPU,
        output_dir=str(tmp_path), max_seq_len=16, log=lines.append,
    )
    ctl.lines = lines
    return ctl


@pytest.mark.parametrize("kwargs,message", [
    (dict(global_batch=0), "global_batch_size=0 must be"),
    (dict(global_batch=24, accumulation=4), "gradient_accumulation_steps=4 with global_batch_size=24: the accumulation follows"),
    (dict(global_batch=24, tokens=TokenBatchOptions(max_tokens=64)), "global_batch_size=24 with max_tokens=64"),
])
def test_bad_global_batches_fail_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        controller(tmp_path, **kwargs)


def test_global_batch_over_the_data_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size=24 is 24 samples a rank a step, more than the 20"):
        controller(tmp_path, 24).settle(dataset_size=20)


def test_probed_micro_batch_and_constant_lr_through_an_out_of_memory_error(tmp_path):
    probe_report = ProbeReport(max_batch_size=10, batch_size=10, budget_bytes=2**30)
    ctl = controller(
        tmp_path, 24, probe=ProbeOptions(use_maximum_batch_size=True), lr_scaling=LRScalingOptions(lr_scaling="linear")
    )
    batch = ctl.settle(dataset_size=100, probe=lambda options, **kw: probe_report)
    assert (batch.batch_size, batch.max_micro_batch_size) == (24, 10)
    written = json.loads((tmp_path / "batch_probe.json").read_text())["global_batch"]
    assert written["micro_batch_size"] == 8 and written["gradient_accumulation_steps"] == 3 and written["even"]
    assert "global_batch_size=24: 24 samples a rank a step in 3 micro-batches of up to 8 (even)" in ctl.lines[-1]

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    ctl.attach_lr(optimizer, None, read_lr=lambda: optimizer.param_groups[0]["lr"])
    sizes_run = []

    def forward_backward(piece):
        rows = piece["tokens"].shape[0]
        sizes_run.append(rows)
        if rows > 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = model(piece["tokens"].float()).sum()
        loss.backward()
        return loss.detach(), torch.tensor(rows * 4)

    rows = {"tokens": torch.ones(24, 4), "labels": torch.zeros(24, 4)}
    step = ctl.step(rows, forward_backward=forward_backward, optimizer_step=lambda tokens: optimizer.step(),
                    zero_grad=optimizer.zero_grad)
    assert step.lr == 1.0  # the reference is the global batch: no scaling
    # 8 ran out: halved to 4, six micro-batches; the step still held all 24 samples
    assert step.accumulated.micro_batch_sizes == [4] * 6 and step.global_samples == 24
    assert (ctl.batch.batch_size, ctl.batch.max_micro_batch_size) == (24, 4)


def test_the_global_batch_grows_by_accumulation_within_what_fits(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from adaptive_batch.schedule.growth import GrowthOptions

    ctl = controller(
        tmp_path, 8, probe=ProbeOptions(use_maximum_batch_size=True),
        growth=GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch"),
    )
    batch = ctl.settle(dataset_size=64, probe=lambda options, **kw: ProbeReport(max_batch_size=4, batch_size=4, budget_bytes=2**30))
    rows = list(range(64))
    loader = StatefulDataLoader(rows, batch_sampler=ctl.batch_sampler(rows, shuffle=False), collate_fn=list)
    sizes = []
    for epoch in range(3):
        ctl.start_epoch(epoch, loader)
        sizes.append((batch.batch_size, batch.micro_batch_size, batch.grad_accum_steps))
    # from the global 8: doubled each epoch past the probed 4 (grow_with_accumulation implied)
    assert sizes == [(8, 4, 2), (16, 4, 4), (32, 4, 8)]


def test_a_trial_runs_two_micro_batches_where_a_step_may_hold_more_than_one():
    from adaptive_batch.schedule.global_batch import micro_batches_per_trial

    assert micro_batches_per_trial(8) == 1
    assert micro_batches_per_trial(8, gradient_accumulation_steps=4) == 2
    assert micro_batches_per_trial(8, grow_with_accumulation=True) == 2
    assert [micro_batches_per_trial(b, global_batch_size=32, world_size=2) for b in (8, 15, 16, 64)] == [2, 2, 1, 1]
