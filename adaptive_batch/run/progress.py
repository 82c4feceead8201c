"""The batch as it changes during training, and the run's progress: the session's one state.

:class:`BatchProgress` holds the global batch (samples per optimizer step), the largest
micro-batch that fits, and the run's progress in samples, tokens, steps and growth boundaries.
It goes into the recipe state under :data:`BATCH_STATE_KEY`, so a resumed run continues with the
same batch sizes and the same learning rates.
"""

import math
from typing import Any, Dict, Optional

from adaptive_batch.schedule.growth import BatchIncreaseFunction, GrowthDecision, GrowthStatistics, grow_batch_size
from adaptive_batch.schedule.interval import GrowthInterval

BATCH_STATE_KEY = "adaptive_batch_state"


class BatchProgress:
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
