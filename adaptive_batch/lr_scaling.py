"""Learning rate scaled with the batch: the linear and square-root rules.

Linear (Goyal et al.): multiply the LR by ``k`` when the batch grows ``k`` times. Square root
(Krizhevsky): multiply by ``sqrt(k)``, keeping the gradient's variance constant. The base LR
comes from the optimizer's configured value or from an LR scheduler, and the factor multiplies
it, so any torchtune scheduler composes with it.
"""

import math
from typing import Any, List, Optional

import torch

LR_SCALING_RULES = ("none", "linear", "sqrt")
LR_SCALING_UNITS = ("samples", "tokens")


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


class BatchLRScaler:
    """Sets each param group's LR to ``base x factor(batch)`` before an optimizer step.

    Args:
        optimizer: the optimizer whose param groups are scaled.
        rule: ``"none"``, ``"linear"`` or ``"sqrt"``.
        reference: the batch (in ``unit``) the configured LR was set for.
        unit: ``"samples"`` or ``"tokens"`` (real, non-padding tokens).
        lr_scheduler: when given, its last LR is the base; else the LR the optimizer had when
            the scaler was made.

    Raises:
        ValueError: for an unknown rule or unit, or a non-positive reference.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        rule: str,
        reference: float,
        unit: str = "samples",
        lr_scheduler: Optional[Any] = None,
    ) -> None:
        lr_scale_factor(1, 1, rule)
        if unit not in LR_SCALING_UNITS:
            raise ValueError(f"lr_scaling_unit={unit!r} is not one of {list(LR_SCALING_UNITS)}.")
        if rule != "none" and (isinstance(reference, bool) or not reference or reference <= 0):
            raise ValueError(
                f"lr_scaling_reference={reference!r} must be a positive number of {unit}: the batch "
                "the configured LR was tuned for."
            )
        self.optimizer = optimizer
        self.rule = rule
        self.reference = reference
        self.unit = unit
        self.lr_scheduler = lr_scheduler
        self._initial = [g["lr"] for g in optimizer.param_groups]

    def base_lrs(self) -> List[float]:
        if self.lr_scheduler is not None:
            return list(self.lr_scheduler.get_last_lr())
        return list(self._initial)

    def apply(self, *, samples: int, tokens: int) -> float:
        """Scales the LR for a step on ``samples`` samples holding ``tokens`` real tokens.

        Returns:
            The LR of the first param group, as the step will use it.
        """
        batch = samples if self.unit == "samples" else tokens
        factor = lr_scale_factor(batch, self.reference, self.rule)
        self._unscaled = self.base_lrs()
        for group, base in zip(self.optimizer.param_groups, self._unscaled):
            group["lr"] = base * factor
        return self.optimizer.param_groups[0]["lr"]

    def restore(self) -> None:
        """Puts the unscaled LRs back after the step, so a chainable scheduler (one that
        multiplies the current LR, e.g. ``StepLR``) never compounds the factor."""
        for group, base in zip(self.optimizer.param_groups, getattr(self, "_unscaled", [])):
            group["lr"] = base
