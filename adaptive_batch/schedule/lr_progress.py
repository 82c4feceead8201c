"""An LR schedule that advances with samples seen, not optimizer steps.

torchtune's schedulers (``get_cosine_schedule_with_warmup`` and the others) are ``LambdaLR``s of
the step count, sized by ``num_training_steps`` at setup. When the batch grows, an epoch takes
fewer steps and a step-counted schedule would never finish. Here the schedule's "step" is
``samples_seen / samples_per_step``: steps at the batch the schedule was configured for. So
warmup lasts as many samples as the config meant, and the decay ends with the last sample.
"""

from typing import Any, List

import torch

from adaptive_batch.errors import ConfigError


def check_counted_in_samples(lr_scheduler: Any) -> None:
    """A schedule that advances by samples is one whose LR its step count decides.

    Raises:
        ConfigError: for one that is not a ``LambdaLR``.
    """
    if not isinstance(lr_scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise ConfigError(
            f"lr_scheduler: {type(lr_scheduler).__name__} is not a LambdaLR: counting the schedule in samples "
            "needs a LambdaLR-based schedule (torchtune's and transformers' are; or a LambdaLR of your own), "
            "or no scheduler."
        )


class SampleProgressLR:
    """Sets each param group's LR from a ``LambdaLR``'s lambdas at a progress in samples.

    Args:
        lr_scheduler: a ``torch.optim.lr_scheduler.LambdaLR`` built with
            ``num_training_steps = total_samples / samples_per_step``.
        samples_per_step: samples that count as one of the schedule's steps (the batch the
            config's schedule was written for).

    Raises:
        ConfigError: if ``lr_scheduler`` is not a ``LambdaLR`` (the lambdas are what it reads).
        ValueError: if ``samples_per_step`` is not positive.
    """

    def __init__(self, lr_scheduler: torch.optim.lr_scheduler.LRScheduler, samples_per_step: float) -> None:
        check_counted_in_samples(lr_scheduler)
        if samples_per_step <= 0:
            raise ValueError(f"samples_per_step={samples_per_step} must be positive.")
        self.lr_scheduler = lr_scheduler
        self.samples_per_step = float(samples_per_step)
        self.optimizer = lr_scheduler.optimizer

    def progress_steps(self, samples_seen: int) -> float:
        """The schedule's position, in steps at ``samples_per_step``."""
        return samples_seen / self.samples_per_step

    def set_progress(self, samples_seen: int) -> List[float]:
        """Sets the LRs the next optimizer step uses, after ``samples_seen`` samples.

        Returns:
            The LR of every param group.
        """
        step = self.progress_steps(samples_seen)
        lrs = [
            base * lmbda(step)
            for base, lmbda in zip(self.lr_scheduler.base_lrs, self.lr_scheduler.lr_lambdas)
        ]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        # Keep the scheduler's view in step, for anything that reads get_last_lr().
        self.lr_scheduler._last_lr = list(lrs)
        return lrs

    def get_last_lr(self) -> List[float]:
        return self.lr_scheduler.get_last_lr()
