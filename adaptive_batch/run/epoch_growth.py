"""The batch of a framework's run across its epochs, for the adapters of loops we do not own
(Lightning's fit loop, Hugging Face's Trainer): where it starts, how it grows at each epoch's
start, and the LR that follows it.

The decisions are the recipes' (:func:`~adaptive_batch.schedule.growth.grow_batch_size`,
:class:`~adaptive_batch.schedule.lr_scaling.BatchLRScaler`); this module holds what a run needs
of them between the framework's hooks, and the state a checkpoint keeps so a resumed run trains
the batch the stopped one would have trained. How a batch splits into the micro-batches that fit
is the adapter's (Lightning accumulates equal ones by count; the Trainer may split unevenly).
"""

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from adaptive_batch.errors import ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.run.grower import per_rank_increase
from adaptive_batch.schedule.growth import GrowthDecision, GrowthOptions, function_name, grow_batch_size
from adaptive_batch.schedule.lr_scaling import BatchLRScaler, LRScalingOptions

STATE_VERSION = 1


@dataclass
class EpochGrowthState:
    """What a checkpoint keeps of the batch (the callback's ``state_dict``).

    Attributes:
        found: the probe's answer, the largest micro-batch that trains.
        effective: the batch (samples of one optimizer step) of the epoch the checkpoint was
            taken in (or is about to start).
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
    def from_dict(cls, state: Dict[str, Any]) -> "EpochGrowthState":
        fields = {key: state[key] for key in ("found", "effective", "reference", "decided_epoch", "settings")}
        return cls(**fields)


class EpochGrowth:
    """A run's batch (the samples of one optimizer step) from the probe's answer on, epoch by epoch.

    Args:
        growth: ``batch_increase_function`` (called at the start of every epoch, 0-based, as
            ``f(epoch, current_batch_size) -> increment``, with the batch over every rank, as the
            recipes call it) and ``grow_with_accumulation``.
        lr: how the LR (and weight decay) follow the batch.
        accumulates: the batch may pass what fits in accumulated micro-batches without
            ``grow_with_accumulation`` (a fixed global batch, or a Trainer's accumulation).

    Raises:
        ConfigError: for a growth function that needs the gradient noise scale (not measured
            here), or a ``batch_increase_interval`` other than the epoch; for a rule the
            optimizer cannot take (:meth:`attach_optimizer`).
    """

    def __init__(self, growth: GrowthOptions, lr: LRScalingOptions, *, accumulates: bool = False) -> None:
        interval = growth.batch_increase_interval
        if not interval.per_epoch:
            # The loops size an epoch's loader, its steps and its accumulation at its start.
            raise ConfigError(
                f"batch_increase_interval='{interval}': a framework's loop builds each epoch's batches, and counts its "
                "steps, at the epoch's start, so the batch grows there alone here; set batch_increase_interval='epoch' "
                "(the default), or grow every N steps, samples or tokens with the recipes or adaptive_batch.AdaptiveBatch."
            )
        fn = growth.batch_increase_function
        if getattr(fn, "needs_gradient_noise_scale", False):
            raise ConfigError(
                f"batch_increase_function={function_name(fn)} grows toward the gradient noise scale, which a "
                "framework's loop does not measure here; grow by epoch (adaptive_batch.multiply_every, linear_ramp, "
                "seesaw, ...) or train with a recipe (measure_noise_scale=True)."
            )
        self.growth, self.lr, self._accumulates = growth, lr, accumulates
        self.state: Optional[EpochGrowthState] = None
        self.scaler: Optional[BatchLRScaler] = None
        self._hooks: list = []  # the optimizer's step hooks of this run
        self.ranks = 1  # the data-parallel ranks, each training ``state.effective`` samples a step

    @property
    def grows(self) -> bool:
        return self.growth.batch_increase_function is not None

    @property
    def accumulates(self) -> bool:
        """Whether the batch may pass what fits, in accumulated micro-batches."""
        return self._accumulates or self.growth.grow_with_accumulation

    def allow_accumulation(self) -> None:
        """Lets the batch pass what fits in accumulated micro-batches (a run that accumulates
        already, as a Trainer whose first effective batch is larger than the answer)."""
        self._accumulates = True

    def start(self, found: int, configured: int, settings: Dict[str, Any], *, first: Optional[int] = None,
              ranks: int = 1) -> int:
        """One rank's first batch: ``first`` where the adapter fixes it (a global batch's share, a
        Trainer's effective batch), else ``configured`` where it grows (clamped to what fits
        unless it accumulates), else the answer. The LR reference is the batch the configured LR
        was set for, over the ``ranks`` (``configured`` on each, or ``lr_scaling_reference``)."""
        self.ranks = ranks
        if first is not None:
            effective = first
        elif self.grows:
            effective = configured if self.accumulates else min(configured, found)
            if effective < configured:
                logs.info(f"adaptive-batch: the configured batch of {configured} does not fit; growth starts at {found}.")
        else:
            effective = found
        reference = self.lr.lr_scaling_reference
        self.state = EpochGrowthState(found, effective, float(configured * ranks if reference is None else reference),
                                      -1, settings)
        return effective

    def resume(self, state: Dict[str, Any], settings: Dict[str, Any], *, ranks: int = 1) -> int:
        """One rank's batch of the checkpoint's fit, its settings (the ranks among them, where the
        adapter keeps them) checked against these.

        Raises:
            ConfigError: naming the first setting that differs, with both values.
        """
        restored = EpochGrowthState.from_dict(state)
        restored.settings = {"world_size": 1, **restored.settings}  # every fit before ranks were kept ran on one
        for key, value in settings.items():
            if restored.settings.get(key) != value:
                raise ConfigError(
                    f"{key}={value!r}, but the checkpoint's fit ran with {key}={restored.settings.get(key)!r}: its "
                    "batch would no longer be the one it trained. Resume with the checkpoint's setting, or start a new fit."
                )
        self.state, self.ranks = restored, ranks
        return restored.effective

    def grow_at(self, epoch: int) -> Optional[GrowthDecision]:
        """Calls the growth function for ``epoch`` once (a resumed run has decided its epochs)
        and takes its decision; ``None`` where it was not called, or the batch stays.

        Raises:
            BatchIncreaseFunctionError: when the function raises or returns a bad increment.
        """
        state = self.state
        if not self.grows or epoch <= state.decided_epoch:
            return None
        state.decided_epoch = epoch
        # The function sees and grows the batch over every rank; each rank takes its share.
        fn = per_rank_increase(self.growth.batch_increase_function, self.ranks)
        decision = grow_batch_size(fn, epoch=epoch, current_batch_size=state.effective,
                                   bound=None if self.accumulates else state.found)
        if decision.batch_size == state.effective:
            if decision.clamped:
                logs.info(f"adaptive-batch: epoch {epoch}: {decision.requested} asked, {state.effective} kept (the "
                          "largest that trains); grow_with_accumulation=True grows past it.")
            return None
        state.effective = decision.batch_size
        return decision

    def attach_optimizer(self, optimizer: Any, lr_scheduler: Any, *, hold_before_step: bool = False) -> None:
        """Scales ``optimizer``'s LR for the batch (``lr_scheduler``'s LR is the base, when given):
        set before each batch (:meth:`hold_lr`), the unscaled LR put back after each optimizer
        step, where Lightning steps its schedulers next (a chainable schedule such as ``StepLR``
        multiplies the LR it finds, and would compound the factor); with ``hold_before_step`` also
        set before each optimizer step.

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
        self._hooks = [optimizer.register_step_post_hook(lambda *_: self.scaler.restore())]
        if hold_before_step:  # a loop that reads the LR between steps from its scheduler (the Trainer)
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.hold_lr()))

    def detach(self) -> None:
        """Leaves the optimizer as the run found it: no hook of this run's."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def lr_factor(self) -> float:
        """The factor the LR in force holds for the current batch (1 where nothing scales)."""
        if self.scaler is None or self.state is None:
            return 1.0
        return self.scaler.lr_rule.factors(samples=self.state.effective * self.ranks, tokens=0.0).lr_factor

    def release_lr(self) -> None:
        """The unscaled LR back (idempotent)."""
        if self.scaler is not None:
            self.scaler.restore()

    def hold_lr(self) -> None:
        """The LR in force for the current batch: the schedule's (or the configured) LR times the
        rule's factor, where monitors and the optimizer step read it."""
        if self.scaler is not None:
            self.scaler.apply(samples=self.state.effective * self.ranks, tokens=0.0)


def growth_settings(growth: GrowthOptions, lr: LRScalingOptions) -> Dict[str, Any]:
    """The growth and LR settings a resumed fit must share with the checkpoint's, as plain values."""
    fn = growth.batch_increase_function
    return dict(batch_increase_function=None if fn is None else function_name(fn),
                grow_with_accumulation=growth.grow_with_accumulation, lr_scaling=lr.lr_scaling,
                lr_scaling_reference=lr.lr_scaling_reference, weight_decay_scaling=lr.weight_decay_scaling)
