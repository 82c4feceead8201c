import itertools

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from adaptive_batch import double_every_epoch, linear_ramp
from adaptive_batch.data.samplers import BatchState
from adaptive_batch.data.samplers import ResizableBatchSampler


def test_split_of_the_global_batch():
    state = BatchState(batch_size=10, max_micro_batch_size=4, grow_with_accumulation=True, samples_per_epoch=100)
    assert (state.grad_accum_steps, state.micro_batch_size) == (3, 4)
    state = BatchState(batch_size=8, max_micro_batch_size=8, grow_with_accumulation=False, samples_per_epoch=100)
    assert (state.grad_accum_steps, state.micro_batch_size) == (1, 8)


def test_growth_stops_at_the_memory_maximum_unless_accumulating():
    clamp = BatchState(batch_size=4, max_micro_batch_size=12, grow_with_accumulation=False, samples_per_epoch=100)
    accumulate = BatchState(batch_size=4, max_micro_batch_size=12, grow_with_accumulation=True, samples_per_epoch=100)
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
    state = BatchState(batch_size=8, max_micro_batch_size=8, grow_with_accumulation=False, samples_per_epoch=64)
    state.record_step(samples=8, micro_batch_limit=8, oom_retries=0)
    state.record_step(samples=8, micro_batch_limit=4, oom_retries=1)
    assert (state.samples_seen, state.global_step, state.oom_retries) == (16, 2, 1)
    assert state.max_micro_batch_size == 4 and state.grad_accum_steps == 2
    # growth is bounded by the lowered limit now
    state.start_epoch(linear_ramp(4), epoch=1)
    assert state.batch_size == 8


def test_state_round_trip():
    state = BatchState(batch_size=4, max_micro_batch_size=6, grow_with_accumulation=True, samples_per_epoch=64)
    state.start_epoch(double_every_epoch, epoch=1)
    state.record_step(samples=8, micro_batch_limit=3, oom_retries=1)
    copy = BatchState(batch_size=1, max_micro_batch_size=1, grow_with_accumulation=True, samples_per_epoch=1)
    copy.load_state_dict(state.state_dict())
    assert copy.state_dict() == state.state_dict()
    assert copy.initial_batch_size == 4 and copy.batch_size == 8 and copy.samples_per_epoch == 64


def test_bad_sizes():
    with pytest.raises(ValueError, match="must be at least 1"):
        BatchState(batch_size=0, max_micro_batch_size=4, grow_with_accumulation=False, samples_per_epoch=8)


class Data:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def test_sampler_covers_every_sample_once_and_resizes_between_epochs():
    sampler = ResizableBatchSampler(StatefulDistributedSampler(Data(23), num_replicas=1, rank=0, shuffle=True, seed=0), 5)
    loader = StatefulDataLoader(Data(23), batch_sampler=sampler, collate_fn=list)
    sampler.set_epoch(0)
    batches = list(loader)
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3] and len(loader) == 5
    assert sorted(i for b in batches for i in b) == list(range(23))
    sampler.batch_size = 10
    sampler.set_epoch(1)
    batches1 = list(loader)
    assert [len(b) for b in batches1] == [10, 10, 3]
    assert batches1[0] != batches[0] + batches[1]  # a new epoch's order
    sampler.set_epoch(1)
    assert list(loader) == batches1  # seeded: the same epoch gives the same order


def test_sampler_stops_at_samples_per_epoch():
    sampler = ResizableBatchSampler(
        StatefulDistributedSampler(Data(100), num_replicas=1, rank=0, shuffle=False), 8, samples_per_epoch=20
    )
    assert [len(b) for b in sampler] == [8, 8, 4] and len(sampler) == 3
    sampler.batch_size = 20
    assert list(sampler) == [list(range(20))]
    with pytest.raises(ValueError, match="must be a positive int"):
        sampler.batch_size = 0


def _loader(n=23, batch_size=3, samples_per_epoch=None):
    sampler = ResizableBatchSampler(
        StatefulDistributedSampler(Data(n), num_replicas=1, rank=0, shuffle=True, seed=0), batch_size, samples_per_epoch
    )
    sampler.set_epoch(2)
    return sampler, StatefulDataLoader(Data(n), batch_sampler=sampler, collate_fn=list)


def test_a_resumed_sampler_continues_mid_epoch_after_the_batch_grew():
    sampler, loader = _loader(samples_per_epoch=21)
    whole, state = [], None
    for i, batch in enumerate(loader):
        whole.append(batch)
        if i == 1:
            sampler.batch_size = 5  # growth after the second step
        if i == 2:
            state = loader.state_dict()  # a step checkpoint after the third step
    assert [len(b) for b in whole] == [3, 3, 5, 5, 5]
    sampler2, loader2 = _loader(samples_per_epoch=21)  # a new process: configured batch, epoch 2
    sampler2.batch_size = 5  # the batch state's batch
    loader2.load_state_dict(state)
    assert list(loader2) == whole[3:]
    assert state["_index_sampler_state"]["taken"] == 11


@pytest.mark.parametrize("samples_per_epoch", [None, 12], ids=["whole_dataset", "capped_epoch"])
def test_an_epoch_resumed_at_its_end_leaves_the_next_epoch_whole(samples_per_epoch):
    # A step checkpoint on an epoch's last step: the resume draws no batch of that epoch
    # (islice(loader, 0), as the loop does), and the next epoch must still be whole.
    sampler, loader = _loader(n=12, batch_size=4, samples_per_epoch=samples_per_epoch)
    assert len(list(loader)) == 3
    state = loader.state_dict()
    sampler2, loader2 = _loader(n=12, batch_size=4, samples_per_epoch=samples_per_epoch)
    loader2.load_state_dict(state)
    assert list(itertools.islice(loader2, 0)) == []
    sampler2.set_epoch(3)
    fresh, fresh_loader = _loader(n=12, batch_size=4, samples_per_epoch=samples_per_epoch)
    fresh.set_epoch(3)
    assert list(loader2) == list(fresh_loader) and len(list(fresh_loader)) == 3


def test_batch_state_counts_global_progress_and_boundaries():
    from adaptive_batch.schedule.interval import GrowthInterval

    state = BatchState(batch_size=4, max_micro_batch_size=8, grow_with_accumulation=False, samples_per_epoch=100)
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
    copy = BatchState(batch_size=1, max_micro_batch_size=1, grow_with_accumulation=False, samples_per_epoch=1)
    copy.load_state_dict(state.state_dict())
    assert copy.state_dict() == state.state_dict()
    # per-epoch growth is not called twice for an epoch (a run resumed inside it)
    assert copy.start_epoch(double_every_epoch, epoch=2) is None
