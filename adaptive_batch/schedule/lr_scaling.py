"""Learning rate scaled with the batch: the linear and square-root rules.

Linear (Goyal et al.): multiply the LR by ``k`` when the batch grows ``k`` times. Square root
(Krizhevsky): multiply by ``sqrt(k)``, keeping the gradient's variance constant. The base LR
comes from the optimizer's configured value or from an LR scheduler, and the factor multiplies
it, so any torchtune scheduler composes with it.

Weight decay (optional, off by default): ``weight_decay_scaling: timescale`` keeps AdamW's
timescale ``B / (lr x weight_decay x D)`` (Bergsma et al. 2025, "Power Lines"; ``D`` the data,
fixed) as the batch ``B`` and the LR change, by multiplying the weight decay by
``(B / reference) / lr_factor``: unchanged under the linear rule, ``sqrt(B / reference)`` under
the square-root rule, ``B / reference`` with the LR left alone.
"""

from dataclasses import dataclass
import math
from typing import Any, List, Literal, Optional

import torch

from adaptive_batch.errors import ConfigError
from adaptive_batch.validation import check_choice

LR_SCALING_RULES = ("none", "linear", "sqrt")
LR_SCALING_UNITS = ("samples", "tokens")
WEIGHT_DECAY_SCALING = ("none", "timescale")


@dataclass(frozen=True, kw_only=True)
class LRScalingOptions:
    """How the LR follows the batch; the options check themselves when built.

    Attributes:
        lr_scaling: ``"none"``, ``"linear"`` (LR x B/B0) or ``"sqrt"`` (LR x sqrt(B/B0)),
            applied every step to the optimizer's or scheduler's current LR.
        lr_scaling_unit: what a batch B is counted in: ``"samples"`` per step, or real
            (non-padding) ``"tokens"`` per step.
        lr_scaling_reference: the batch, in that unit, the configured LR was tuned for;
            ``None`` for the configured batch in samples.
        weight_decay_scaling: ``"timescale"`` scales each param group's ``weight_decay`` so
            AdamW's timescale ``B / (lr x weight_decay)`` stays what the config set.

    Raises:
        ConfigError: for the first bad value, NaN and infinity included.
    """

    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    lr_scaling_unit: Literal["samples", "tokens"] = "samples"
    lr_scaling_reference: Optional[float] = None
    weight_decay_scaling: Literal["none", "timescale"] = "none"

    @property
    def scales(self) -> bool:
        """Whether anything follows the batch (the LR, the weight decay or both)."""
        return self.lr_scaling != "none" or self.weight_decay_scaling != "none"

    def __post_init__(self) -> None:
        check_choice("lr_scaling", self.lr_scaling, LR_SCALING_RULES, "use none, linear or sqrt.")
        check_choice(
            "weight_decay_scaling", self.weight_decay_scaling, WEIGHT_DECAY_SCALING,
            "use none, or timescale to keep AdamW's B/(lr x weight_decay) fixed.",
        )
        check_choice("lr_scaling_unit", self.lr_scaling_unit, LR_SCALING_UNITS, "use samples or tokens.")
        ref = self.lr_scaling_reference
        if ref is not None and (
            isinstance(ref, bool) or not isinstance(ref, (int, float)) or not math.isfinite(ref) or ref <= 0
        ):
            raise ConfigError(
                f"lr_scaling_reference={ref!r} must be a positive number of "
                f"{self.lr_scaling_unit}, or null for batch_size samples."
            )
        if self.scales and self.lr_scaling_unit == "tokens" and ref is None:
            raise ConfigError(
                "lr_scaling_unit=tokens needs lr_scaling_reference: the number of real tokens per "
                "step the configured LR was tuned for, e.g. lr_scaling_reference=4096."
            )


def lr_scale_factor(batch: float, reference: float, rule: str) -> float:
    """The LR multiplier for a batch of ``batch`` units against ``reference`` units.

    Raises:
        ValueError: for an unknown rule or a non-positive batch or reference.
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"lr_scaling={rule!r} is not one of {list(LR_SCALING_RULES)}.")
    if rule == "none":
        return 1.0
    if reference <= 0 or batch <= 0:
        raise ValueError(f"cannot scale the LR for batch {batch} against reference {reference}: both must be positive.")
    ratio = batch / reference
    return ratio if rule == "linear" else math.sqrt(ratio)


@dataclass(frozen=True)
class BatchScaling:
    """What a step's batch does to the configured LR and weight decay: both are multiplied.

    Attributes:
        lr_factor: the rule's factor (1 with ``lr_scaling="none"``).
        weight_decay_factor: ``(B / reference) / lr_factor`` with
            ``weight_decay_scaling="timescale"``, else 1.
    """

    lr_factor: float = 1.0
    weight_decay_factor: float = 1.0


@dataclass(frozen=True)
class LRRule:
    """The scaling rule with its reference: a step's batch in, its factors out.

    Args:
        rule: ``"none"``, ``"linear"`` or ``"sqrt"``.
        reference: the batch (in ``unit``) the configured LR was set for.
        unit: ``"samples"`` or ``"tokens"`` (real, non-padding tokens).
        weight_decay_scaling: ``"none"`` or ``"timescale"``.

    Raises:
        ValueError: for an unknown rule, unit or weight-decay scaling, or a reference that is
            not a positive finite number where anything scales.
    """

    rule: str
    reference: float
    unit: str = "samples"
    weight_decay_scaling: str = "none"

    def __post_init__(self) -> None:
        lr_scale_factor(1, 1, self.rule)
        if self.weight_decay_scaling not in WEIGHT_DECAY_SCALING:
            raise ValueError(
                f"weight_decay_scaling={self.weight_decay_scaling!r} is not one of {list(WEIGHT_DECAY_SCALING)}."
            )
        if self.unit not in LR_SCALING_UNITS:
            raise ValueError(f"lr_scaling_unit={self.unit!r} is not one of {list(LR_SCALING_UNITS)}.")
        reference = self.reference
        bad = isinstance(reference, bool) or not isinstance(reference, (int, float)) or not math.isfinite(reference)
        if self.scales and (bad or reference <= 0):
            raise ValueError(
                f"lr_scaling_reference={reference!r} must be a positive finite number of {self.unit}: the batch "
                "the configured LR was tuned for."
            )

    @classmethod
    def of(cls, options: LRScalingOptions, configured_batch: float) -> "LRRule":
        """The rule ``options`` set, its reference ``configured_batch`` samples where they name none."""
        reference = options.lr_scaling_reference
        return cls(
            rule=options.lr_scaling,
            reference=float(reference if reference is not None else configured_batch),
            unit=options.lr_scaling_unit,
            weight_decay_scaling=options.weight_decay_scaling,
        )

    @property
    def scales(self) -> bool:
        return self.rule != "none" or self.weight_decay_scaling != "none"

    def factors(self, *, samples: float, tokens: float) -> BatchScaling:
        """The factors for a step of ``samples`` samples holding ``tokens`` real tokens."""
        batch = samples if self.unit == "samples" else tokens
        factor = lr_scale_factor(batch, self.reference, self.rule)
        if self.weight_decay_scaling != "timescale":
            return BatchScaling(factor)
        # The LR times the weight decay, per sample of the batch, stays the configured one.
        return BatchScaling(factor, (batch / self.reference) / factor)


# Kept in each param group beside its LR (and saved with the optimizer's state): the factor
# the LR in force holds, so a resumed optimizer's base LR is known.
LR_FACTOR_KEY = "adaptive_batch_lr_factor"


class BatchLRScaler:
    """Sets each param group's LR to ``base x factor(batch)`` before an optimizer step, and with
    ``weight_decay_scaling="timescale"`` its weight decay to ``base x (batch / reference) / factor``.

    Args:
        optimizer: the optimizer whose param groups are scaled.
        rule: ``"none"``, ``"linear"`` or ``"sqrt"``.
        reference: the batch (in ``unit``) the configured LR was set for.
        unit: ``"samples"`` or ``"tokens"`` (real, non-padding tokens).
        lr_scheduler: when given, its last LR is the base; else the LR the optimizer had when
            the scaler was made.
        weight_decay_scaling: ``"none"`` or ``"timescale"``.

    Raises:
        ValueError: for an unknown rule, unit or weight-decay scaling, a non-positive reference,
            or timescale scaling of an optimizer without ``weight_decay``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        rule: str,
        reference: float,
        unit: str = "samples",
        lr_scheduler: Optional[Any] = None,
        weight_decay_scaling: str = "none",
    ) -> None:
        self.lr_rule = LRRule(rule=rule, reference=reference, unit=unit, weight_decay_scaling=weight_decay_scaling)
        if weight_decay_scaling != "none" and any("weight_decay" not in g for g in optimizer.param_groups):
            raise ValueError(
                f"weight_decay_scaling={weight_decay_scaling!r} with {type(optimizer).__name__}, which has no "
                "weight_decay: set weight_decay_scaling=none."
            )
        if weight_decay_scaling != "none" and not any(g["weight_decay"] for g in optimizer.param_groups):
            raise ValueError(
                f"weight_decay_scaling={weight_decay_scaling!r} with {type(optimizer).__name__}'s weight_decay=0: "
                "scaling zero changes nothing; set optimizer.weight_decay above 0, or weight_decay_scaling=none."
            )
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.weight_decay_scaling = weight_decay_scaling
        # A resumed optimizer holds the LR in force and its factor; its base is their quotient.
        self._initial = [g["lr"] / g.get(LR_FACTOR_KEY, 1.0) for g in optimizer.param_groups]
        self._factor = optimizer.param_groups[0].get(LR_FACTOR_KEY, 1.0) if optimizer.param_groups else 1.0
        self._weight_decays = [g.get("weight_decay") for g in optimizer.param_groups]
        # The first group's weight decay of the last step scaled, for the metrics.
        self.last_weight_decay: Optional[float] = None

    def base_lrs(self) -> List[float]:
        if self.lr_scheduler is not None:
            lrs = list(self.lr_scheduler.get_last_lr())
            groups = len(self.optimizer.param_groups)
            # A scheduler of one of several optimizers (optimizer-in-backward) sets them all.
            return lrs if len(lrs) == groups else lrs[:1] * groups
        return list(self._initial)

    def apply(self, *, samples: float, tokens: float) -> float:
        """Scales the LR for a step on ``samples`` samples holding ``tokens`` real tokens.

        Returns:
            The LR of the first param group, as the step will use it.
        """
        return self.apply_factors(self.lr_rule.factors(samples=samples, tokens=tokens))

    def apply_factors(self, scaling: BatchScaling) -> float:
        """Sets the LR (and with ``timescale`` the weight decay) of a step whose factors are
        ``scaling``; returns the first param group's LR, as the step will use it."""
        self._unscaled = self.base_lrs()
        self._factor = scaling.lr_factor
        self._set_lrs(self._unscaled, scaling.lr_factor)
        if self.weight_decay_scaling == "timescale":
            for group, base in zip(self.optimizer.param_groups, self._weight_decays):
                group["weight_decay"] = base * scaling.weight_decay_factor
            self.last_weight_decay = self.optimizer.param_groups[0]["weight_decay"]
        return self.optimizer.param_groups[0]["lr"]

    def restore(self) -> None:
        """Puts the unscaled LRs back after the step, so a chainable scheduler (one that
        multiplies the current LR, e.g. ``StepLR``) never compounds the factor; :meth:`hold`
        scales them again once the scheduler has stepped."""
        if hasattr(self, "_unscaled"):
            self._set_lrs(self._unscaled, 1.0)
        if self.weight_decay_scaling != "none":
            for group, base in zip(self.optimizer.param_groups, self._weight_decays):
                group["weight_decay"] = base

    def hold(self) -> None:
        """Sets the LR in force between steps: the schedule's LR times the last step's factor,
        so whatever reads the optimizer (a log, ``LearningRateMonitor``, a checkpoint) sees it."""
        self._set_lrs(self.base_lrs(), self._factor)

    def _set_lrs(self, bases: List[float], factor: float) -> None:
        for group, base in zip(self.optimizer.param_groups, bases):
            group["lr"] = base * factor
            group[LR_FACTOR_KEY] = factor
