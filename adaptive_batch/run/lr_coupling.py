"""The learning rate coupled to the batch: a schedule counted in samples, and the scaling rule.

With fixed-size batches that grow, a schedule counted in optimizer steps would never finish
(torchtune sets ``num_training_steps`` once); :class:`LRCoupling` advances it by samples seen
instead, and applies the linear or square-root rule for each step's batch around the
optimizer step.
"""

from typing import Any, Callable, Iterable, List, Optional

from adaptive_batch.errors import ConfigError
from adaptive_batch.run.progress import BatchProgress
from adaptive_batch.schedule.lr_progress import SampleProgressLR
from adaptive_batch.schedule.lr_scaling import BatchLRScaler, BatchScaling, LRRule


class ParamGroupsOf:
    """Several optimizers' param groups as one optimizer's, for the LR rule: torchtune's
    optimizer-in-backward keeps one optimizer per parameter, and the rule scales them all."""

    def __init__(self, optimizers: Iterable[Any]) -> None:
        self._optimizers = list(optimizers)

    @property
    def param_groups(self) -> List[dict]:
        return [group for optimizer in self._optimizers for group in optimizer.param_groups]


class LRCoupling:
    """Sets each step's LR to the factors the session decided for its batch
    (:meth:`~adaptive_batch.run.session.BatchSession.scaling`).

    Args:
        rule: the scaling rule with its reference
            (:attr:`~adaptive_batch.run.session.BatchSession.lr_rule`).
        optimizer: whose param groups the rule sets.
        lr_scheduler: the run's scheduler, or ``None``.
        read_lr: reads the LR a step uses, for the log.
        batch: the run's batch state (samples seen, the first step's batch).
        count_in_samples: advance ``lr_scheduler`` by samples seen (fixed-size batches).

    When ``lr_scheduler`` drives another optimizer than ``optimizer`` (optimizer-in-backward:
    the scheduler holds the first parameter's), its LR is copied to every group of
    ``optimizer`` after each change, as torchtune's ``step_lr_scheduler`` does.

    Raises:
        ConfigError: for a scheduler that cannot be counted in samples, or a rule the
            optimizer cannot take (or no optimizer given).
    """

    def __init__(
        self,
        rule: LRRule,
        *,
        optimizer: Any,
        lr_scheduler: Any,
        read_lr: Callable[[], float],
        batch: BatchProgress,
        count_in_samples: bool,
    ) -> None:
        self._scheduler, self._read_lr, self._batch = lr_scheduler, read_lr, batch
        self._optimizer = optimizer
        self._progress: Optional[SampleProgressLR] = None
        self.scaler: Optional[BatchLRScaler] = None
        if lr_scheduler is not None and count_in_samples:
            self._progress = SampleProgressLR(lr_scheduler, batch.initial_batch_size)
            self._progress.set_progress(batch.samples_seen)
        if rule.scales and optimizer is None:
            raise ConfigError(
                f"lr_scaling={rule.rule!r} needs the optimizer whose LR it scales: pass it to attach_lr, "
                "or set lr_scaling=none."
            )
        self._follow_scheduler()
        if rule.scales:
            try:
                self.scaler = BatchLRScaler(
                    optimizer,
                    rule=rule.rule,
                    reference=rule.reference,
                    unit=rule.unit,
                    lr_scheduler=self._progress or lr_scheduler,
                    weight_decay_scaling=rule.weight_decay_scaling,
                )
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def start_step(self) -> None:
        """Brings a sample-counted schedule to the samples seen, before the step's forward."""
        if self._progress is not None:
            self._progress.set_progress(self._batch.samples_seen)
            self._follow_scheduler()
            if self.scaler is not None:
                self.scaler.hold()

    def before_optimizer_step(self, scaling: BatchScaling) -> float:
        """Sets the LR the step's factors give; returns the LR the step uses."""
        if self.scaler is None:
            return self._read_lr()
        return self.scaler.apply_factors(scaling)

    def after_optimizer_step(self) -> None:
        """Advances a step-counted scheduler on the unscaled LR, then leaves the LR in force
        (scaled for the step's batch) in the optimizer."""
        if self.scaler is not None:
            self.scaler.restore()
        if self._scheduler is not None and self._progress is None:
            self._scheduler.step()
            self._follow_scheduler()
        if self.scaler is not None:
            self.scaler.hold()

    def _follow_scheduler(self) -> None:
        """Every group of the optimizer takes the scheduler's LR, when the scheduler drives
        only part of it."""
        driven = getattr(self._scheduler, "optimizer", None)
        if driven is None or self._optimizer is None or driven is self._optimizer:
            return
        lr = self._scheduler.get_last_lr()[0]
        for group in self._optimizer.param_groups:
            group["lr"] = lr

    @property
    def weight_decay(self) -> Optional[float]:
        """The weight decay the last step used, when the rule scales it."""
        return None if self.scaler is None else self.scaler.last_weight_decay

