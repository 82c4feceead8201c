"""The Trainer's training loader as growth cuts it: each batch at the size in force, in the order
and grouping the Trainer's sampler draws (``group_by_length``'s seeded by epoch), and the steps the
Trainer counts from it."""

import math
from typing import Any

from transformers.trainer_pt_utils import LengthGroupedSampler

from adaptive_batch.data.samplers import BatchPlan, PlannedBatchSampler
from adaptive_batch.rng import epoch_generator


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


__all__ = ["EpochSeededLengthGroupedSampler", "cut_as_planned", "first_batch_steps", "updates_in"]
