"""The controller's decisions, in-process: settling the batch, growth, steps, LR coupling, state."""

import copy
import json
import math
from typing import Any, Dict, List

import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from adaptive_batch import (
    AdaptiveBatchController,
    AdaptiveBatchOptions,
    BatchIncreaseFunctionError,
    ConfigError,
    ProbeOptions,
)
from adaptive_batch.data.token_budget import TokenBatchOptions
from adaptive_batch.memory.device import DeviceCapacity
from adaptive_batch.probe.report import PROBE_STATE_KEY, ProbeReport
from adaptive_batch.run.batching import SampleBatches, TokenBatches
from adaptive_batch.run.progress import BATCH_STATE_KEY
from adaptive_batch.schedule.global_batch import GlobalBatchOptions
from adaptive_batch.schedule.growth import GrowthOptions
from adaptive_batch.schedule.lr_scaling import LRScalingOptions

CPU = torch.device("cpu")


def controller(tmp_path, *, batch_size=4, accumulation=1, packed=False, optimizer_in_bwd=False, seq_len=16, **sections):
    lines: List[str] = []
    ctl = AdaptiveBatchController(
        AdaptiveBatchOptions(**sections),
        batch_size=batch_size,
        input_key="input_ids",  # not torchtune's "tokens": the key is the caller's
        gradient_accumulation_steps=accumulation,
        device=CPU,
        output_dir=str(tmp_path),
        max_seq_len=seq_len,
        packed=packed,
        optimizer_in_bwd=optimizer_in_bwd,
        log=lines.append,
    )
    ctl.lines = lines
    return ctl


class ScriptedProbe:
    """Stands in for probe_batch_size: records its calls and answers with a report."""

    def __init__(self, max_batch_size: int, batch_size: int = None) -> None:
        self.report = ProbeReport(max_batch_size=max_batch_size, batch_size=batch_size or max_batch_size, budget_bytes=2**30)
        self.calls: List[Dict[str, Any]] = []

    def __call__(self, options, **kwargs):
        self.calls.append(dict(kwargs, options=options))
        return copy.deepcopy(self.report)


def test_the_controller_checks_the_settings_against_the_run_before_anything(tmp_path):
    with pytest.raises(ConfigError, match="max_tokens=2048 with dataset.packed=True"):
        controller(tmp_path, tokens=TokenBatchOptions(max_tokens=2048), packed=True)
    with pytest.raises(ConfigError, match="batch_size=0 must be a positive integer"):
        controller(tmp_path, batch_size=0)


def test_fixed_batch_without_probing(tmp_path):
    ctl = controller(tmp_path, batch_size=3, accumulation=2)
    assert isinstance(ctl.mode, SampleBatches) and not ctl.options.needs_probe
    batch = ctl.settle(dataset_size=100, probe=None)
    assert (batch.batch_size, batch.max_micro_batch_size, batch.samples_per_epoch) == (6, 3, 100)
    assert ctl.probe_report is None


def test_max_steps_per_epoch_counts_optimizer_steps(tmp_path):
    # 8 steps of 3 x 2 samples: accumulation counted once (it was counted twice before).
    batch = controller(tmp_path, batch_size=3, accumulation=2).settle(dataset_size=1000, max_steps_per_epoch=8)
    assert batch.samples_per_epoch == 48


def test_probed_batch_is_the_micro_batch(tmp_path):
    probe = ScriptedProbe(19)
    ctl = controller(tmp_path, accumulation=2, probe=ProbeOptions(use_maximum_batch_size=True))
    batch = ctl.settle(dataset_size=500, probe=probe)
    assert (batch.batch_size, batch.max_micro_batch_size) == (38, 19)
    (call,) = probe.calls
    assert call["dataset_size"] == 500 and call["options"].use_maximum_batch_size and call["output_dir"] == str(tmp_path)
    assert ctl.probe_report.batch_size == 19
    assert "use_maximum_batch_size: training with batch_size=19" in ctl.lines
    # The report is written once, by the controller, after the settling it adds to it.
    assert call["save_report"] is False
    assert json.loads((tmp_path / "batch_probe.json").read_text())["batch_size"] == 19


def test_a_global_batch_is_added_to_the_report_written_once(tmp_path, monkeypatch):
    from adaptive_batch.run import session as module

    writes = []
    monkeypatch.setattr(module, "save_probe_report", lambda report, *a, **k: writes.append(copy.deepcopy(report)))
    ctl = controller(tmp_path, global_batch=GlobalBatchOptions(global_batch_size=32), probe=ProbeOptions(use_maximum_batch_size=True))
    ctl.settle(dataset_size=500, probe=ScriptedProbe(12))
    assert len(writes) == 1 and writes[0].global_batch["per_rank"] == 32


def test_growth_without_bound_probes_and_bounds_by_the_rounded_maximum(tmp_path):
    growth = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch")
    ctl = controller(tmp_path, batch_size=4, growth=growth, probe=ProbeOptions(batch_size_rounding="power_of_two"))
    assert ctl.options.needs_probe
    batch = ctl.settle(dataset_size=500, probe=ScriptedProbe(19))
    assert (batch.batch_size, batch.max_micro_batch_size) == (4, 16)


def test_growth_start_over_the_probes_answer_is_clamped_and_over_max_batch_size_alone_refused(tmp_path):
    """Where nothing was measured the start trained max_batch_size, said as "the largest batch
    that fits", at an LR scaled down from the batch asked: refused, as without growth."""
    growth = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch")
    ctl = controller(tmp_path / "probed", batch_size=10, accumulation=2, growth=growth,
                     probe=ProbeOptions(use_maximum_batch_size=True, max_batch_size=64))
    batch = ctl.settle(dataset_size=500, probe=ScriptedProbe(8))
    assert (batch.batch_size, batch.max_micro_batch_size) == (8, 8)
    assert any("is over the largest batch that fits, 8: starting at 8" in line for line in ctl.lines)
    ctl = controller(tmp_path / "capped", batch_size=10, accumulation=2, growth=growth, probe=ProbeOptions(max_batch_size=8))
    assert not ctl.options.needs_probe
    with pytest.raises(ConfigError, match=r"batch_size=10 x gradient_accumulation_steps=2 is over max_batch_size=8, the "
                                          r"bound of growth: set batch_size to at most 8, raise max_batch_size, or set "
                                          r"grow_with_accumulation=True"):
        ctl.settle(dataset_size=500)


def test_growth_with_accumulation_keeps_the_start(tmp_path):
    growth = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch", grow_with_accumulation=True)
    batch = controller(tmp_path, batch_size=10, growth=growth, probe=ProbeOptions(max_batch_size=8)).settle(dataset_size=500)
    assert (batch.batch_size, batch.max_micro_batch_size, batch.grad_accum_steps) == (10, 8, 2)


def test_token_budget_from_the_probe(tmp_path):
    ctl = controller(tmp_path, seq_len=32, probe=ProbeOptions(use_maximum_batch_size=True), tokens=TokenBatchOptions(max_tokens=64))
    assert isinstance(ctl.mode, TokenBatches) and ctl.mode.uses_token_budget
    batch = ctl.settle(dataset_size=10, probe=ScriptedProbe(5), lengths=[20] * 10)
    assert ctl.probe_report.max_tokens == 160 == ctl.mode.max_tokens
    # the report on disk has the budget too, and a token batch runs whole unless it runs out
    assert '"max_tokens": 160' in (tmp_path / "batch_probe.json").read_text()
    assert batch.max_micro_batch_size == 10


def test_token_budget_checked_against_the_lengths(tmp_path):
    ctl = controller(tmp_path, tokens=TokenBatchOptions(max_tokens=64, long_sample_policy="error"))
    with pytest.raises(ConfigError, match="long_sample_policy"):
        ctl.settle(dataset_size=3, lengths=[10, 100, 10])
    with pytest.raises(ConfigError, match="needs every sample's length"):
        controller(tmp_path, tokens=TokenBatchOptions(max_tokens=64)).settle(dataset_size=3)


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i


def test_start_epoch_grows_and_clamps(tmp_path):
    growth = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch")
    ctl = controller(tmp_path, batch_size=4, growth=growth, probe=ProbeOptions(max_batch_size=12))
    ctl.settle(dataset_size=40)
    loader = StatefulDataLoader(Rows(), batch_sampler=ctl.batch_sampler(Rows(), shuffle=False))
    assert ctl.start_epoch(0, loader) == 10
    assert ctl.start_epoch(1, loader) == 5 and ctl.batch.batch_size == 8
    assert ctl.start_epoch(2, loader) == 4 and ctl.batch.batch_size == 12
    assert "Epoch 2: batch_size 8 -> 12 (clamped from 16 to 12, the largest micro-batch)." in ctl.lines
    assert [len(b) for b in loader] == [12, 12, 12, 4]


def test_start_epoch_names_a_failing_function(tmp_path):
    def fails(epoch, current_batch_size):
        raise RuntimeError("preempted")

    ctl = controller(tmp_path, growth=GrowthOptions(batch_increase_function=fails), probe=ProbeOptions(max_batch_size=8))
    ctl.settle(dataset_size=40)
    loader = StatefulDataLoader(Rows(), batch_sampler=ctl.batch_sampler(Rows(), shuffle=False))
    with pytest.raises(BatchIncreaseFunctionError, match="at epoch=0, current_batch_size=4 raised RuntimeError: preempted"):
        ctl.start_epoch(0, loader)


def _linear_step_parts():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def forward_backward(batch):
        tokens = batch["labels"].numel()
        loss = (model(batch["input_ids"].float()).squeeze(-1) - batch["labels"].float().sum(-1)).pow(2).mean() * tokens
        loss.backward()
        return loss.detach(), torch.tensor(tokens)

    return model, optimizer, forward_backward


def _batch(rows):
    return {"input_ids": torch.ones(rows, 4, dtype=torch.long), "labels": torch.zeros(rows, 4, dtype=torch.long)}


def test_a_step_in_micro_batches_with_the_lr_counted_in_samples_and_scaled(tmp_path):
    model, optimizer, forward_backward = _linear_step_parts()
    ctl = controller(tmp_path, batch_size=2, lr_scaling=LRScalingOptions(lr_scaling="linear"), probe=ProbeOptions(max_batch_size=2),
                     growth=GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch"))
    ctl.settle(dataset_size=16)
    # lambda: the schedule's LR halves every schedule step (one step = 2 samples)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    ctl.attach_lr(optimizer, scheduler, read_lr=lambda: optimizer.param_groups[0]["lr"])
    ctl.batch.batch_size = 4  # as growth would have set it
    lrs = []

    def optimizer_step(tokens):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()

    step = ctl.step(_batch(4), forward_backward=forward_backward, optimizer_step=optimizer_step, zero_grad=optimizer.zero_grad)
    assert step.accumulated.micro_batch_sizes == [2, 2] and step.global_samples == 4 and step.num_tokens == 16
    assert step.lr == lrs[0] == 2.0  # LR 1.0 at 0 samples, x 4/2 samples (linear)
    assert optimizer.param_groups[0]["lr"] == 2.0 and scheduler.get_last_lr() == [1.0]  # in force; schedule unscaled
    assert (step.global_step, ctl.global_step, ctl.batch.samples_seen) == (1, 1, 4)
    metrics = ctl.step_metrics(step, seconds=2.0)
    assert metrics["batch_size"] == 4 and metrics["micro_batch_size"] == 2 and metrics["grad_accum_steps"] == 2
    assert metrics["samples_seen"] == 4 and metrics["tokens_per_second_per_gpu"] == 8.0 and metrics["padding_fraction"] == 0.0
    second = ctl.step(_batch(4), forward_backward=forward_backward, optimizer_step=optimizer_step, zero_grad=optimizer.zero_grad)
    assert second.lr == lrs[1] == 0.5  # 4 samples = 2 schedule steps: 0.25, x 4/2


def test_a_tuple_batch_steps_in_micro_batches_with_no_padding_counted(tmp_path):
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    seen = []

    def forward_backward(batch):  # a TensorDataset's (inputs, targets)
        inputs, targets = batch
        seen.append(inputs.shape[0])
        loss = torch.nn.functional.mse_loss(model(inputs), targets, reduction="sum")
        loss.backward()
        return loss.detach(), torch.tensor(inputs.shape[0])

    ctl = controller(tmp_path, batch_size=3, accumulation=2)
    ctl.settle(dataset_size=12)
    step = ctl.step((torch.randn(6, 4), torch.randn(6, 1)), forward_backward=forward_backward,
                    optimizer_step=lambda tokens: optimizer.step(), zero_grad=optimizer.zero_grad)
    assert seen == [3, 3] and step.global_samples == 6 and step.num_tokens == 6
    metrics = ctl.step_metrics(step, seconds=1.0)
    assert metrics["batch_size"] == 6 and metrics["grad_accum_steps"] == 2 and "padding_fraction" not in metrics


def test_token_batches_step_the_scheduler(tmp_path):
    model, optimizer, forward_backward = _linear_step_parts()
    ctl = controller(tmp_path, tokens=TokenBatchOptions(max_tokens=64))
    ctl.settle(dataset_size=4, lengths=[4] * 4)
    assert ctl.lr_schedule_steps(epochs=3, num_batches=5) == 15 and ctl.lr_last_epoch() == -1
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    ctl.attach_lr(optimizer, scheduler, read_lr=lambda: optimizer.param_groups[0]["lr"])
    step = ctl.step(_batch(4), forward_backward=forward_backward, optimizer_step=lambda tokens: optimizer.step(),
                    zero_grad=optimizer.zero_grad)
    assert step.lr == 1.0
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_non_lambda_scheduler_is_refused(tmp_path):
    _, optimizer, _ = _linear_step_parts()
    ctl = controller(tmp_path)
    ctl.settle(dataset_size=8)
    with pytest.raises(ConfigError, match="lr_scheduler: StepLR is not a LambdaLR"):
        ctl.attach_lr(optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1), read_lr=lambda: 0.0)


def test_a_probe_result_this_version_cannot_read_is_refused_in_one_line(tmp_path):
    state = {PROBE_STATE_KEY: {"format": 99, "max_batch_size": 4}}
    with pytest.raises(ConfigError, match="the recipe state's 'batch_probe' does not read .*format=99.*newer adaptive-batch"):
        controller(tmp_path).load_state_dict(state)


def test_state_round_trip_skips_the_probe(tmp_path):
    growth = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch")
    first = controller(tmp_path, growth=growth)
    first.settle(dataset_size=40, probe=ScriptedProbe(12))
    first.batch.batch_size, first.batch.samples_seen, first.batch.global_step = 8, 24, 5
    state = first.state_dict()
    assert set(state) == {BATCH_STATE_KEY, PROBE_STATE_KEY}

    resumed = controller(tmp_path, growth=growth)
    resumed.load_state_dict({**state, "epochs_run": 2})
    probe = ScriptedProbe(99)
    batch = resumed.settle(dataset_size=40, probe=probe)
    assert probe.calls == [] and resumed.probe_report.max_batch_size == 12
    assert (batch.batch_size, batch.samples_seen, resumed.global_step, batch.max_micro_batch_size) == (8, 24, 5, 12)
    assert math.isclose(resumed.lr_schedule_steps(1, 10), 40 / 4)


def test_growth_by_samples_after_the_step_that_crossed_each_boundary(tmp_path):
    calls = []

    def add_two(k, current_batch_size):
        calls.append((k, current_batch_size))
        return 2 if k > 0 else 0

    growth = GrowthOptions(batch_increase_function=add_two, batch_increase_interval="5 samples")
    ctl = controller(tmp_path, batch_size=4, growth=growth, probe=ProbeOptions(max_batch_size=9))
    ctl.settle(dataset_size=40)
    loader = StatefulDataLoader(Rows(), batch_sampler=ctl.batch_sampler(Rows(), shuffle=False), collate_fn=list)
    model, optimizer, forward_backward = _linear_step_parts()
    ctl.attach_lr(optimizer, None, read_lr=lambda: 0.0)
    assert ctl.start_epoch(0, loader) == 10 and calls == [(0, 4)]
    sizes, intervals = [], []
    for indices in loader:
        step = ctl.step(_batch(len(indices)), forward_backward=forward_backward, optimizer_step=lambda tokens: None,
                        zero_grad=optimizer.zero_grad)
        sizes.append(len(indices))
        intervals.append(ctl.step_metrics(step, seconds=1.0)["growth_interval"])
    # 4 (4 seen) | 4 (8: boundary 1) | 6 (14: 2) | 8 (22: 3, 4) | 9, clamped (31: 5, 6) | 9 (40: 7, 8)
    assert sizes == [4, 4, 6, 8, 9, 9]
    assert intervals == [0, 0, 1, 2, 4, 6]
    assert [k for k, _ in calls] == list(range(9))
    assert ctl.lines[1:] == [
        "Interval 1 (5 samples) at step 2: batch_size 4 -> 6.",
        "Interval 2 (10 samples) at step 3: batch_size 6 -> 8.",
        "Interval 3 (15 samples) at step 4: batch_size 8 -> 9 (clamped from 10 to 9, the largest micro-batch).",
    ]  # held at the bound afterwards: no line a boundary


def test_growth_by_tokens_counts_the_tokens_that_carry_a_loss(tmp_path):
    growth = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch", batch_increase_interval="40 tokens")
    ctl = controller(tmp_path, batch_size=2, growth=growth, probe=ProbeOptions(max_batch_size=16))
    ctl.settle(dataset_size=40)
    loader = StatefulDataLoader(Rows(), batch_sampler=ctl.batch_sampler(Rows(), shuffle=False), collate_fn=list)
    model, optimizer, forward_backward = _linear_step_parts()
    ctl.attach_lr(optimizer, None, read_lr=lambda: 0.0)
    ctl.start_epoch(0, loader)
    sizes = []
    for indices in loader:
        ctl.step(_batch(len(indices)), forward_backward=forward_backward, optimizer_step=lambda tokens: None,
                 zero_grad=optimizer.zero_grad)
        sizes.append(len(indices))
    # 4 tokens a sample: 8 a step at 2 (40 tokens after 5 steps), then 4 a step, 8, 16
    assert sizes[:8] == [2, 2, 2, 2, 2, 4, 4, 4] and ctl.batch.tokens_seen == 160


@pytest.mark.parametrize("device, probing, expected", [("cuda", True, 1), ("cuda", False, 0), ("cpu", True, 0)])
def test_expandable_segments_before_probing_on_cuda(tmp_path, monkeypatch, device, probing, expected):
    """The probed batch failed its second CUDA step on fixed segments (H200, 152K vocabulary)."""
    calls = []
    monkeypatch.setattr("adaptive_batch.memory.device.use_expandable_segments", lambda **kw: calls.append(kw))
    monkeypatch.setattr(
        "adaptive_batch.run.options.device_capacity", lambda d: DeviceCapacity(device=str(d), headroom_bytes=2**30, source="test", hard_limit=True)
    )
    AdaptiveBatchController(
        AdaptiveBatchOptions(probe=ProbeOptions(use_maximum_batch_size=probing)),
        batch_size=1, input_key="tokens", device=torch.device(device), output_dir=str(tmp_path), max_seq_len=8,
    )
    assert len(calls) == expected


def test_a_probe_trial_runs_two_micro_batches_where_a_training_step_may_run_several(tmp_path):
    """A step of several micro-batches keeps the first one's gradients through the next forward;
    a trial of one micro-batch under-measured it by up to a copy of the trainable gradients."""
    assert controller(tmp_path).probe_micro_batches(8) == 1
    assert controller(tmp_path, accumulation=2).probe_micro_batches(8) == 2
    growth = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch", grow_with_accumulation=True)
    assert controller(tmp_path, growth=growth).probe_micro_batches(8) == 2
    fixed_global = controller(tmp_path, global_batch=GlobalBatchOptions(global_batch_size=16))
    assert [fixed_global.probe_micro_batches(b) for b in (8, 15, 16, 32)] == [2, 2, 1, 1]
