"""The batch of a Lightning fit across its epochs: where it starts, how it grows, how it splits
into the micro-batches that fit, and the LR that follows it.

The decisions are the recipes' (:func:`~adaptive_batch.schedule.growth.grow_batch_size`,
:func:`~adaptive_batch.schedule.global_batch.equal_micro_batches`,
:class:`~adaptive_batch.schedule.lr_scaling.BatchLRScaler`); this module holds what a fit needs
of them between Lightning's hooks, and the state a checkpoint keeps so a resumed fit trains the
batch the stopped one would have trained.
"""

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from adaptive_batch.errors import ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.schedule.global_batch import equal_micro_batches
from adaptive_batch.schedule.growth import GrowthOptions, function_name, grow_batch_size
from adaptive_batch.schedule.lr_scaling import BatchLRScaler, LRScalingOptions

STATE_VERSION = 1


@dataclass(frozen=True)
class FitBatch:
    """One optimizer step's samples and how the loader and Lightning's accumulation train them.

    Attributes:
        effective: the samples of one optimizer step (the batch that grows).
        micro_batch: the loader's batch size.
        accumulate: ``accumulate_grad_batches``.
    """

    effective: int
    micro_batch: int
    accumulate: int


@dataclass
class FitBatchState:
    """What a checkpoint keeps of the batch (the callback's ``state_dict``).

    Attributes:
        found: the probe's answer, the largest micro-batch that trains.
        effective: the batch of the epoch the checkpoint was taken in (or is about to start).
        reference: the batch, in samples, the configured LR was set for.
        decided_epoch: the last epoch whose growth was decided.
        settings: the callback's settings, so a resume with other ones is refused.
    """

    found: int
    effective: int
    reference: float
    decided_epoch: int
    settings: Dict[str, Any]

    def to_dict(self) -> Dict[str, Any]:
        return dict(asdict(self), version=STATE_VERSION)

    @classmethod
    def from_dict(cls, state: Dict[str, Any]) -> "FitBatchState":
        fields = {key: state[key] for key in ("found", "effective", "reference", "decided_epoch", "settings")}
        return cls(**fields)


class FitBatchGrowth:
    """The fit's batch from the probe's answer on, epoch by epoch.

    Args:
        growth: ``batch_increase_function`` (called at the start of every epoch, 0-based, as
            ``f(epoch, current_batch_size) -> increment``) and ``grow_with_accumulation``.
        lr: how the LR (and weight decay) follow the batch.
        global_batch_size: a fixed start for the effective batch, trained in equal
            micro-batches; ``None``: the micro-batch is the batch.

    Raises:
        ConfigError: for a rule the optimizer cannot take (:meth:`attach_optimizer`).
    """

    def __init__(self, growth: GrowthOptions, lr: LRScalingOptions, global_batch_size: Optional[int]) -> None:
        self.growth, self.lr, self.global_batch_size = growth, lr, global_batch_size
        self.state: Optional[FitBatchState] = None
        self.scaler: Optional[BatchLRScaler] = None
        self._after_step: Optional[Any] = None  # the optimizer's post-step hook handle

    @property
    def grows(self) -> bool:
        return self.growth.batch_increase_function is not None

    @property
    def accumulates(self) -> bool:
        """Whether the effective batch may pass what fits, in accumulated micro-batches."""
        return self.global_batch_size is not None or self.growth.grow_with_accumulation

    def start(self, found: int, configured: int, settings: Dict[str, Any]) -> FitBatch:
        """The first epoch's batch: the global batch, the configured one where it grows (clamped
        to what fits unless it accumulates), else the answer. The LR reference is the batch the
        configured LR was set for (``configured``, or ``lr_scaling_reference``)."""
        if self.global_batch_size is not None:
            effective = self.global_batch_size
        elif self.grows:
            effective = configured if self.accumulates else min(configured, found)
            if effective < configured:
                logs.info(f"adaptive-batch: the configured batch of {configured} does not fit; growth starts at {found}.")
        else:
            effective = found
        reference = self.lr.lr_scaling_reference
        self.state = FitBatchState(found, effective, float(configured if reference is None else reference), -1, settings)
        return self.split(effective)

    def resume(self, state: Dict[str, Any], settings: Dict[str, Any]) -> FitBatch:
        """The batch a checkpoint's fit trained, its settings checked against these.

        Raises:
            ConfigError: naming the first setting that differs, with both values.
        """
        restored = FitBatchState.from_dict(state)
        for key, value in settings.items():
            if restored.settings.get(key) != value:
                raise ConfigError(
                    f"{key}={value!r}, but the checkpoint's fit ran with {key}={restored.settings.get(key)!r}: its "
                    "batch would no longer be the one it trained. Resume with the checkpoint's setting, or start a new fit."
                )
        self.state = restored
        return self.split(restored.effective)

    def split(self, effective: int) -> FitBatch:
        """``effective`` as the loader's batch and Lightning's accumulation: whole where it fits,
        else the fewest equal micro-batches that fit (Lightning accumulates by count)."""
        found = self.state.found
        if effective <= found:
            return FitBatch(effective, effective, 1)
        micro_batch, count = equal_micro_batches(effective, found)
        return FitBatch(effective, micro_batch, count)

    def grow_at(self, epoch: int) -> Optional[FitBatch]:
        """Calls the growth function for ``epoch`` once (a resumed fit has decided its epochs);
        returns the new batch, or ``None`` where it stays.

        Raises:
            BatchIncreaseFunctionError: when the function raises or returns a bad increment.
        """
        state = self.state
        if not self.grows or epoch <= state.decided_epoch:
            return None
        state.decided_epoch = epoch
        decision = grow_batch_size(self.growth.batch_increase_function, epoch=epoch, current_batch_size=state.effective,
                                   bound=None if self.accumulates else state.found)
        if decision.batch_size == state.effective:
            if decision.clamped:
                logs.info(f"adaptive-batch: epoch {epoch}: {decision.requested} asked, {state.effective} kept (the "
                          "largest that trains); grow_with_accumulation=True grows past it.")
            return None
        state.effective = decision.batch_size
        batch = self.split(state.effective)
        clamp = f" ({decision.requested} asked; the largest that trains)" if decision.clamped else ""
        logs.info(f"adaptive-batch: epoch {epoch}: batch {decision.previous} -> {batch.effective}{clamp}, trained as "
                  f"{batch.accumulate} x {batch.micro_batch}.")
        return batch

    def attach_optimizer(self, optimizer: Any, lr_scheduler: Any) -> None:
        """Scales ``optimizer``'s LR for the batch (``lr_scheduler``'s LR is the base, when given):
        set before each batch (:meth:`hold_lr`), the unscaled LR put back after each optimizer
        step, where Lightning steps its schedulers next (a chainable schedule such as ``StepLR``
        multiplies the LR it finds, and would compound the factor).

        Raises:
            ConfigError: for a rule the optimizer cannot take (timescale weight decay without one),
                or no optimizer where the LR scales.
        """
        if not self.lr.scales:
            return
        if optimizer is None:
            raise ConfigError(f"lr_scaling={self.lr.lr_scaling!r} needs an optimizer: configure_optimizers returns none.")
        try:
            self.scaler = BatchLRScaler(optimizer, rule=self.lr.lr_scaling, reference=self.state.reference,
                                        lr_scheduler=lr_scheduler, weight_decay_scaling=self.lr.weight_decay_scaling)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._after_step = optimizer.register_step_post_hook(lambda *_: self.scaler.restore())

    def detach(self) -> None:
        """Leaves the optimizer as the fit found it: no hook of this fit's."""
        if self._after_step is not None:
            self._after_step.remove()
            self._after_step = None

    def hold_lr(self) -> None:
        """The LR in force for the current batch: the schedule's (or the configured) LR times the
        rule's factor, where monitors and the optimizer step read it."""
        if self.scaler is not None:
            self.scaler.apply(samples=self.state.effective, tokens=0.0)


def growth_settings(growth: GrowthOptions, lr: LRScalingOptions) -> Dict[str, Any]:
    """The growth and LR settings a resumed fit must share with the checkpoint's, as plain values."""
    fn = growth.batch_increase_function
    return dict(batch_increase_function=None if fn is None else function_name(fn),
                grow_with_accumulation=growth.grow_with_accumulation, lr_scaling=lr.lr_scaling,
                lr_scaling_reference=lr.lr_scaling_reference, weight_decay_scaling=lr.weight_decay_scaling)
