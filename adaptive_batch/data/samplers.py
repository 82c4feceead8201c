"""The batch size as it changes during training, and the sampler that follows it.

:class:`BatchState` holds the global batch (samples per optimizer step), the largest
micro-batch that fits, and the run's progress in samples and steps. It goes into the recipe
state under :data:`BATCH_STATE_KEY`, so a resumed run continues with the same batch sizes and
the same learning rates. :class:`ResizableBatchSampler` yields an epoch's indices in batches
of whatever size the state says at the start of the epoch.
"""

import itertools
import math
from typing import Any, Dict, Iterator, List, Optional, Sized

from torch.utils.data import Sampler

from adaptive_batch.schedule.growth import BatchIncreaseFunction, GrowthDecision, GrowthStatistics, grow_batch_size
from adaptive_batch.schedule.interval import GrowthInterval

BATCH_STATE_KEY = "adaptive_batch_state"


class BatchState:
    """The global batch, its split into micro-batches, and training progress.

    Args:
        batch_size: the global batch to start with (samples per optimizer step).
        max_micro_batch_size: the most samples one forward/backward may hold (the probed
            maximum, or the configured micro-batch); lowered after an out-of-memory error.
        grow_with_accumulation: let growth pass ``max_micro_batch_size`` by accumulating
            gradients over several micro-batches; when ``False`` growth stops at it.
        samples_per_epoch: the samples one epoch trains on; the LR schedule's length and the
            bound for growth through accumulation.

    Raises:
        ValueError: for sizes under 1.
    """

    def __init__(
        self, *, batch_size: int, max_micro_batch_size: int, grow_with_accumulation: bool, samples_per_epoch: int
    ) -> None:
        if min(batch_size, max_micro_batch_size, samples_per_epoch) < 1:
            raise ValueError(
                f"batch_size={batch_size}, max_micro_batch_size={max_micro_batch_size} and "
                f"samples_per_epoch={samples_per_epoch} must be at least 1."
            )
        self.batch_size = batch_size
        # The batch the run started with: the unit of the LR schedule's steps.
        self.initial_batch_size = batch_size
        self.max_micro_batch_size = max_micro_batch_size
        self.grow_with_accumulation = grow_with_accumulation
        self.samples_per_epoch = samples_per_epoch
        self.samples_seen = 0
        self.global_step = 0
        self.oom_retries = 0
        # All ranks' samples and loss-carrying tokens: what growth intervals count.
        self.global_samples_seen = 0
        self.tokens_seen = 0
        # Growth boundaries already applied: none is applied twice, even across a resume.
        self.intervals_done = 0
        # The epoch in progress and how far into it: a mid-epoch checkpoint resumes there.
        self.epoch = -1
        self.epoch_steps = 0
        self.epoch_samples = 0

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step for a full global batch."""
        return math.ceil(self.batch_size / self.max_micro_batch_size)

    @property
    def micro_batch_size(self) -> int:
        """The largest micro-batch of a full global batch."""
        return math.ceil(self.batch_size / self.grad_accum_steps)

    def growth_bound(self) -> int:
        """The largest global batch growth may reach: an epoch's samples with accumulation,
        else the largest micro-batch that fits."""
        if self.grow_with_accumulation:
            return self.samples_per_epoch
        return min(self.max_micro_batch_size, self.samples_per_epoch)

    def enter_epoch(self, epoch: int) -> bool:
        """Marks ``epoch`` as in progress; returns ``False`` when it already was (a run resumed
        from a mid-epoch checkpoint), whose steps so far are kept."""
        if epoch == self.epoch:
            return False
        self.epoch, self.epoch_steps, self.epoch_samples = epoch, 0, 0
        return True

    def start_epoch(self, fn: Optional[BatchIncreaseFunction], *, epoch: int) -> Optional[GrowthDecision]:
        """Applies the batch increase function for ``epoch``; ``None`` when there is none, or
        when the epoch's call was already made (a run resumed inside the epoch).

        Raises:
            BatchIncreaseFunctionError: if the function fails or returns a bad increment.
        """
        if fn is None or epoch < self.intervals_done:
            return None
        return self.grow_at(fn, epoch, label="epoch")

    def pending_boundaries(self, interval: GrowthInterval) -> range:
        """The boundaries of a steps, samples or tokens interval reached and not yet applied."""
        reached = interval.index(
            steps=self.global_step, samples=self.global_samples_seen, tokens=self.tokens_seen
        )
        return range(self.intervals_done, reached + 1)

    def grow_at(
        self, fn: BatchIncreaseFunction, k: int, *, label: str = "interval", stats: Optional[GrowthStatistics] = None
    ) -> GrowthDecision:
        """Applies the batch increase function at boundary ``k`` (``stats`` for one that takes them).

        Raises:
            BatchIncreaseFunctionError: if the function fails or returns a bad increment.
        """
        decision = grow_batch_size(
            fn, epoch=k, current_batch_size=self.batch_size, bound=self.growth_bound(), label=label, stats=stats
        )
        self.batch_size = decision.batch_size
        self.intervals_done = k + 1
        return decision

    def record_step(
        self,
        *,
        samples: int,
        micro_batch_limit: int,
        oom_retries: int,
        global_samples: Optional[int] = None,
        tokens: int = 0,
    ) -> None:
        """Counts an optimizer step and keeps a limit lowered by an out-of-memory retry.

        Args:
            samples: this rank's samples.
            micro_batch_limit: the micro-batch limit the step ended with.
            oom_retries: restarts the step needed.
            global_samples: all ranks' samples (``samples`` when ``None``).
            tokens: all ranks' loss-carrying tokens.
        """
        self.samples_seen += samples
        self.global_samples_seen += samples if global_samples is None else global_samples
        self.tokens_seen += int(tokens)
        self.global_step += 1
        self.epoch_steps += 1
        self.epoch_samples += samples
        self.oom_retries += oom_retries
        self.max_micro_batch_size = min(self.max_micro_batch_size, micro_batch_limit)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "initial_batch_size": self.initial_batch_size,
            "samples_per_epoch": self.samples_per_epoch,
            "max_micro_batch_size": self.max_micro_batch_size,
            "grow_with_accumulation": self.grow_with_accumulation,
            "samples_seen": self.samples_seen,
            "global_step": self.global_step,
            "oom_retries": self.oom_retries,
            "global_samples_seen": self.global_samples_seen,
            "tokens_seen": self.tokens_seen,
            "intervals_done": self.intervals_done,
            "epoch": self.epoch,
            "epoch_steps": self.epoch_steps,
            "epoch_samples": self.epoch_samples,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a saved state; the accumulation choice comes from the config, not the file."""
        self.batch_size = int(state["batch_size"])
        self.initial_batch_size = int(state["initial_batch_size"])
        self.samples_per_epoch = int(state["samples_per_epoch"])
        self.max_micro_batch_size = int(state["max_micro_batch_size"])
        self.samples_seen = int(state["samples_seen"])
        self.global_step = int(state["global_step"])
        self.oom_retries = int(state.get("oom_retries", 0))
        # States written before growth intervals and mid-epoch checkpoints lack these.
        self.global_samples_seen = int(state.get("global_samples_seen", self.samples_seen))
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.intervals_done = int(state.get("intervals_done", 0))
        self.epoch = int(state.get("epoch", -1))
        self.epoch_steps = int(state.get("epoch_steps", 0))
        self.epoch_samples = int(state.get("epoch_samples", 0))


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
