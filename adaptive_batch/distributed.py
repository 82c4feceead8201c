"""Decisions every data-parallel rank must take together, and the per-rank memory budget.

With FSDP every forward and backward runs collectives (all-gather, reduce-scatter), so ranks
must run the same steps in the same order: the same trial batch sizes while probing, the same
number of micro-batches in a step, the same batch after growth. :class:`RankGroup` gives the few
agreements the recipes need: a maximum, sums, an "any rank", a broadcast from rank 0, a gather. Outside
``torch.distributed`` (one process) every agreement is the value itself, so the single-device
recipes run the same code.

:meth:`RankGroup.lockstep_trial` wraps a probe's trial so that all ranks see one outcome: each
rank measures its own peak against its own budget, the ranks all-reduce the largest overshoot,
and every rank hands the search ``common budget + largest overshoot`` (or an out-of-memory
error if any rank ran out). The search then takes identical branches on every rank and ends at
the largest batch that fits on all of them: the minimum over ranks.
"""

from dataclasses import asdict, dataclass
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type, Union

import torch
import torch.distributed as dist

from adaptive_batch.errors import ConfigError, PeerOutOfMemoryError
from adaptive_batch.memory.device import parse_memory
from adaptive_batch.memory.oom import catch_oom, release_memory
from adaptive_batch.memory.tracker import STEP_PHASES, StepMemory
from adaptive_batch.schedule.growth import (
    BatchIncreaseFunction,
    GrowthStatistics,
    call_batch_increase_function,
    function_name,
)

MAX_MEMORY_ENV = "ADAPTIVE_BATCH_MAX_MEMORY"

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


def rank_max_memory(
    config_value: Any, *, capacity_bytes: Optional[int] = None, env: Optional[Mapping[str, str]] = None
) -> Any:
    """This process's ``max_memory``: the config's, unless ``ADAPTIVE_BATCH_MAX_MEMORY`` is set.

    The variable holds one value for every rank of the node (``"20GiB"``), or a comma-separated
    list indexed by ``LOCAL_RANK`` (``"70GiB,40GiB"``) for cards of different sizes in one node.

    Args:
        config_value: the config's ``max_memory``.
        capacity_bytes: this rank's device capacity, to check the value against.
        env: the environment (``os.environ`` when ``None``).

    Raises:
        ValueError: for a list whose length is not the node's rank count, or a bad value.
    """
    env = os.environ if env is None else env
    raw = env.get(MAX_MEMORY_ENV)
    if raw is None or raw.strip() == "":
        return config_value
    values = [v.strip() for v in raw.split(",")]
    if len(values) > 1:
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(len(values))))
        if len(values) != local_world:
            raise ValueError(
                f"{MAX_MEMORY_ENV}={raw!r} lists {len(values)} values for {local_world} ranks on this "
                "node: give one value, or one per local rank."
            )
        value = values[local_rank]
    else:
        value = values[0]
    parse_memory(value, capacity_bytes=capacity_bytes, key=f"{MAX_MEMORY_ENV} (this rank's value of {raw!r})")
    return value


class RankGroup:
    """The data-parallel ranks of a run (the default process group), or this process alone.

    Args:
        device: where collective tensors live (the CUDA device for NCCL, the CPU for gloo).
    """

    def __init__(self, device: torch.device) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.device = device if self.distributed and dist.get_backend() == "nccl" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def max(self, value: int) -> int:
        """The largest ``value`` over ranks."""
        if not self.distributed:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def max_each(self, values: List[int]) -> List[int]:
        """Each of ``values`` maximised over ranks, in one all-reduce."""
        if not self.distributed:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def sums(self, *values: Any) -> List[float]:
        """Each of ``values`` (numbers or one-element tensors) summed over ranks, in one
        all-reduce (as float64)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return self.max(int(bool(flag))) == 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable objects)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def decide_on_main(self, decide: Callable[[], Any], errors: Tuple[Type[BaseException], ...] = ()) -> Any:
        """Runs ``decide`` on rank 0 alone and hands its result to every rank.

        Raises:
            BaseException: an error of one of ``errors`` that ``decide`` raised on rank 0 is
                raised on every rank, so all of them stop together with the same message.
        """
        result, error = None, None
        if self.is_main:
            try:
                result = decide()
            except errors as e:
                error = e
        if self.distributed:
            result, error = self.broadcast((result, error))
        if error is not None:
            raise error
        return result

    def check_together(self, check: Callable[[], Any]) -> Any:
        """Runs ``check`` on every rank; when it fails on any rank, every rank stops together.

        Returns:
            What ``check`` returned on this rank.

        Raises:
            ConfigError: on every rank, with the message of the first rank whose ``check``
                raised ``ValueError`` (a ``ConfigError`` included), so no rank is left waiting
                in a collective for one that has gone.
        """
        result, error = None, None
        try:
            result = check()
        except ValueError as e:
            error = str(e)
        for rank, message in enumerate(self.gather(error)):
            if message is not None:
                raise ConfigError(f"rank {rank}: {message}" if self.distributed else message)
        return result

    def lockstep_trial(
        self, run_trial: Callable[[int], int], *, budget_bytes: int, common_budget_bytes: int
    ) -> "LockstepTrial":
        """Wraps ``run_trial`` so every rank's search sees the same outcome; see the module."""
        return LockstepTrial(self, run_trial, budget_bytes=budget_bytes, common_budget_bytes=common_budget_bytes)


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
        measured, failure = catch_oom(lambda: self.run_trial(batch_size))
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



def per_rank_increase(fn: Optional[BatchIncreaseFunction], world_size: int) -> Optional[BatchIncreaseFunction]:
    """``fn`` seen from one rank: the user's function gets and returns global batch sizes
    (per-rank batch x ``world_size``); each rank grows by its share, rounded down so every
    rank keeps the same batch."""
    if fn is None or world_size == 1:
        return fn

    def per_rank(epoch: int, current_batch_size: int, *, stats: Optional[GrowthStatistics] = None) -> int:
        increment = call_batch_increase_function(fn, epoch, current_batch_size * world_size, stats=stats)
        return increment // world_size

    per_rank.needs_gradient_noise_scale = getattr(fn, "needs_gradient_noise_scale", False)

    per_rank.__qualname__ = function_name(fn)
    return per_rank
