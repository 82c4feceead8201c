"""Growth of the Trainer's effective batch (at each epoch's start, or within epochs in batches
its loader cuts at the size in force), with what the Trainer cannot know once the batch changes:
the LR schedule counted in samples, and the run's position.

``Trainer`` sizes its LR schedule in optimizer steps once (``max_steps`` at the first batch), and
on resume finds its place by dividing the global step by the steps of an epoch at the first
batch. Once the batch grows an epoch takes fewer steps, so the schedule would not finish and a
resume would land in the wrong epoch. Here the schedule advances by samples seen, in steps of
the first batch (:class:`SampleCountedSchedule`), and the checkpoint keeps the epoch and the
steps into it (:class:`RunPosition`), from which a resume starts.
"""

from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Tuple

from adaptive_batch.schedule.lr_progress import SampleProgressLR


@dataclass
class RunPosition:
    """Where the run is, in the epochs of its own batches.

    Attributes:
        epoch: the epoch being trained.
        epoch_start_step: the global step the epoch started at.
        epoch_updates: the optimizer steps the epoch takes at its batch.
        samples_seen: samples trained so far (the schedule's progress).
        schedule_steps: the schedule's length in steps of the first batch (``max_steps`` when
            the run started), kept so a resumed run's schedule is the same.
    """

    epoch: int = 0
    epoch_start_step: int = 0
    epoch_updates: int = 0
    samples_seen: int = 0
    schedule_steps: int = 0

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)

    def resume_point(self, global_step: int, accumulation: int) -> Tuple[int, int]:
        """``(epoch, micro-batches into it)`` a resumed run starts from: the next epoch's start
        where the checkpoint's epoch had ended."""
        done = global_step - self.epoch_start_step
        if done >= self.epoch_updates:
            return self.epoch + 1, 0
        return self.epoch, done * accumulation


class SampleCountedSchedule:
    """The Trainer's LR scheduler, advanced by samples seen in steps of the first batch.

    Args:
        scheduler: the ``LambdaLR`` the Trainer made (its schedules are all ``LambdaLR``).
        samples_per_step: the first batch, over every rank.
        samples_seen: reads the samples trained so far.

    Raises:
        ConfigError: for a scheduler that is not a ``LambdaLR``.
    """

    def __init__(self, scheduler: Any, samples_per_step: int, samples_seen: Callable[[], int]) -> None:
        self._progress = SampleProgressLR(scheduler, samples_per_step)
        self.scheduler, self._samples_seen = scheduler, samples_seen
        self.optimizer = scheduler.optimizer

    def step(self) -> None:
        self._progress.set_progress(self._samples_seen())

    def get_last_lr(self) -> List[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


__all__ = ["RunPosition", "SampleCountedSchedule"]
