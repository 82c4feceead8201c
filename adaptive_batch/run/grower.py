"""Growing the batch during training, and the gradient noise scale growth may follow.

:class:`Grower` calls the user's batch increase function at each boundary of its interval
(every epoch, or every N steps, samples or tokens), decided on rank 0 and taken by every rank,
and folds each step's micro-batch gradients into the gradient noise scale when asked to.
"""

from typing import Any, Callable, Dict, Optional, Union

import torch
from torch import nn

from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import BatchIncreaseFunctionError
import adaptive_batch.logs as logs
from adaptive_batch.run.progress import BatchProgress
from adaptive_batch.schedule.growth import (
    BatchIncreaseFunction,
    GrowthOptions,
    GrowthStatistics,
    call_batch_increase_function,
    function_name,
)
from adaptive_batch.schedule.noise_scale import (
    GradientNoiseScale,
    MicroBatchGradients,
    NoiseScaleOptions,
)
from adaptive_batch.schedule.norm_layer_gradients import NormLayerGradients


class Grower:
    """The growth function and the noise scale of a run. A growth is said at INFO, a growth that
    must wait for the noise scale at WARNING.

    Args:
        growth: the function and its interval.
        noise: whether and how the gradient noise scale is measured.
        ranks: the data-parallel ranks.
    """

    def __init__(
        self,
        growth: GrowthOptions,
        noise: NoiseScaleOptions,
        *,
        ranks: RankGroup,
    ) -> None:
        # The user's function seen from a rank (global sizes in and out), built once.
        self._function = per_rank_increase(growth.batch_increase_function, ranks.world_size)
        self.interval = growth.batch_increase_interval
        self.ranks = ranks
        self.noise_scale = GradientNoiseScale(noise.noise_scale_ema) if noise.measure_noise_scale else None
        self.estimator = noise.noise_scale_estimator
        self.gradients: Optional[Union[MicroBatchGradients, NormLayerGradients]] = None
        self._said_nothing_measured = False
        self._samples_per_token: Optional[float] = None
        self._warned_no_noise = False

    @property
    def active(self) -> bool:
        return self._function is not None

    def state_dict(self) -> Dict[str, Any]:
        return {} if self.noise_scale is None else self.noise_scale.state_dict()

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        if self.noise_scale is not None and state:
            self.noise_scale.load_state_dict(state)

    # ---------------------------------------------------------------- growth

    def start_epoch(self, batch: BatchProgress, epoch: int) -> None:
        """Growth at the epoch's boundary, or at the boundaries an interval has reached."""
        if not self.active:
            return
        if not self.interval.per_epoch:
            self.grow_at_boundaries(batch)
        elif epoch >= batch.intervals_done:
            self._grow(batch, epoch)

    def grow_at_boundaries(self, batch: BatchProgress) -> bool:
        """Every steps, samples or tokens boundary reached and not yet applied, in order;
        whether any was (the sampler then takes the new batch)."""
        if not self.active or self.interval.per_epoch:
            return False
        pending = list(batch.pending_boundaries(self.interval))
        for k in pending:
            self._grow(batch, k)
        return bool(pending)

    def _grow(self, batch: BatchProgress, k: int) -> None:
        """Boundary ``k``'s call, decided on rank 0 and taken by every rank."""
        label = "epoch" if self.interval.per_epoch else "interval"
        function, stats = self._function, self.statistics(batch)
        waiting = stats.gradient_noise_scale is None and stats.global_step > 0
        if waiting and getattr(function, "needs_gradient_noise_scale", False):
            self._warn_no_noise_scale(k)
        decision = self.ranks.decide_on_main(
            lambda: batch.grow_at(function, k, label=label, stats=stats), errors=(BatchIncreaseFunctionError,)
        )
        batch.batch_size, batch.intervals_done = decision.batch_size, k + 1
        # Per epoch, a request held at the bound is said too; per step it would repeat each step.
        asked = decision.requested != decision.previous and self.interval.per_epoch
        if decision.batch_size != decision.previous or asked:
            self._log_growth(batch, k, decision)

    def statistics(self, batch: BatchProgress) -> GrowthStatistics:
        """What a growth function taking ``stats`` sees, in global sizes."""
        return GrowthStatistics(
            global_step=batch.global_step,
            samples_seen=batch.global_samples_seen,
            tokens_seen=batch.tokens_seen,
            gradient_noise_scale=None if self.noise_scale is None else self._noise_in_samples(),
            max_batch_size=batch.growth_bound() * self.ranks.world_size,
        )

    def _warn_no_noise_scale(self, k: int) -> None:
        if self._warned_no_noise:
            return
        self._warned_no_noise = True
        if self.noise_scale.updates:
            why = "its |G|^2 average is not above 0 yet"
        elif self.estimator == "norm_layers":
            why = "it is measured on steps of two or more samples that carry a loss"
        else:
            why = ("it is measured on steps of two or more micro-batches (noise_scale_split_step=True splits steps of one; "
                   "noise_scale_estimator=norm_layers measures every step)")
        logs.warning(f"{self.interval.describe(k).capitalize()}: no gradient noise scale yet, so the batch stays; {why}.")

    def _log_growth(self, batch: BatchProgress, k: int, decision: Any) -> None:
        note = ""
        if decision.clamped:
            why = "an epoch's samples" if decision.bound == batch.samples_per_epoch else "the largest micro-batch"
            note = f" (clamped from {decision.requested} to {decision.bound}, {why})"
        per_rank = f" per rank, x{self.ranks.world_size} ranks" if self.ranks.distributed else ""
        where = self.interval.describe(k).capitalize()
        if not self.interval.per_epoch:
            where += f" at step {batch.global_step}"
        logs.info(f"{where}: batch_size {decision.previous} -> {decision.batch_size}{per_rank}{note}.")

    # ---------------------------------------------------------------- the noise scale

    def track_gradients(self, model: nn.Module, row_tokens: Optional[Callable[[Any], torch.Tensor]] = None) -> None:
        """With ``measure_noise_scale``, what the estimator reads: the gradient copy of
        ``"micro_batches"`` (allocated now, before the probe, so it counts as training state)
        or the hooks of ``"norm_layers"``.

        Args:
            model: the model trained (its parameters do for ``"micro_batches"``).
            row_tokens: a micro-batch's tokens that carry a loss, per example, read before its
                forward (``"norm_layers"`` needs it).

        Raises:
            ConfigError: ``"norm_layers"`` on a model without LayerNorm or RMSNorm weights.
            ValueError: ``"norm_layers"`` without ``row_tokens``.
        """
        if self.noise_scale is None:
            return
        if self.estimator == "norm_layers":
            if row_tokens is None or not isinstance(model, nn.Module):
                raise ValueError(
                    "noise_scale_estimator='norm_layers' needs the model (an nn.Module, not its parameters) and "
                    "row_tokens(micro_batch) -> tokens per sample: pass track_gradients(model, row_tokens=...)."
                )
            self.gradients = NormLayerGradients(model, row_tokens)
            self.gradients.attach()
        else:  # the model, or its parameters as before
            params = model.parameters() if isinstance(model, nn.Module) else model
            self.gradients = MicroBatchGradients(list(params))
            self.gradients.allocate()

    def held_tensors(self) -> list:
        """The tensors the noise scale holds through every step (the micro-batch estimator's copy of
        the gradients), for the probe to count beside the model and optimizer."""
        return getattr(self.gradients, "held", [])

    def measure_noise(self, global_samples: float) -> Optional[float]:
        """Folds the step's micro-batch gradients into the noise scale; returns it in samples
        (``None`` before it can be measured, or when it is not)."""
        step = None if self.gradients is None else self.gradients.step_noise(self.ranks)
        if step is None:
            if self.noise_scale is not None and self._noise_in_samples() is None and not self._said_nothing_measured:
                self._said_nothing_measured = True  # once: a run of such steps logged no noise scale without a word
                logs.warning("measure_noise_scale=True: a step of one micro-batch has no two gradients to compare, so "
                             "gradient_noise_scale is not logged until one has; set noise_scale_split_step=True, or "
                             "noise_scale_estimator=norm_layers to read it from every step.")
            return None if self.noise_scale is None else self._noise_in_samples()
        self.noise_scale.update(step.estimate)
        self._samples_per_token = global_samples / step.tokens
        return self._noise_in_samples()

    def _noise_in_samples(self) -> Optional[float]:
        """The averaged noise scale (per token) in samples, at the last measured step's ratio."""
        value = self.noise_scale.value
        ratio = self._samples_per_token
        return None if value is None or ratio is None else value * ratio


def per_rank_increase(fn: Optional[BatchIncreaseFunction], world_size: int) -> Optional[BatchIncreaseFunction]:
    """``fn`` seen from one rank: the user's function gets and returns global batch sizes
    (per-rank batch x ``world_size``); each rank grows by its share, rounded down so every
    rank keeps the same batch (an increment under ``world_size`` is none, said in a line)."""
    if fn is None or world_size == 1:
        return fn

    def per_rank(epoch: int, current_batch_size: int, *, stats: Optional[GrowthStatistics] = None) -> int:
        increment = call_batch_increase_function(fn, epoch, current_batch_size * world_size, stats=stats)
        if 0 < increment < world_size:
            logs.info(f"adaptive-batch: {function_name(fn)} asked for {increment} more samples at {epoch}, fewer than "
                      f"the {world_size} ranks: every rank keeps the same batch, so the batch stays; return a "
                      f"multiple of {world_size} to grow it.")
        return increment // world_size

    per_rank.needs_gradient_noise_scale = getattr(fn, "needs_gradient_noise_scale", False)

    per_rank.__qualname__ = function_name(fn)
    return per_rank
