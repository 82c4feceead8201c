"""A probe trial on every data-parallel rank, with one outcome all ranks agree on.

With FSDP every forward and backward runs collectives, so ranks must try the same batch sizes in
the same order. :class:`LockstepTrial` wraps a probe's trial: each rank measures its own peak
against its own budget, the ranks all-reduce the largest overshoot, and every rank hands the
search ``common budget + largest overshoot`` (or an out-of-memory error if any rank ran out).
The search then takes identical branches on every rank and ends at the largest batch that fits
on all of them: the minimum over ranks. On one process it is the trial itself.
"""

from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import PeerOutOfMemoryError
from adaptive_batch.memory.oom import catch_oom, release_memory
from adaptive_batch.memory.tracker import STEP_PHASES, StepMemory

# Marks a rank that ran out of memory in the all-reduced overshoot (far above any real peak),
# and a phase a rank did not measure (far below).
_OUT_OF_MEMORY = 1 << 62
_NOT_MEASURED = -(1 << 62)


@dataclass
class RankTrial:
    """One probe trial as this rank saw it."""

    batch_size: int
    peak_bytes: Optional[int]
    oom: bool
    fits_here: bool



class LockstepTrial:
    """A probe trial run on every rank, whose outcome all ranks agree on.

    Call it as the search's ``run_trial``: it returns ``common_budget_bytes`` plus the largest
    overshoot of any rank's peak over that rank's own budget, so the search's "fits" (peak
    within the common budget) means "fits on every rank". If any rank ran out of memory,
    every rank raises :class:`PeerOutOfMemoryError`. ``trials`` keeps what this rank measured.
    """

    def __init__(
        self, ranks: RankGroup, run_trial: Callable[[int], int], *, budget_bytes: int, common_budget_bytes: int
    ) -> None:
        self.ranks = ranks
        self.run_trial = run_trial
        self.budget_bytes = budget_bytes
        self.common_budget_bytes = common_budget_bytes
        self.trials: List[RankTrial] = []

    def __call__(self, batch_size: int) -> Union[int, Dict[str, int], StepMemory]:
        """Runs the trial on this rank; returns the peak every rank agrees on.

        That is ``common_budget_bytes`` plus the largest overshoot of any rank over its own
        budget (for the step, and for each phase when phases are measured): not a peak any
        rank measured, but one that is within the common budget exactly when the step fits
        on every rank.

        Raises:
            PeerOutOfMemoryError: on every rank, when any rank ran out of memory.
        """
        smaller_ran = any(not t.oom and t.batch_size < batch_size for t in self.trials)
        measured, failure = catch_oom(lambda: self.run_trial(batch_size), after_a_smaller_step=smaller_ran)
        if failure is not None:
            release_memory()
        if isinstance(measured, StepMemory):
            if not self.ranks.distributed:
                self.trials.append(RankTrial(batch_size, measured.peak_bytes, False, measured.peak_bytes <= self.budget_bytes))
                return measured  # one rank: its own measurement, timeline and all
            measured = measured.phase_peak_bytes  # ranks agree on phases; each has its own timeline
        phases = dict(measured) if isinstance(measured, Mapping) else {}
        peak = None if measured is None else (max(phases.values()) if phases else int(measured))
        if peak is None:
            overshoots = [_OUT_OF_MEMORY] * (1 + len(STEP_PHASES))
        else:
            overshoots = [peak - self.budget_bytes] + [
                phases[name] - self.budget_bytes if name in phases else _NOT_MEASURED for name in STEP_PHASES
            ]
        self.trials.append(RankTrial(batch_size, peak, failure is not None, peak is not None and overshoots[0] <= 0))
        worst = self.ranks.max_each(overshoots)
        if worst[0] >= _OUT_OF_MEMORY:
            here = f"this rank: {failure}" if failure is not None else "another rank"
            raise PeerOutOfMemoryError(f"batch_size={batch_size} ran out of memory ({here})")
        if not phases:
            return self.common_budget_bytes + worst[0]
        return {
            name: self.common_budget_bytes + w for name, w in zip(STEP_PHASES, worst[1:]) if w > _NOT_MEASURED
        }

    def report(self) -> Dict[str, Any]:
        """This rank's budget and trials, for the probe report."""
        peaks = [t.peak_bytes for t in self.trials if t.peak_bytes is not None]
        return {
            "rank": self.ranks.rank,
            "budget_bytes": self.budget_bytes,
            # The largest peak this rank measured, as a multiple of its own budget.
            "max_overshoot": max(peaks) / self.budget_bytes if peaks else None,
            "trials": [asdict(t) for t in self.trials],
        }
