import itertools

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from torch.utils.data import BatchSampler, DataLoader

from adaptive_batch.data.samplers import MicroBatchSampler, PlannedBatchSampler, ResizableBatchSampler


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




@pytest.mark.parametrize("drop_last", [False, True])
def test_micro_batches_split_each_batch_in_order_into_the_fewest_that_fit(drop_last):
    """64 with 7 fitting trains as 4 x 7 + 6 x 6 (equal micro-batches would take 16 x 4); the
    wrapped sampler's order, epochs and last batch are kept, and the loader's length is right."""
    inner = StatefulDistributedSampler(Data(150), num_replicas=1, rank=0, shuffle=True, seed=0)
    batches = BatchSampler(inner, 64, drop_last)
    micro = MicroBatchSampler(batches, 7)
    loader = DataLoader(Data(150), batch_sampler=micro, collate_fn=list)
    micro.set_epoch(1)
    pieces = list(loader)
    inner.set_epoch(1)
    whole = list(batches)
    assert len(loader) == len(pieces)
    assert [i for p in pieces for i in p] == [i for b in whole for i in b]  # the same samples, in order
    assert [len(p) for p in pieces[:10]] == [7] * 4 + [6] * 6
    # the last batch of 22: 4 micro-batches (6, 6, 5, 5), or dropped with the wrapped sampler's drop_last
    assert [len(p) for p in pieces[20:]] == ([] if drop_last else [6, 6, 5, 5])
    micro.set_epoch(2)
    assert list(loader) != pieces  # set_epoch reaches the shuffling sampler
    assert micro.sampler is inner  # where an older Accelerate looks for set_epoch
    with pytest.raises(ValueError, match="limit=0"):
        MicroBatchSampler(batches, 0)


class _Plan:
    """Doubles the batch after every 2 batches cut (a stand-in for FrameworkGrowth's plan)."""

    def __init__(self):
        self.size, self.cut = 2, []

    def next_batch_size(self):
        return self.size

    def cut_batch(self, rows):
        self.cut.append(rows)
        if len(self.cut) % 2 == 0:
            self.size *= 2

    def batches_in_epoch(self, samples, drop_last):
        return 99  # what the loader reads as the epoch's length


@pytest.mark.parametrize("drop_last", [False, True])
def test_planned_batches_take_the_size_in_force_when_cut_and_tell_the_plan_first(drop_last):
    plan = _Plan()
    sampler = PlannedBatchSampler(range(15), plan, drop_last=drop_last)
    batches = iter(sampler)
    assert next(batches) == [0, 1] and plan.cut == [2]  # told before it is handed out
    rest = list(batches)
    assert rest == [[2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] + ([] if drop_last else [[12, 13, 14]])
    assert len(sampler) == 99
