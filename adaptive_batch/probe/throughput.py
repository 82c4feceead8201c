"""Picking the fastest batch rather than the largest (Cerebras' automatic batch exploration).

Past some size a bigger batch stops training faster per sample: the device is already busy,
and the bigger batch only costs memory and, through the LR, stability. With the objective
``throughput`` the probe times real steps at candidate sizes up to the largest that fits and
keeps the *smallest* batch within ``tolerance`` of the best samples per second.
"""

from contextlib import nullcontext
from dataclasses import asdict, dataclass
import time
from typing import Callable, ContextManager, List, Optional

import torch

import adaptive_batch.logs as logs
from adaptive_batch.probe.search import powers_of_two
from adaptive_batch.probe.target import ProbeTarget

OBJECTIVES = ("max_fit", "throughput")


@dataclass(frozen=True)
class ThroughputTrial:
    """Timed steps at one batch size."""

    batch_size: int
    seconds_per_step: float
    samples_per_second: float


@dataclass(frozen=True)
class ThroughputChoice:
    """The batch chosen for speed and the timings behind it."""

    batch_size: int
    best_samples_per_second: float
    tolerance: float
    trials: List[ThroughputTrial]

    def to_dict(self) -> dict:
        return asdict(self)


def throughput_candidates(max_batch_size: int) -> List[int]:
    """Powers of two below the largest batch that fits, and that batch."""
    return powers_of_two(max_batch_size - 1) + [max_batch_size]


def choose_by_throughput(
    seconds_per_step: Callable[[int], float],
    candidates: List[int],
    *,
    tolerance: float,
) -> ThroughputChoice:
    """Times each candidate (a line each) and keeps the smallest within ``tolerance`` of the best rate.

    Args:
        seconds_per_step: the seconds one training step takes at a batch size.
        candidates: the sizes to time.
        tolerance: fraction of the best samples per second a smaller batch may fall short by.

    Raises:
        ValueError: with no candidates or a tolerance outside ``[0, 1)``.
    """
    if not candidates:
        raise ValueError("no batch sizes to time.")
    if not 0 <= tolerance < 1:
        raise ValueError(f"throughput_tolerance={tolerance!r} must be in [0, 1): e.g. 0.02 for 2%.")
    trials = []
    for b in sorted(set(candidates)):
        seconds = seconds_per_step(b)
        trials.append(ThroughputTrial(b, seconds, b / seconds))
        logs.info(f"throughput trial: batch_size={b} {b / seconds:.1f} samples/s ({seconds:.3f}s a step)")
    best = max(t.samples_per_second for t in trials)
    chosen = min(t.batch_size for t in trials if t.samples_per_second >= (1 - tolerance) * best)
    return ThroughputChoice(batch_size=chosen, best_samples_per_second=best, tolerance=tolerance, trials=trials)


def probe_throughput(
    target: ProbeTarget,
    *,
    max_batch_size: int,
    tolerance: float,
    timed_steps: int = 2,
    snapshot_dir: Optional[str] = None,
    trial_limit: Optional[Callable[[], ContextManager]] = None,
) -> ThroughputChoice:
    """Times real training steps of ``target`` at :func:`throughput_candidates` of
    ``max_batch_size``; its model, optimizer, scheduler and the RNG are restored afterwards.

    Each size runs one untimed step (allocations, kernel choice) and then ``timed_steps``,
    inside ``trial_limit()`` when given (the probe's memory limit).

    Raises:
        ValueError: see :func:`choose_by_throughput`.
    """

    def seconds_per_step(batch_size: int) -> float:
        batch = target.make_batch(batch_size)
        # A fresh dict a step: a step may pop from it (the recipes pop "labels").
        target.train_step(dict(batch) if isinstance(batch, dict) else batch)
        _synchronize(target.device)
        start = time.perf_counter()
        for _ in range(timed_steps):
            target.train_step(dict(batch) if isinstance(batch, dict) else batch)
        _synchronize(target.device)
        return (time.perf_counter() - start) / timed_steps

    with target.snapshot(snapshot_dir), (trial_limit() if trial_limit is not None else nullcontext()):
        return choose_by_throughput(
            seconds_per_step, throughput_candidates(max_batch_size), tolerance=tolerance
        )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
