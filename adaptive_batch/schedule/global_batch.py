"""A fixed global batch, split into the micro-batches this device can run.

With ``use_maximum_batch_size`` alone the probed batch becomes the batch, so the optimisation a
user tuned changes with the card. ``global_batch_size`` keeps the batch they tuned (samples per
optimizer step, all ranks) and lets the probe choose only the micro-batch, as Composer's
``device_train_microbatch_size: auto`` does; the accumulation follows. An out-of-memory error
later halves the micro-batch, never the global batch, so the LR never changes.

A rank's share is split into the fewest micro-batches that fit, as equal as possible (24 in
three of 8, not 10 + 10 + 4). With the throughput objective the probe's timings pick the split
with the shortest estimated step, preferring one that divides the share evenly (the Cerebras
seed's rule) when it is within the tolerance of the fastest.
"""

from dataclasses import asdict, dataclass
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from adaptive_batch.errors import ConfigError
from adaptive_batch.validation import check_positive_int

KEY = "global_batch_size"


def micro_batch_sizes(batch_size: int, micro_batch_limit: int, min_micro_batches: int = 1) -> List[int]:
    """Splits ``batch_size`` rows into the fewest micro-batches of at most ``micro_batch_limit``
    (and at least ``min_micro_batches`` where there are rows enough), sizes differing by at
    most one (largest first).

    Raises:
        ValueError: if either is under 1.
    """
    if batch_size < 1 or micro_batch_limit < 1:
        raise ValueError(f"cannot split a batch of {batch_size} into micro-batches of at most {micro_batch_limit}.")
    count = max(math.ceil(batch_size / micro_batch_limit), min(min_micro_batches, batch_size))
    base, extra = divmod(batch_size, count)
    return [base + 1] * extra + [base] * (count - extra)


def equal_micro_batches(batch_size: int, largest: int) -> Tuple[int, int]:
    """``(micro_batch_size, micro_batches)``: ``batch_size`` in the fewest equal micro-batches of
    at most ``largest`` (for a loop that accumulates by count: 64 where 7 fit, 16 x 4).

    Raises:
        ValueError: if either is under 1.
    """
    if batch_size < 1 or largest < 1:
        raise ValueError(f"cannot split a batch of {batch_size} into micro-batches of at most {largest}.")
    count = next(c for c in range(math.ceil(batch_size / largest), batch_size + 1) if batch_size % c == 0)
    return batch_size // count, count


def micro_batches_per_trial(
    micro_batch_size: int,
    *,
    gradient_accumulation_steps: int = 1,
    global_batch_size: Optional[int] = None,
    world_size: int = 1,
    grow_with_accumulation: bool = False,
) -> int:
    """How many micro-batches a memory trial (the probe's real one, the planner's fake one) runs
    at ``micro_batch_size`` before its optimizer step: 2 where a training step may hold more
    samples than one micro-batch (accumulation, a global batch larger than the ranks' micro-batches,
    growth by accumulation), so the first one's gradients are alive through the next forward, as in
    training (more micro-batches hold no more); else 1. A trial of one micro-batch under-measured
    such a step by up to a copy of the trainable gradients."""
    if gradient_accumulation_steps > 1 or grow_with_accumulation:
        return 2
    return 2 if global_batch_size is not None and micro_batch_size * world_size < global_batch_size else 1


@dataclass(frozen=True, kw_only=True)
class GlobalBatchOptions:
    """The fixed-global-batch setting; it checks itself when built.

    Attributes:
        global_batch_size: samples per optimizer step over all ranks, or ``None`` for
            ``batch_size x gradient_accumulation_steps`` per rank (torchtune's meaning).

    Raises:
        ConfigError: for a value that is not a positive int or null.
    """

    global_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        check_positive_int(KEY, self.global_batch_size, allow_none=True)


@dataclass(frozen=True)
class GlobalBatchSplit:
    """How one step's global batch runs.

    Attributes:
        global_batch_size: samples per optimizer step, all ranks.
        per_rank: one rank's share.
        micro_batch_limit: the most samples one forward/backward may hold.
        micro_batch_size: the largest micro-batch the share splits into.
        gradient_accumulation_steps: micro-batches a step.
        even: whether all micro-batches have the same size.
        chosen_by: ``"max_fit"``, ``"throughput"`` or ``"batch_size"`` (no probe).
    """

    global_batch_size: int
    per_rank: int
    micro_batch_limit: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    even: bool
    chosen_by: str

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        split = "even" if self.even else "as equal as possible"
        return (
            f"global_batch_size={self.global_batch_size}: {self.per_rank} samples a rank a step in "
            f"{self.gradient_accumulation_steps} micro-batches of up to {self.micro_batch_size} ({split})"
        )


def check_global_batch(global_batch_size: int, *, world_size: int, gradient_accumulation_steps: int) -> int:
    """Checks a global batch against the ranks and returns one rank's share.

    Raises:
        ConfigError: when it does not divide among the ranks, or an accumulation is also set.
    """
    if global_batch_size % world_size:
        raise ConfigError(
            f"{KEY}={global_batch_size} does not divide among {world_size} ranks: use a multiple of "
            f"{world_size}, e.g. {KEY}={max(1, global_batch_size // world_size) * world_size}."
        )
    if gradient_accumulation_steps != 1:
        raise ConfigError(
            f"gradient_accumulation_steps={gradient_accumulation_steps} with {KEY}={global_batch_size}: "
            "the accumulation follows from the global batch and the micro-batch that fits; set "
            "gradient_accumulation_steps=1."
        )
    return global_batch_size // world_size


def split_global_batch(
    global_batch_size: int, *, world_size: int, largest_micro_batch: int, chosen_by: str = "max_fit"
) -> GlobalBatchSplit:
    """The fewest micro-batches of at most ``largest_micro_batch`` that hold a rank's share.

    Raises:
        ValueError: for sizes under 1.
    """
    if min(global_batch_size, world_size, largest_micro_batch) < 1:
        raise ValueError("global_batch_size, world_size and largest_micro_batch must be at least 1.")
    share = global_batch_size // world_size
    limit = min(largest_micro_batch, share)
    steps = math.ceil(share / limit)
    return GlobalBatchSplit(
        global_batch_size=global_batch_size,
        per_rank=share,
        micro_batch_limit=limit,
        micro_batch_size=math.ceil(share / steps),
        gradient_accumulation_steps=steps,
        even=share % steps == 0,
        chosen_by=chosen_by,
    )


def fastest_split(
    global_batch_size: int, *, world_size: int, trials: Sequence[Tuple[int, float]], tolerance: float
) -> GlobalBatchSplit:
    """The split with the shortest estimated step, from timed steps at several batch sizes.

    A step of a rank's share in micro-batches of up to ``b`` is estimated at
    ``ceil(share / b)`` steps of ``b`` (an upper bound when the split is uneven). Within
    ``tolerance`` of the fastest, an even split wins, then the fewest micro-batches.

    Args:
        trials: the probe's throughput trials, as (batch size, seconds a step) pairs.

    Raises:
        ValueError: with no trials.
    """
    if not trials:
        raise ValueError("no throughput trials to choose a micro-batch from.")
    plans = []
    for batch_size, seconds_per_step in trials:
        plan = split_global_batch(
            global_batch_size, world_size=world_size, largest_micro_batch=int(batch_size), chosen_by="throughput"
        )
        plans.append((plan.gradient_accumulation_steps * float(seconds_per_step), plan))
    best = min(seconds for seconds, _ in plans)
    close = [plan for seconds, plan in plans if seconds <= (1 + tolerance) * best]
    return min(close, key=lambda p: (not p.even, p.gradient_accumulation_steps, -p.micro_batch_limit))
