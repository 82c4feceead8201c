"""The batch as it changes and the run's progress: the split, growth's bound, counting, state."""

import pytest

from adaptive_batch import double_every_epoch, linear_ramp
from adaptive_batch.run.progress import BatchProgress


def test_split_of_the_global_batch():
    state = BatchProgress(batch_size=10, max_micro_batch_size=4, grow_with_accumulation=True, samples_per_epoch=100)
    assert (state.grad_accum_steps, state.micro_batch_size) == (3, 4)
    state = BatchProgress(batch_size=8, max_micro_batch_size=8, grow_with_accumulation=False, samples_per_epoch=100)
    assert (state.grad_accum_steps, state.micro_batch_size) == (1, 8)


def test_growth_stops_at_the_memory_maximum_unless_accumulating():
    clamp = BatchProgress(batch_size=4, max_micro_batch_size=12, grow_with_accumulation=False, samples_per_epoch=100)
    accumulate = BatchProgress(batch_size=4, max_micro_batch_size=12, grow_with_accumulation=True, samples_per_epoch=100)
    sizes = {"clamp": [], "accumulate": []}
    for epoch in range(5):
        for name, state in (("clamp", clamp), ("accumulate", accumulate)):
            state.start_epoch(double_every_epoch, epoch=epoch)
            sizes[name].append((state.batch_size, state.grad_accum_steps))
    assert sizes["clamp"] == [(4, 1), (8, 1), (12, 1), (12, 1), (12, 1)]
    # past 12 by accumulation, and never past an epoch's samples
    assert sizes["accumulate"] == [(4, 1), (8, 1), (16, 2), (32, 3), (64, 6)]
    accumulate.start_epoch(double_every_epoch, epoch=5)
    assert accumulate.batch_size == 100
    assert clamp.start_epoch(None, epoch=5) is None


def test_record_step_counts_and_keeps_a_lowered_limit():
    state = BatchProgress(batch_size=8, max_micro_batch_size=8, grow_with_accumulation=False, samples_per_epoch=64)
    state.record_step(samples=8, micro_batch_limit=8, oom_retries=0)
    state.record_step(samples=8, micro_batch_limit=4, oom_retries=1)
    assert (state.samples_seen, state.global_step, state.oom_retries) == (16, 2, 1)
    assert state.max_micro_batch_size == 4 and state.grad_accum_steps == 2
    # growth is bounded by the lowered limit now
    state.start_epoch(linear_ramp(4), epoch=1)
    assert state.batch_size == 8


def test_state_round_trip():
    state = BatchProgress(batch_size=4, max_micro_batch_size=6, grow_with_accumulation=True, samples_per_epoch=64)
    state.start_epoch(double_every_epoch, epoch=1)
    state.record_step(samples=8, micro_batch_limit=3, oom_retries=1)
    copy = BatchProgress(batch_size=1, max_micro_batch_size=1, grow_with_accumulation=True, samples_per_epoch=1)
    copy.load_state_dict(state.state_dict())
    assert copy.state_dict() == state.state_dict()
    assert copy.initial_batch_size == 4 and copy.batch_size == 8 and copy.samples_per_epoch == 64


def test_bad_sizes():
    with pytest.raises(ValueError, match="must be at least 1"):
        BatchProgress(batch_size=0, max_micro_batch_size=4, grow_with_accumulation=False, samples_per_epoch=8)


def test_batch_state_counts_global_progress_and_boundaries():
    from adaptive_batch.schedule.interval import GrowthInterval

    state = BatchProgress(batch_size=4, max_micro_batch_size=8, grow_with_accumulation=False, samples_per_epoch=100)
    every = GrowthInterval("samples", 6)
    assert list(state.pending_boundaries(every)) == [0]
    state.grow_at(double_every_epoch, 0)
    state.record_step(samples=4, global_samples=8, tokens=300, micro_batch_limit=8, oom_retries=0)
    state.record_step(samples=4, global_samples=8, tokens=300, micro_batch_limit=8, oom_retries=0)
    # 16 samples over all ranks: boundaries 1 and 2 (6 and 12) were crossed, in order
    assert list(state.pending_boundaries(every)) == [1, 2]
    assert [state.grow_at(double_every_epoch, k).batch_size for k in (1, 2)] == [8, 8]  # clamped to 8
    assert list(state.pending_boundaries(every)) == [] and state.intervals_done == 3
    assert (state.samples_seen, state.global_samples_seen, state.tokens_seen) == (8, 16, 600)
    # an epoch already in progress (a resumed run) keeps its steps; a new one starts at zero
    assert state.enter_epoch(0) and (state.epoch_steps, state.epoch_samples) == (0, 0)
    state.record_step(samples=4, micro_batch_limit=8, oom_retries=0)
    assert not state.enter_epoch(0) and state.epoch_steps == 1
    copy = BatchProgress(batch_size=1, max_micro_batch_size=1, grow_with_accumulation=False, samples_per_epoch=1)
    copy.load_state_dict(state.state_dict())
    assert copy.state_dict() == state.state_dict()
    # per-epoch growth is not called twice for an epoch (a run resumed inside it)
    assert copy.start_epoch(double_every_epoch, epoch=2) is None
