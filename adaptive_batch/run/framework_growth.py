"""The batch of a framework's run, for the adapters of loops we do not own (Lightning's fit
loop, Hugging Face's Trainer): where it starts, how it grows (at each epoch's start, or, where the
loop takes batches of any size, at each boundary of ``N steps`` or ``N samples`` as its loader
cuts them), and the LR that follows it.

The decisions are the recipes' (:func:`~adaptive_batch.schedule.growth.grow_batch_size`,
:class:`~adaptive_batch.schedule.lr_scaling.BatchLRScaler`); this module holds what a run needs
of them between the framework's hooks, and the state a checkpoint keeps so a resumed run trains
the batch the stopped one would have trained. How a batch splits into the micro-batches that fit
is the adapter's (Lightning accumulates equal ones by count; the Trainer may split unevenly).
"""

import copy
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

from adaptive_batch.errors import ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.run.grower import per_rank_increase
from adaptive_batch.schedule.growth import (
    RECORDED_SINCE, GrowthDecision, GrowthOptions, function_identity, function_name, grow_batch_size,
    same_setting_recorded,
)
from adaptive_batch.schedule.lr_scaling import BatchLRScaler, LRScalingOptions

STATE_VERSION = 1


@dataclass
class FrameworkGrowthState:
    """What a checkpoint keeps of the batch (the callback's ``state_dict``).

    Attributes:
        found: the probe's answer, the largest micro-batch that trains.
        effective: the batch (samples of one optimizer step) of the epoch the checkpoint was
            taken in (or is about to start).
        reference: the batch, in samples, the configured LR was set for.
        decided_boundary: the last epoch (or boundary of a steps or samples interval) whose growth
            was decided.
        settings: the callback's settings, so a resume with other ones is refused.
        steps: the batches cut so far, where the batch grows within epochs.
        samples: their samples on this rank.
    """

    found: int
    effective: int
    reference: float
    decided_boundary: int
    settings: Dict[str, Any]
    steps: int = 0
    samples: int = 0

    def to_dict(self) -> Dict[str, Any]:
        # decided_epoch too, for a library of 2026-11-27 or older resuming it.
        return dict(asdict(self), decided_epoch=self.decided_boundary, version=STATE_VERSION)

    @classmethod
    def from_dict(cls, state: Dict[str, Any]) -> "FrameworkGrowthState":
        fields = {key: state[key] for key in ("found", "effective", "reference", "settings")}
        # A checkpoint written before the field was renamed (2026-11-27) calls it decided_epoch.
        decided = state["decided_boundary"] if "decided_boundary" in state else state["decided_epoch"]
        return cls(**fields, decided_boundary=decided, steps=state.get("steps", 0), samples=state.get("samples", 0))


class FrameworkGrowth:
    """A run's batch (the samples of one optimizer step) from the probe's answer on, epoch by epoch.

    Args:
        growth: ``batch_increase_function`` (called as ``f(k, current_batch_size) -> increment``
            with the batch over every rank, as the recipes call it, at the start of every epoch
            ``k``, 0-based, or at boundary ``k`` of ``batch_increase_interval``, the first before
            the first step) and ``grow_with_accumulation``.
        lr: how the LR (and weight decay) follow the batch.
        accumulates: the batch may pass what fits in accumulated micro-batches without
            ``grow_with_accumulation`` (a fixed global batch, or a Trainer's accumulation).
        within_epochs: the adapter's loader cuts batches of the size in force as it draws them
            (:meth:`cut_batch`), so the batch may grow every ``N steps`` or ``N samples``.

    Raises:
        ConfigError: for a growth function that needs the gradient noise scale (not measured
            here); for a ``batch_increase_interval`` other than the epoch where the adapter
            cannot grow within epochs, or of tokens; for a rule the optimizer cannot take
            (:meth:`attach_optimizer`).
    """

    def __init__(self, growth: GrowthOptions, lr: LRScalingOptions, *, accumulates: bool = False,
                 within_epochs: bool = False) -> None:
        interval = growth.batch_increase_interval
        if not interval.per_epoch and growth.batch_increase_function is None:
            raise ConfigError(
                f"batch_increase_interval='{interval}' without a batch_increase_function: nothing would grow; set "
                "batch_increase_function, or leave batch_increase_interval='epoch'."
            )
        if not interval.per_epoch and not within_epochs:
            # Lightning's loop counts an epoch's accumulation from its start.
            raise ConfigError(
                f"batch_increase_interval='{interval}': this loop builds each epoch's batches, and counts its "
                "steps, at the epoch's start, so the batch grows there alone here; set batch_increase_interval='epoch' "
                "(the default), or grow every N steps, samples or tokens with the recipes, AdaptiveBatchTrainer or "
                "adaptive_batch.AdaptiveBatch."
            )
        if interval.unit == "tokens":
            raise ConfigError(
                f"batch_increase_interval='{interval}': this loop's loader counts the steps and samples it cuts, not "
                "their tokens; grow every N steps or N samples, or by tokens with the recipes."
            )
        fn = growth.batch_increase_function
        if getattr(fn, "needs_gradient_noise_scale", False):
            raise ConfigError(
                f"batch_increase_function={function_name(fn)} grows toward the gradient noise scale, which a "
                "framework's loop does not measure here; grow by epoch (adaptive_batch.multiply_every, linear_ramp, "
                "seesaw, ...) or train with a recipe (measure_noise_scale=True)."
            )
        self.growth, self.lr, self._accumulates = growth, lr, accumulates
        self.state: Optional[FrameworkGrowthState] = None
        self.scaler: Optional[BatchLRScaler] = None
        self._hooks: list = []  # the optimizer's step hooks of this run
        self.ranks = 1  # the data-parallel ranks, each training ``state.effective`` samples a step
        self._trained: Optional[int] = None  # the samples of the step being trained, where the adapter says
        self.run_samples: Optional[int] = None  # where the adapter says: this rank's samples of the whole run
        self._stepping = False  # inside the optimizer's step: between its pre-hook and its post-hook
        self._decisions: Dict[Tuple[int, int], GrowthDecision] = {}  # (boundary, batch) -> the function's answer

    @property
    def within_epochs(self) -> bool:
        """Whether the batch grows at boundaries of steps or samples, as the loader cuts them."""
        return not self.growth.batch_increase_interval.per_epoch

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
        self.state = FrameworkGrowthState(found, effective, float(configured * ranks if reference is None else reference),
                                      -1, settings)
        self._trained, self._decisions = None, {}
        if self.grows and self.within_epochs:
            self._decide_reached(self.state, log=True)  # boundary 0, before the first step
        return self.state.effective

    def resume(self, state: Dict[str, Any], settings: Dict[str, Any], *, ranks: int = 1) -> int:
        """One rank's batch of the checkpoint's fit, its settings (the ranks among them, where the
        adapter keeps them) checked against these.

        Raises:
            ConfigError: naming the first setting that differs, with both values.
        """
        restored = FrameworkGrowthState.from_dict(state)
        # Every fit before ranks, or the interval, were kept ran on one rank, growing per epoch.
        restored.settings = {"world_size": 1, "batch_increase_interval": "epoch", **restored.settings}
        for key, value in settings.items():
            if key in RECORDED_SINCE and key not in restored.settings:  # a fit from before it was kept
                continue
            if not same_setting_recorded(key, restored.settings.get(key), value):
                raise ConfigError(
                    f"{key}={value!r}, but the checkpoint's fit ran with {key}={restored.settings.get(key)!r}: its "
                    "batch would no longer be the one it trained. Resume with the checkpoint's setting, or start a new fit."
                )
        self.state, self.ranks = restored, ranks
        self._trained, self._decisions = None, {}
        return restored.effective

    def grow_at(self, epoch: int) -> Optional[GrowthDecision]:
        """Calls the growth function for ``epoch`` once (a resumed run has decided its epochs)
        and takes its decision; ``None`` where it was not called, or the batch stays.

        Raises:
            BatchIncreaseFunctionError: when the function raises or returns a bad increment.
        """
        state = self.state
        if not self.grows or epoch <= state.decided_boundary:
            return None
        state.decided_boundary = epoch
        decision = self._decide(state, epoch, "epoch")
        if decision.batch_size == state.effective:
            if decision.clamped:
                logs.info(f"adaptive-batch: epoch {epoch}: {decision.requested} asked, {state.effective} kept (the "
                          "largest that trains); grow_with_accumulation=True grows past it.")
            return None
        state.effective = decision.batch_size
        return decision

    def _decide(self, state: FrameworkGrowthState, k: int, label: str) -> GrowthDecision:
        """Boundary ``k``'s decision at ``state``'s batch, made once: an epoch's length is
        simulated before its batches are cut, and a function with a state of its own (a counter,
        a random draw) answering otherwise the second time would end the epoch before its
        batches, or leave a step without one."""
        key = (k, state.effective)
        if key not in self._decisions:
            # The function sees and grows the batch over every rank; each rank takes its share.
            fn = per_rank_increase(self.growth.batch_increase_function, self.ranks)
            self._decisions[key] = grow_batch_size(fn, epoch=k, current_batch_size=state.effective,
                                                   bound=None if self.accumulates else state.found, label=label)
        return self._decisions[key]

    def next_batch_size(self) -> int:
        """The size the loader cuts its next batch at (no more than the run has left)."""
        return self._cut_at(self.state)

    def _cut_at(self, state: FrameworkGrowthState) -> int:
        left = None if self.run_samples is None else max(self.run_samples - state.samples, 1)
        return state.effective if left is None else min(state.effective, left)

    def cut_batch(self, rows: int) -> None:
        """A batch of ``rows`` samples cut by the loader at the batch in force: counted, and the
        growth of every boundary it reaches decided (the next batch takes it). A loader draws
        ahead of training: the LR follows the step trained (:meth:`train_samples`).

        Raises:
            BatchIncreaseFunctionError: when the function raises or returns a bad increment.
        """
        self._count(self.state, rows)
        self._decide_reached(self.state, log=True)

    def train_samples(self, samples: int) -> None:
        """The samples (on this rank) of the step about to train: the LR rule follows them, as
        the recipes' does (an epoch's last step may be short of the batch in force, and a loader
        may have cut past it)."""
        self._trained = samples

    def batches_in_epoch(self, samples: int, drop_last: bool) -> int:
        """The batches an epoch of ``samples`` samples takes from here, growing as it goes: the
        epoch's length before its batches are cut. The growth function is called for the
        boundaries on the way, once each (:meth:`_decide` keeps its answers for the loader's cuts)."""
        return self._epoch_ahead(samples, drop_last)[0]

    def _epoch_ahead(self, samples: int, drop_last: bool) -> Tuple[int, FrameworkGrowthState]:
        """The batches of the rest of an epoch of ``samples``, and the state after them."""
        state, batches = copy.deepcopy(self.state), 0
        while samples >= self._cut_at(state) or (samples > 0 and not drop_last):
            if self.run_samples is not None and state.samples >= self.run_samples:
                break  # a fraction of an epoch ends here
            rows = min(samples, self._cut_at(state))
            samples, batches = samples - rows, batches + 1
            self._count(state, rows)
            self._decide_reached(state, log=False)
        return batches, state

    def finish_epoch(self, samples: int, drop_last: bool) -> None:
        """The state after the rest of an epoch of ``samples`` samples, taken without cutting
        it (a resume from a checkpoint written at an epoch's end)."""
        self.state = self._epoch_ahead(samples, drop_last)[1]

    def _count(self, state: FrameworkGrowthState, rows: int) -> None:
        state.steps, state.samples = state.steps + 1, state.samples + rows

    def _decide_reached(self, state: FrameworkGrowthState, *, log: bool) -> None:
        """The growth of every boundary ``state``'s steps or samples (over every rank) reach, in order."""
        if self.run_samples is not None and state.samples >= self.run_samples:
            return  # the run's last batch is cut: a boundary past it never trains (the log said it grew)
        reached = self.growth.batch_increase_interval.index(steps=state.steps, samples=state.samples * self.ranks,
                                                            tokens=0)
        for k in range(state.decided_boundary + 1, reached + 1):
            decision = self._decide(state, k, "interval")
            state.decided_boundary, state.effective = k, decision.batch_size
            if log and decision.batch_size != decision.previous:
                where = self.growth.batch_increase_interval.describe(k)
                clamp = f" ({decision.requested} asked; the largest that trains)" if decision.clamped else ""
                lr = "" if self.scaler is None else f"; LR x {self.lr_factor_for(decision.batch_size):.4g} from its first step"
                logs.info(f"adaptive-batch: {where}: the batch {decision.previous} -> {decision.batch_size}{clamp}{lr}.")

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
        self._hooks = [optimizer.register_step_post_hook(lambda *_: self._leave_step())]
        if hold_before_step:  # a loop that reads the LR between steps from its scheduler (the Trainer)
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self._enter_step()))

    def _enter_step(self) -> None:
        self._stepping = True
        self.hold_lr()

    def _leave_step(self) -> None:
        self._stepping = False
        self.scaler.restore()

    def detach(self) -> None:
        """Leaves the optimizer as the run found it: no hook of this run's."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._stepping = [], False

    @property
    def trained(self) -> int:
        """The samples of the step being trained, where the adapter says them, else the batch."""
        return self.state.effective if self._trained is None else self._trained

    def lr_factor(self) -> float:
        """The factor the LR in force holds for the current batch (1 where nothing scales)."""
        return self.lr_factor_for(self.trained) if self.state is not None else 1.0

    def lr_factor_for(self, samples: int) -> float:
        """The factor the LR holds for a step of ``samples`` on each rank (1 where nothing scales)."""
        if self.scaler is None:
            return 1.0
        return self.scaler.lr_rule.factors(samples=samples * self.ranks, tokens=0.0).lr_factor

    def release_lr(self) -> None:
        """The unscaled LR back (idempotent)."""
        if self.scaler is not None:
            self.scaler.restore()

    def release_lr_before_the_step(self) -> None:
        """The unscaled LR back where the optimizer's step has not begun (a loop that runs its
        closure first, as mixed precision's GradScaler does, then a step that may be skipped);
        inside the step, whose closure runs after the step's pre-hook scaled the LR (Lightning's
        closure in ``optimizer.step``), the scaled LR stays for the update."""
        if not self._stepping:
            self.release_lr()

    def hold_lr(self) -> None:
        """The LR in force for the current batch: the schedule's (or the configured) LR times the
        rule's factor, where monitors and the optimizer step read it."""
        if self.scaler is not None:
            self.scaler.apply(samples=self.trained * self.ranks, tokens=0.0)


def growth_settings(growth: GrowthOptions, lr: LRScalingOptions) -> Dict[str, Any]:
    """The growth and LR settings a resumed fit must share with the checkpoint's, as plain values."""
    fn = growth.batch_increase_function
    return dict(batch_increase_function=None if fn is None else function_identity(fn),
                batch_increase_interval=str(growth.batch_increase_interval),
                grow_with_accumulation=growth.grow_with_accumulation, lr_scaling=lr.lr_scaling,
                lr_scaling_reference=lr.lr_scaling_reference, weight_decay_scaling=lr.weight_decay_scaling)
