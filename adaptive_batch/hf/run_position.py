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
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import IterableDataset
from transformers.trainer_pt_utils import LengthGroupedSampler

from adaptive_batch.data.samplers import BatchPlan, PlannedBatchSampler
from adaptive_batch.errors import ConfigError
from adaptive_batch.rng import epoch_generator
from adaptive_batch.schedule.growth import GrowthOptions
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


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """``group_by_length``'s order, drawn each epoch from a generator seeded with ``seed + epoch``
    (``set_epoch``, which the loop calls). Transformers' sampler draws from torch's global RNG,
    which a resume finds in the state of the checkpoint's step, not of its epoch's start: a run
    resumed mid-epoch after the first epoch trained another order (a plain Trainer's too)."""

    def __init__(self, sampler: LengthGroupedSampler, seed: int) -> None:
        vars(self).update(vars(sampler))
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator = epoch_generator(self.seed, epoch)


def refuse_what_growth_cannot_follow(args: Any, train_dataset: Any, lr_scheduler: Any = None) -> None:
    """What growth cannot be decided or counted with, refused in one line.

    Raises:
        ConfigError: for ``max_steps`` (an epoch takes fewer steps as the batch grows), a
            dataset without a length, TRL's ``padding_free`` or ``packing`` (a row holds many samples), or a schedule that cannot
            be counted in samples (a ``LambdaLR``'s can: every ``lr_scheduler_type`` but
            ``reduce_lr_on_plateau``).
    """
    if str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "reduce_lr_on_plateau" or (
            lr_scheduler is not None and not isinstance(lr_scheduler, (LambdaLR, SampleCountedSchedule))):
        name = type(lr_scheduler).__name__ if lr_scheduler is not None else "ReduceLROnPlateau"
        raise ConfigError(
            f"lr_scheduler_type with batch_increase_function: {name} is not a LambdaLR, so it cannot be counted in "
            "samples as the batch grows; use one of the Trainer's LambdaLR schedules (linear, cosine, constant, ...)."
        )
    refuse_a_stream(train_dataset)
    for key in ("padding_free", "packing"):  # TRL packs for padding-free batches on its own
        if getattr(args, key, False):
            raise ConfigError(
                f"{key}=True with batch_increase_function: a {key.replace('_', '-')} batch is one row of many "
                f"samples, so the batch could not be counted, cut or split by samples; set {key}=False to grow the "
                "batch."
            )
    if args.max_steps and args.max_steps > 0:
        raise ConfigError(
            f"max_steps={args.max_steps} with batch_increase_function: as the batch grows an epoch takes fewer "
            "steps, so a count of steps would not be the run's length; set num_train_epochs and max_steps=-1 (the default)."
        )


def refuse_a_stream(train_dataset: Any) -> None:
    """Growth needs epochs of known length.

    Raises:
        ConfigError: for an ``IterableDataset``.
    """
    if isinstance(train_dataset, IterableDataset):
        raise ConfigError(
            "batch_increase_function with an IterableDataset: an epoch of unknown length has no start to grow at, "
            "and no length to count the schedule over; give the Trainer a dataset with a length (a datasets.Dataset, "
            "a list), or train without batch_increase_function."
        )


def refuse_growth_within_epochs_where_batches_are_shared(growth: GrowthOptions, one_process: bool) -> None:
    """Growth within epochs needs each step's batch whole in one process (several processes,
    ``DataParallel`` and ``batch_rebalance`` share each batch out by count).

    Raises:
        ConfigError: where the batches are shared out.
    """
    if not one_process:
        raise ConfigError(
            f"batch_increase_interval='{growth.batch_increase_interval}' with several processes (or several GPUs in "
            "one, or train_sampling_strategy='batch_rebalance'): the batches are shared out by count, so a batch "
            "cut at a new size mid-epoch would not be one rank's step; set batch_increase_interval='epoch' there."
        )


def cut_as_planned(loader: Any, plan: BatchPlan) -> Any:
    """``loader`` (as the Trainer and Accelerate made it, its sampler's order and grouping kept)
    cutting each batch at the size ``plan`` has in force.

    Raises:
        ValueError: for a loader without a batch sampler to replace.
    """
    torch_loader = getattr(loader, "base_dataloader", loader)  # Accelerate's wraps a torch one
    inner = getattr(torch_loader, "batch_sampler", None)
    if inner is None or not hasattr(inner, "sampler"):
        raise ValueError(f"{type(loader).__name__} has no batch sampler of a sampler to cut as planned.")
    # A DataLoader refuses a new batch sampler once made; the rest stays as the Trainer made it.
    planned = PlannedBatchSampler(inner.sampler, plan, drop_last=bool(getattr(inner, "drop_last", False)))
    object.__setattr__(torch_loader, "batch_sampler", planned)
    return loader


def first_batch_steps(args: Any, samples: int, first: int) -> int:
    """The run's optimizer steps at its first effective batch of ``first`` (the length the LR
    schedule is counted over), as the Trainer counts them from its loader."""
    per_epoch = samples // first if args.dataloader_drop_last else math.ceil(samples / first)
    return math.ceil(args.num_train_epochs * max(per_epoch, 1))


def updates_in(steps_in_epoch: int, accumulation: int) -> int:
    """The optimizer steps of an epoch of ``steps_in_epoch`` micro-batches, as the Trainer counts
    them (a last step of the micro-batches left)."""
    return max(steps_in_epoch // accumulation + int(steps_in_epoch % accumulation > 0), 1)


__all__ = ["EpochSeededLengthGroupedSampler", "RunPosition", "SampleCountedSchedule", "cut_as_planned", "first_batch_steps", "refuse_a_stream",
           "refuse_growth_within_epochs_where_batches_are_shared", "refuse_what_growth_cannot_follow", "updates_in"]
