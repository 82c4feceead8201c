"""The gradient noise scale: the batch the gradient itself asks for.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training") show that training up to
the *critical batch* ``B_noise = tr(Sigma) / |G|^2`` loses little per sample, and past it mostly
wastes samples (``G`` is the true gradient, ``Sigma`` the per-sample gradient covariance). Both
terms come from gradient norms at two batch sizes, because a mean over ``B`` independent
samples has ``E|G_B|^2 = |G|^2 + tr(Sigma) / B`` (their Appendix A.1):

    |G|^2    ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

A step run as micro-batches (or on several ranks) has both for free: the micro-batches' own
gradients are the small batches, the step's is the big one. One step's estimates are noisy (the
|G|^2 one may be negative), so :class:`GradientNoiseScale` keeps exponential moving averages of
both and reports the ratio of the averages, as the paper does.
"""

from dataclasses import dataclass
import math
from typing import Any, Callable, Dict, Optional, Sequence

from adaptive_batch.errors import ConfigError

NOISE_SCALE_STATE_KEY = "gradient_noise_scale"
NOISE_SCALE_ESTIMATORS = ("micro_batches", "norm_layers")


@dataclass(frozen=True)
class NoiseEstimate:
    """One step's unbiased estimates.

    Attributes:
        gradient_sq: the estimate of ``|G|^2``.
        trace: the estimate of ``tr(Sigma)``, per unit of batch (a sample or a token).
    """

    gradient_sq: float
    trace: float


def estimate_noise(
    small_sq_norms: Sequence[float], small_sizes: Sequence[float], big_sq_norm: float, big_size: float
) -> NoiseEstimate:
    """The two unbiased estimates from one step.

    Args:
        small_sq_norms: ``|g_i|^2`` of each part's mean gradient (a micro-batch, a rank).
        small_sizes: each part's size (samples or tokens); unequal sizes enter through the
            mean of ``1/size``, which is what the mean of ``|g_i|^2`` is unbiased for.
        big_sq_norm: ``|g|^2`` of the whole step's mean gradient.
        big_size: the step's size, the sum of ``small_sizes``.

    Raises:
        ValueError: with fewer than two parts, or sizes that are not positive.
    """
    if len(small_sq_norms) < 2 or len(small_sq_norms) != len(small_sizes):
        raise ValueError("the noise scale needs at least two parts of a step, each with its size.")
    if min(small_sizes) <= 0 or big_size <= 0:
        raise ValueError(f"sizes must be positive: parts {list(small_sizes)}, step {big_size}.")
    inv_small = sum(1.0 / s for s in small_sizes) / len(small_sizes)
    return estimate_noise_from_means(sum(small_sq_norms) / len(small_sq_norms), inv_small, big_sq_norm, big_size)


def estimate_noise_from_means(
    small_sq_norm: float, small_inverse_size: float, big_sq_norm: float, big_size: float
) -> NoiseEstimate:
    """:func:`estimate_noise` from the parts' mean ``|g_i|^2`` and mean ``1/size``: what
    per-example parts, summed over ranks, come to."""
    inv_big = 1.0 / big_size
    trace = (small_sq_norm - big_sq_norm) / (small_inverse_size - inv_big)
    return NoiseEstimate(gradient_sq=big_sq_norm - trace * inv_big, trace=trace)


@dataclass(frozen=True)
class StepNoise:
    """One step's noise estimates and the tokens they are per (all ranks)."""

    estimate: NoiseEstimate
    tokens: float


class GradientNoiseScale:
    """Moving averages of ``|G|^2`` and ``tr(Sigma)``, and their ratio ``B_noise``.

    Args:
        ema_decay: weight of the past in each average (0.95: about the last 20 steps).

    Raises:
        ConfigError: for a decay outside ``[0, 1)``.
    """

    def __init__(self, ema_decay: float = 0.95) -> None:
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0 <= ema_decay < 1:
            raise ConfigError(f"noise_scale_ema={ema_decay!r} must be a number in [0, 1), e.g. 0.95.")
        self.ema_decay = float(ema_decay)
        self._gradient_sq = 0.0
        self._trace = 0.0
        self._weight = 0.0  # sum of the weights so far: the averages are bias-corrected by it
        self.updates = 0

    def update(self, estimate: NoiseEstimate) -> Optional[float]:
        """Folds one step's estimates in; returns :attr:`value`. Non-finite ones are skipped."""
        if math.isfinite(estimate.gradient_sq) and math.isfinite(estimate.trace):
            d = self.ema_decay
            self._gradient_sq = d * self._gradient_sq + (1 - d) * estimate.gradient_sq
            self._trace = d * self._trace + (1 - d) * estimate.trace
            self._weight = d * self._weight + (1 - d)
            self.updates += 1
        return self.value

    @property
    def gradient_sq(self) -> Optional[float]:
        return self._gradient_sq / self._weight if self._weight else None

    @property
    def trace(self) -> Optional[float]:
        return self._trace / self._weight if self._weight else None

    @property
    def value(self) -> Optional[float]:
        """``B_noise`` in the unit of the sizes given (``None`` until ``|G|^2`` averages above 0)."""
        if not self._weight or self._gradient_sq <= 0:
            return None
        return self._trace / self._gradient_sq

    def state_dict(self) -> Dict[str, Any]:
        return {
            "ema_decay": self.ema_decay,
            "gradient_sq": self._gradient_sq,
            "trace": self._trace,
            "weight": self._weight,
            "updates": self.updates,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the averages (the decay stays the configured one)."""
        self._gradient_sq = float(state["gradient_sq"])
        self._trace = float(state["trace"])
        self._weight = float(state["weight"])
        self.updates = int(state["updates"])


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class MicroBatchGradients:
    """Each micro-batch's own gradient norm, read from the accumulating ``.grad``.

    After micro-batch ``i``'s backward the accumulated gradient is ``S_i``; its own part is
    ``S_i - S_{i-1}``. Keeping ``S_{i-1}`` costs one copy of the (local, under FSDP2 sharded)
    gradients, allocated once by :meth:`allocate` (before the probe, so the probe counts it).

    Args:
        params: the trainable parameters.
    """

    def __init__(self, params: Sequence[Any]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._previous: Optional[list] = None
        self.sq_norms: list = []
        self.tokens: list = []

    def allocate(self) -> None:
        """The copy of the gradients, held for the run."""
        import torch

        self._previous = [torch.zeros_like(local_tensor(p), dtype=torch.float32) for p in self.params]

    @property
    def held(self) -> list:
        """The copy of the gradients, which the run holds through every step."""
        return list(self._previous or [])

    def start(self) -> None:
        """A step (or its retry) begins: gradients are zero."""
        if self._previous is None:
            self.allocate()
        for buffer in self._previous:
            buffer.zero_()
        self.sq_norms, self.tokens = [], []

    def after_micro_batch(self, tokens: Any) -> None:
        """Records the micro-batch's own squared norm (summed-loss units) and its tokens, as
        tensors on the device: nothing waits for the device until the step is done."""
        total = 0.0
        for p, previous in zip(self.params, self._previous):
            if p.grad is None:
                continue
            grad = local_tensor(p.grad).float()
            total = total + (grad - previous).pow(2).sum()
            previous.copy_(grad)
        self.sq_norms.append(total)
        self.tokens.append(tokens)

    def before_micro_batch(self, piece: Any) -> None:
        """Nothing to read before a micro-batch: its gradient is read after."""

    def step_sq_norm(self) -> Any:
        """The whole step's squared norm (summed-loss units), before any scaling: the copy
        holds the accumulated gradient after the last micro-batch."""
        return sum(b.pow(2).sum() for b in self._previous)

    def step_noise(self, ranks: Any) -> Optional[StepNoise]:
        """The step's estimates from its micro-batches (``None`` with fewer than two).

        Args:
            ranks: the data-parallel ranks (a :class:`~adaptive_batch.distributed.RankGroup`).
        """
        n = len(self.sq_norms)
        if n < 2:
            return None
        # Sharded gradients: a norm is the sum of the ranks' local ones; tokens are all ranks'.
        totals = ranks.sums(*self.sq_norms, *self.tokens, self.step_sq_norm())
        sq, tokens, step_sq = totals[:n], totals[n : 2 * n], totals[-1]
        # .grad holds summed-loss gradients averaged over ranks: per-token means need x world / tokens.
        world = ranks.world_size
        means = [s * world**2 / t**2 for s, t in zip(sq, tokens)]
        step_tokens = sum(tokens)
        return StepNoise(estimate_noise(means, tokens, step_sq * world**2 / step_tokens**2, step_tokens), step_tokens)


@dataclass(frozen=True, kw_only=True)
class NoiseScaleOptions:
    """Measuring the gradient noise scale; checks itself when built.

    Attributes:
        measure_noise_scale: log ``gradient_noise_scale`` every step the estimator can read.
        noise_scale_estimator: ``"micro_batches"`` compares the gradients of a step's
            micro-batches (steps of two or more; costs one copy of the gradients in memory and a
            norm per micro-batch); ``"norm_layers"`` compares each example's gradient of the
            LayerNorm/RMSNorm weights with the step's (Gray et al. 2024: every step, no copy of
            the gradients, a few elementwise passes; holds each such layer's input until its
            backward; models with such layers).
        noise_scale_ema: the moving averages' decay.
        noise_scale_split_step: run a step that would be one micro-batch as two halves, so
            there are two gradients to compare (one device, no accumulation). The update is the
            same; the cost is a second, half-size forward and backward per step.

    Raises:
        ConfigError: for a bad value, or a split without the measurement.
    """

    measure_noise_scale: bool = False
    noise_scale_estimator: str = "micro_batches"
    noise_scale_ema: float = 0.95
    noise_scale_split_step: bool = False

    def __post_init__(self) -> None:
        from adaptive_batch.validation import check_bool

        check_bool("measure_noise_scale", self.measure_noise_scale)
        check_bool("noise_scale_split_step", self.noise_scale_split_step)
        GradientNoiseScale(self.noise_scale_ema)  # checks the decay
        if self.noise_scale_estimator not in NOISE_SCALE_ESTIMATORS:
            raise ConfigError(
                f"noise_scale_estimator={self.noise_scale_estimator!r}: use one of "
                f"{', '.join(repr(e) for e in NOISE_SCALE_ESTIMATORS)}."
            )
        if self.noise_scale_split_step and self.noise_scale_estimator == "norm_layers":
            raise ConfigError(
                "noise_scale_split_step=True with noise_scale_estimator='norm_layers': per-example norms need no "
                "split (every step is measured); set noise_scale_split_step=False."
            )
        if self.noise_scale_split_step and not self.measure_noise_scale:
            raise ConfigError(
                "noise_scale_split_step=True with measure_noise_scale=False: the split only serves the "
                "measurement; set measure_noise_scale=True or noise_scale_split_step=False."
            )


def noise_scale_growth(*, max_factor: float = 2.0, target_fraction: float = 1.0) -> Callable[..., int]:
    """A batch increase function that grows the global batch toward the measured critical
    batch ``B_noise`` (McCandlish et al. 2018: below it, a larger batch buys nearly
    proportionally fewer steps; above it, little).

    At each boundary of ``batch_increase_interval`` the batch moves to
    ``target_fraction x B_noise``, by at most ``max_factor`` times the current batch, and never
    down: a noise scale at or under the batch (or not measured yet) leaves it. The recipe's
    bound (what fits, or with ``grow_with_accumulation`` an epoch's samples) still clamps it.
    Needs ``measure_noise_scale: True``; with steps of one micro-batch on one device, also
    ``noise_scale_split_step: True``.

    Raises:
        ValueError: for ``max_factor`` not above 1 or ``target_fraction`` not above 0 (or not
            finite).
    """
    bad = [
        f"{name}={value!r}"
        for name, value, low in (("max_factor", max_factor, 1.0), ("target_fraction", target_fraction, 0.0))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= low
    ]
    if bad:
        raise ValueError(
            f"noise_scale_growth({', '.join(bad)}): max_factor must be a finite number above 1 (the most the batch "
            "grows at one boundary, e.g. 2) and target_fraction one above 0 (the share of B_noise aimed at, e.g. 1)."
        )

    def grow_toward_noise_scale(k: int, current_batch_size: int, *, stats: Optional[Any] = None) -> int:
        noise = None if stats is None else stats.gradient_noise_scale
        if noise is None or not math.isfinite(noise) or noise <= 0:
            return 0
        target = min(target_fraction * noise, current_batch_size * max_factor)
        return max(0, int(target) - current_batch_size)

    grow_toward_noise_scale.needs_gradient_noise_scale = True
    return grow_toward_noise_scale
