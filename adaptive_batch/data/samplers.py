"""Batch samplers: one that follows a batch size changing during training, one whose batch sizes
a plan decides as it cuts them, one that splits each batch of another into the micro-batches
that fit.

:class:`ResizableBatchSampler` yields an epoch's indices in batches of whatever size it is set
to (the run's :class:`~adaptive_batch.run.progress.BatchProgress` decides it), and resumes in
the middle of an epoch whatever sizes the batches before had. :class:`MicroBatchSampler` yields
each batch of a framework's own batch sampler as the fewest micro-batches no larger than a limit.
"""

import itertools
import math
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sized

from torch.utils.data import Sampler

from adaptive_batch.schedule.global_batch import micro_batch_sizes


class ResizableBatchSampler(Sampler[List[int]]):
    """Batches of ``batch_size`` indices from ``sampler``, at most ``samples_per_epoch`` of
    them an epoch; the last batch of an epoch may be smaller, so no sample is dropped.

    ``batch_size`` may change at any time: the next batch takes the new size. ``set_epoch`` is
    passed to the sampler. The state (how many samples of the epoch were handed out, and the
    sampler's own state) lets a dataloader resume in the middle of an epoch, whatever sizes
    the batches before had.

    Raises:
        ValueError: for a batch size or epoch size under 1.
    """

    def __init__(self, sampler: Sized, batch_size: int, samples_per_epoch: Optional[int] = None) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        available = len(sampler)
        self.samples_per_epoch = available if samples_per_epoch is None else min(samples_per_epoch, available)
        if self.samples_per_epoch < 1:
            raise ValueError(f"samples_per_epoch={samples_per_epoch} leaves no samples in an epoch.")
        self._taken = 0
        self._resume_at = 0

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batch_size={value!r} must be a positive int.")
        self._batch_size = value

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil((self.samples_per_epoch - self._resume_at) / self.batch_size)

    def __iter__(self) -> Iterator[List[int]]:
        # Not a generator: a resumed position is taken up when the epoch's iterator is made, so
        # an epoch resumed at its end, of which no batch is drawn, leaves nothing for the next.
        start, self._resume_at = self._resume_at, 0
        self._taken = start
        indices = iter(self.sampler)
        if start:
            # A stateful sampler takes up its own resumed position at its first draw: draw now.
            first = next(indices, None)
            indices = itertools.chain([] if first is None else [first], indices)
        return self._batches(indices)

    def _batches(self, indices: Iterator[int]) -> Iterator[List[int]]:
        batch: List[int] = []
        while self._taken < self.samples_per_epoch:
            index = next(indices, None)
            if index is None:
                break
            batch.append(int(index))
            self._taken += 1
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def state_dict(self) -> Dict[str, Any]:
        """How many samples of the epoch were handed out, and the sampler's state."""
        inner = self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None
        return {"taken": self._taken, "sampler": inner}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues after the samples handed out before ``state`` was taken.

        Raises:
            ValueError: for a sampler without state, which cannot skip what it handed out.
        """
        if state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])
        elif state["taken"]:
            raise ValueError("a mid-epoch batch-sampler state needs a stateful sampler to resume from.")
        self._resume_at = self._taken = int(state["taken"])


class BatchPlan(Protocol):
    """Decides each batch's size as a loader cuts it (:class:`~adaptive_batch.run.framework_growth.FrameworkGrowth`)."""

    def next_batch_size(self) -> int:
        """The size the next batch is cut at."""

    def cut_batch(self, rows: int) -> None:
        """Takes a batch of ``rows`` samples as cut (the next size may change)."""

    def batches_in_epoch(self, samples: int, drop_last: bool) -> int:
        """The batches an epoch of ``samples`` takes from where the plan stands, without cutting
        them."""


class PlannedBatchSampler(Sampler[List[int]]):
    """Batches of ``sampler``'s indices (its order, shuffling and grouping kept), each of the size
    ``plan`` has in force when the batch is cut, told to ``plan`` before it is handed out (a loader
    draws ahead of training, so the plan, not the training step, counts the batches). The last
    batch of an epoch may be smaller, unless ``drop_last``. Its length is the plan's, simulated
    from where the plan stands, so it is read before the epoch's batches are cut.
    """

    def __init__(self, sampler: Sized, plan: BatchPlan, drop_last: bool = False) -> None:
        self.sampler, self.plan, self.drop_last = sampler, plan, drop_last

    @property
    def batch_size(self) -> int:
        """The size of the next batch (what a loader's users read as its batch)."""
        return self.plan.next_batch_size()

    def set_epoch(self, epoch: int) -> None:
        """Passed to the sampler (its shuffle of the epoch)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.plan.batches_in_epoch(len(self.sampler), self.drop_last)

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for index in self.sampler:
            batch.append(int(index))
            if len(batch) == self.plan.next_batch_size():
                self.plan.cut_batch(len(batch))
                yield batch
                batch = []
        if batch and not self.drop_last:
            self.plan.cut_batch(len(batch))
            yield batch


class MicroBatchSampler(Sampler[List[int]]):
    """Each batch of ``batch_sampler`` (its order, shuffling and grouping kept) as the fewest
    micro-batches of at most ``limit`` indices, sizes differing by at most one
    (:func:`~adaptive_batch.schedule.global_batch.micro_batch_sizes`): 64 with 7 fitting trains as
    4 x 7 + 6 x 6, where equal micro-batches would take 16 x 4.

    Args:
        batch_sampler: yields the effective batches (``batch_size`` indices, the last of an
            epoch smaller unless it drops it), e.g. a ``DataLoader``'s.
        limit: the largest micro-batch.

    Raises:
        ValueError: for a limit under 1, or a batch sampler without ``batch_size`` and ``sampler``.
    """

    def __init__(self, batch_sampler: Any, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit} must be at least 1.")
        if getattr(batch_sampler, "batch_size", None) is None or not hasattr(batch_sampler, "sampler"):
            raise ValueError(f"{type(batch_sampler).__name__} has no batch_size and sampler to split.")
        self.batch_sampler = batch_sampler
        self.batch_size = limit  # what a DataLoader's users read as its batch
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    @property
    def sampler(self) -> Any:
        """The wrapped batch sampler's sampler (where a loader looks for ``set_epoch``)."""
        return self.batch_sampler.sampler

    @sampler.setter
    def sampler(self, value: Any) -> None:
        self.batch_sampler.sampler = value

    def set_epoch(self, epoch: int) -> None:
        for inner in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if hasattr(inner, "set_epoch"):
                inner.set_epoch(epoch)
                return

    def micro_batches_per_batch(self, rows: int) -> int:
        return len(micro_batch_sizes(rows, self.batch_size))

    def __len__(self) -> int:
        whole, rest = divmod(len(self.batch_sampler.sampler), self.batch_sampler.batch_size)
        last = self.micro_batches_per_batch(rest) if rest and not self.drop_last else 0
        return whole * self.micro_batches_per_batch(self.batch_sampler.batch_size) + last

    def __iter__(self) -> Iterator[List[int]]:
        for batch in self.batch_sampler:
            start = 0
            for size in micro_batch_sizes(len(batch), self.batch_size):
                yield list(batch[start:start + size])
                start += size
