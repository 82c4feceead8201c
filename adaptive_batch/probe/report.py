"""The probe's result as one typed record, and its versioned JSON form.

:class:`ProbeReport` is what ``batch_probe.json`` holds, what a recipe state and a probe-cache entry
keep, and what every reader takes: the search's answer, the batch to use,
the trials, the budget and how it was judged, and the fields a run adds later (the global batch's
micro-batch plan, the token budget). :meth:`ProbeReport.to_dict` writes format
:data:`REPORT_FORMAT`; :meth:`ProbeReport.from_dict` also reads the unversioned reports (format 1)
written before it, and refuses a newer format in one line.
"""

from dataclasses import asdict, dataclass, field, fields
import json
import os
from typing import Any, Dict, List, Mapping, Optional

import torch

from adaptive_batch.files import atomic_write
from adaptive_batch.memory.budget import HARD, MemoryBudget
from adaptive_batch.memory.device import DeviceCapacity, format_bytes
from adaptive_batch.probe.search import GuessRecord, SearchResult, Trial, max_overshoot
from adaptive_batch.probe.throughput import ThroughputChoice, ThroughputTrial

PROBE_FILENAME = "batch_probe.json"
# Key of the probe result in the recipe state (recipe_state.pt), so a resumed run does not probe.
PROBE_STATE_KEY = "batch_probe"
# 1: the dict written before the report was typed (no "format" key); 2: this class's form.
REPORT_FORMAT = 2
# Written only when set, as format 1 wrote them: a reader of format 1 takes a key's presence for a value.
_ONLY_WHEN_SET = ("throughput", "cache", "global_batch", "max_tokens", "first_guess", "epoch_share")


@dataclass(frozen=True)
class CacheUse:
    """Whether the report came from the probe cache, and the entry's path."""

    hit: bool
    path: Optional[str]


@dataclass(kw_only=True)
class ProbeReport:
    """What the probe found and how.

    Attributes:
        max_batch_size: the search's answer: the largest size whose trial fitted.
        batch_size: the batch to train with (after the check, rounding and the objective).
        budget_bytes: the budget every rank searched against (the smallest rank's).
        trials: every real step of the search.
        estimate: the fitted line the search started from (its kind and coefficients).
        verified_batch_size: the largest size that ran the consecutive-step check; growth's
            bound. ``None`` in reports that never ran it.
        seq_len: the sequence length of the worst-case batch.
        device: where the steps ran.
        budget: the budget, its source and kind.
        capacity: what the device could hold when the probe began.
        trial_address_space_limit: the soft ``RLIMIT_AS`` the CPU trials ran under.
        batch_size_cap: the largest size the search could answer (dataset, ``max_batch_size``).
        batch_size_objective: ``"max_fit"`` or ``"throughput"``.
        world_size: the data-parallel ranks that agreed on the answer.
        verify_steps: the consecutive steps the check ran (and each child, when the trials ran
            in fresh processes).
        trials_in_fresh_processes: every trial ran in a fresh process (a hard limit in address
            space, with the training parts built again there).
        ranks: what each rank measured against its own budget.
        throughput: the timings behind a throughput choice.
        total_seconds: how long the search took.
        stopped_by_time: the time budget ended the search.
        cache: whether the report came from the cache.
        global_batch: how a fixed global batch runs in micro-batches (added by the run).
        max_tokens: the padded-token budget taken from the answer (added by the run).
        first_guess: the prediction the search was given (fake steps of the model), what it
            cost (counted in ``total_seconds``) and whether it held.
        epoch_share: ``total_seconds`` as a share of one epoch at ``max_batch_size``, its steps
            timed by the search's trial at that size (a trial of two micro-batches, under
            accumulation, takes about twice a step of one, so the share is then understated).
    """

    max_batch_size: int
    batch_size: int
    budget_bytes: int
    trials: List[Trial] = field(default_factory=list)
    estimate: Dict[str, Any] = field(default_factory=dict)
    verified_batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    device: Optional[str] = None
    budget: Optional[MemoryBudget] = None
    capacity: Optional[DeviceCapacity] = None
    trial_address_space_limit: Optional[int] = None
    batch_size_cap: Optional[int] = None
    batch_size_objective: str = "max_fit"
    world_size: int = 1
    verify_steps: Optional[int] = None
    trials_in_fresh_processes: bool = False
    ranks: List[Dict[str, Any]] = field(default_factory=list)
    throughput: Optional[ThroughputChoice] = None
    total_seconds: float = 0.0
    stopped_by_time: bool = False
    cache: Optional[CacheUse] = None
    global_batch: Optional[Dict[str, Any]] = None
    max_tokens: Optional[int] = None
    first_guess: Optional[GuessRecord] = None
    epoch_share: Optional[float] = None

    @property
    def num_trials(self) -> int:
        return len(self.trials)

    @property
    def max_overshoot(self) -> Optional[float]:
        return max_overshoot(self.trials, self.budget_bytes)

    @property
    def largest_that_trains(self) -> int:
        """The largest batch that ran training's consecutive steps (the bound of growth)."""
        return self.batch_size if self.verified_batch_size is None else self.verified_batch_size

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form, format :data:`REPORT_FORMAT` (plain values only: loadable with
        ``torch.load(weights_only=True)`` in a recipe state)."""
        data = {"format": REPORT_FORMAT}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _ONLY_WHEN_SET:
                continue
            if f.name == "trials":
                value = [asdict(t) for t in value]
            elif f.name in _RECORDS:
                value = None if value is None else asdict(value)
            data[f.name] = value
        data.update(num_trials=self.num_trials, max_overshoot=self.max_overshoot)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "ProbeReport":
        """Reads format 1 (the unversioned dict) and 2; unknown keys are ignored.

        Raises:
            ValueError: for a newer format, a missing or non-whole batch size or budget, or
                trials that are not records of trials.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a probe report is an object, not {type(data).__name__}")
        version = data.get("format", 1)
        if not _whole(version) or version > REPORT_FORMAT:
            raise ValueError(
                f"format={version!r}: written by a newer adaptive-batch (this one reads formats 1 to {REPORT_FORMAT}); "
                "upgrade adaptive-batch, or probe again"
            )
        for name in ("max_batch_size", "batch_size", "budget_bytes"):
            if not _whole(data.get(name)):
                raise ValueError(f"{name}={data.get(name)!r} must be a whole number")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        try:
            values["trials"] = [_trial(t) for t in data.get("trials") or []]
            for name, record in _RECORDS.items():
                if values.get(name) is not None:
                    values[name] = record(values[name])
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"a record of the report does not read ({type(e).__name__}: {e})") from None
        return cls(**values)

    def describe(self) -> str:
        """One line for the log: what was found, against which budget, at what cost."""
        budget = self.budget
        # This rank's own budget and where it came from (the search's is the smallest rank's).
        source = "" if budget is None else f" = {budget.limit_words()}"
        guess = self.first_guess
        guessed = f"first guess from {guess.source}" if guess is not None and guess.held else "estimate"
        if guess is not None and not guess.held:
            guessed += f"; the first guess, {guess.batch_size}, did not hold"
        share = "" if self.epoch_share is None else f" ({self.epoch_share:.1%} of an epoch)"
        return (
            f"use_maximum_batch_size: largest batch that fits is {self.max_batch_size} "
            f"({guessed} predicted {self.estimate.get('predicted_max_batch_size')}), budget "
            f"{format_bytes(self.budget_bytes if budget is None else budget.budget_bytes)}{source}; "
            f"{self.num_trials} trial{' processes' if self.trials_in_fresh_processes else ' steps'} in "
            f"{self.total_seconds:.1f}s{share}"
        )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _trial(data: Mapping[str, Any]) -> Trial:
    # Reports written before a field existed lack it; its default stands.
    known = {f.name for f in fields(Trial)}
    values = {k: v for k, v in data.items() if k in known}
    values.setdefault("seconds", 0.0)
    values.setdefault("oom", values.get("peak_bytes") is None and not values.get("fits"))
    values.setdefault("phase", "search")
    return Trial(**values)


def _budget(data: Mapping[str, Any]) -> MemoryBudget:
    return MemoryBudget(**dict({"kind": HARD}, **data))


def _throughput(data: Mapping[str, Any]) -> ThroughputChoice:
    return ThroughputChoice(**dict(data, trials=[ThroughputTrial(**t) for t in data["trials"]]))


_RECORDS = {
    "budget": _budget,
    "capacity": lambda d: DeviceCapacity(**d),
    "throughput": _throughput,
    "cache": lambda d: CacheUse(**d),
    "first_guess": lambda d: GuessRecord(**d),
}


def report_of_search(
    result: SearchResult,
    *,
    batch_size: int,
    seq_len: Optional[int],
    device: torch.device,
    budget: MemoryBudget,
    **run: Any,
) -> ProbeReport:
    """The report of ``result``: the search's fields, the batch to use, and ``run``'s
    (any other :class:`ProbeReport` field: the check, the ranks, the capacity, ...)."""
    return ProbeReport(
        max_batch_size=result.max_batch_size, batch_size=batch_size, budget_bytes=result.budget_bytes,
        trials=list(result.trials), estimate=result.estimate_dict(), total_seconds=result.total_seconds,
        stopped_by_time=result.stopped_by_time,
        first_guess=result.first_guess, seq_len=seq_len, device=str(device), budget=budget, **run,
    )


def write_probe_report(report: ProbeReport, output_dir: str) -> str:
    """Writes ``batch_probe.json`` atomically (never a half-written file) and returns its path."""
    text = json.dumps(report.to_dict(), indent=2) + "\n"
    return atomic_write(os.path.join(output_dir, PROBE_FILENAME), lambda f: f.write(text), text=True)


def read_probe_report(path: str) -> ProbeReport:
    """Reads a ``batch_probe.json``.

    Raises:
        OSError: when it cannot be read.
        ValueError: when it is not JSON or not a report this version reads.
    """
    with open(path) as f:
        return ProbeReport.from_dict(json.load(f))
