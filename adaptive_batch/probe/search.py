"""Finding the largest batch that fits: a linear estimate, then real trials around it.

:func:`search_max_batch_size` knows nothing of models: it calls ``run_trial(batch_size)``, which
runs one real step and returns its peak bytes or raises an out-of-memory error. A size fits when
its step ran and its peak is within the budget. The result is always a size whose trial fitted,
with the size above it tried and failed (or at the cap).
"""

from dataclasses import asdict, dataclass, field
import math
import time
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

from adaptive_batch.errors import BatchSizeTooLargeError
import adaptive_batch.logs as logs
from adaptive_batch.memory.budget import MAX_TRIAL_OVERSHOOT
from adaptive_batch.memory.device import format_bytes
from adaptive_batch.memory.estimator import LinearMemoryEstimate, OperatorMemoryEstimate, PhaseMemoryEstimate
from adaptive_batch.memory.oom import catch_oom, release_memory
from adaptive_batch.memory.tracker import StepMemory

ROUNDING_MODES = ("none", "power_of_two")


@dataclass
class Trial:
    """One real step of the search.

    Attributes:
        batch_size: the size tried.
        fits: it ran, and its peak is within the budget.
        peak_bytes: the step's peak, or ``None`` when it ran out of memory.
        seconds: how long the trial took.
        oom: it ran out of memory.
        phase: the search's phase (``warmup``, ``estimate``, ``guess`` (a first guess's step), ``search``).
        phase_peak_bytes: the peak of each phase of the step, when measured.
        start_bytes: what was live when the step began, when measured.
    """

    batch_size: int
    fits: bool
    peak_bytes: Optional[int]
    seconds: float
    oom: bool
    phase: str
    phase_peak_bytes: Optional[Dict[str, int]] = None
    start_bytes: Optional[int] = None


Estimate = Union[LinearMemoryEstimate, PhaseMemoryEstimate, OperatorMemoryEstimate]


@dataclass(frozen=True)
class FirstGuess:
    """Where the real trials start when something cheaper than real steps predicted the answer
    (the planner's fake steps of the same model): the search tries it first, then its neighbour.

    Attributes:
        batch_size: the predicted largest batch.
        estimate: the line behind the prediction, reported as the search's estimate.
        seconds: what the prediction cost; counted in the search's time.
        source: what made it, for the report and the log.
        added_at: ``(batch, bytes)``: what the predicting step added over its start before the
            optimizer step at that batch. The real warmup then runs at that batch, which adds
            the same where the prediction's steps are the real ones (it is checked before the
            guess's own, larger step is run).
    """

    batch_size: int
    estimate: Optional[Estimate]
    seconds: float
    source: str
    added_at: Optional[Tuple[int, int]] = None

    def record(self, held: bool) -> "GuessRecord":
        """What a report keeps of it (the estimate is the report's own)."""
        return GuessRecord(self.batch_size, self.seconds, self.source, held)


# ``guess(budget_bytes, max_batch_size)``: what a caller that knows the model hands the probe
# (:func:`~adaptive_batch.probe.first_guess.guess_max_batch_size` on its model).
FirstGuessFor = Callable[[int, Optional[int]], Optional["FirstGuess"]]


@dataclass(frozen=True)
class GuessRecord:
    """A :class:`FirstGuess` as the probe report keeps it; ``held``: the search went on from its
    line (else its warmup check dropped it, or its own step was off the line and real steps drew
    the one reported)."""

    batch_size: int
    seconds: float
    source: str
    held: bool = True


def max_overshoot(trials: List[Trial], budget_bytes: int) -> Optional[float]:
    """The largest measured trial peak as a multiple of the budget (``None``: none measured).
    Trials that ran out of memory have no peak; they count among the trials all the same."""
    ratios = [t.peak_bytes / budget_bytes for t in trials if t.peak_bytes is not None]
    return max(ratios) if ratios and budget_bytes > 0 else None


@dataclass
class SearchResult:
    """What the search found and every trial it ran."""

    max_batch_size: int
    budget_bytes: int
    estimate: Optional[Estimate]
    predicted_max_batch_size: Optional[int]
    trials: List[Trial] = field(default_factory=list)
    total_seconds: float = 0.0
    stopped_by_time: bool = False  # the time budget ended the search at the largest fit so far
    first_guess: Optional[GuessRecord] = None  # the first guess it was given, and whether it held

    @property
    def num_trials(self) -> int:
        return len(self.trials)

    @property
    def max_overshoot(self) -> Optional[float]:
        return max_overshoot(self.trials, self.budget_bytes)

    def estimate_dict(self) -> dict:
        """The fitted line's kind, coefficients and prediction, as the report writes them."""
        estimate = {}
        if isinstance(self.estimate, OperatorMemoryEstimate):
            estimate = self.estimate.to_dict(self.predicted_max_batch_size or 1)
        elif self.estimate is not None:
            estimate = self.estimate.to_dict()
        estimate["kind"] = _ESTIMATE_KINDS.get(type(self.estimate))
        estimate["predicted_max_batch_size"] = self.predicted_max_batch_size
        return estimate

    def to_dict(self) -> dict:
        return {
            "max_batch_size": self.max_batch_size,
            "budget_bytes": self.budget_bytes,
            "estimate": self.estimate_dict(),
            "trials": [asdict(t) for t in self.trials],
            "max_overshoot": self.max_overshoot,
            "total_seconds": self.total_seconds,
            "stopped_by_time": self.stopped_by_time,
            "first_guess": None if self.first_guess is None else asdict(self.first_guess),
        }


_ESTIMATE_KINDS = {LinearMemoryEstimate: "step", PhaseMemoryEstimate: "phases", OperatorMemoryEstimate: "operators"}


def round_batch_size(batch_size: int, mode: str) -> int:
    """Rounds a found batch size down (``"power_of_two"``) or keeps it (``"none"``).

    Raises:
        ValueError: for an unknown mode or a batch size below 1.
    """
    if mode not in ROUNDING_MODES:
        raise ValueError(
            f"batch_size_rounding={mode!r} is not one of {list(ROUNDING_MODES)}: pick one of them."
        )
    if batch_size < 1:
        raise ValueError(f"cannot round batch size {batch_size}: it must be at least 1.")
    if mode == "power_of_two":
        return 1 << int(math.floor(math.log2(batch_size)))
    return batch_size


def powers_of_two(up_to: int) -> List[int]:
    """1, 2, 4, ... up to and including ``up_to`` (empty below 1)."""
    return [1 << k for k in range(up_to.bit_length())] if up_to >= 1 else []


def search_max_batch_size(
    run_trial: Callable[[int], Union[int, Mapping[str, int]]],
    *,
    budget_bytes: int,
    max_batch_size: Optional[int] = None,
    warmup: bool = True,
    release: Callable[[], None] = release_memory,
    max_trials: int = 64,
    max_overshoot: float = MAX_TRIAL_OVERSHOOT,
    settle_slope: bool = False,
    time_budget_s: Optional[float] = None,
    agree: Callable[[bool], bool] = lambda stop: stop,
    estimate_sizes: Tuple[int, int] = (1, 2),
    tolerance: float = 0.0,
    oom_scars_caller: bool = False,
    estimate_only: bool = False,
    first_guess: Optional[FirstGuess] = None,
) -> SearchResult:
    """Finds the largest batch size whose step fits in ``budget_bytes``.

    Steps at batch sizes 1 and 2 fit ``peak(b) = fixed + per_sample * b``: one line per operator
    of the step when ``run_trial`` gives the step's memory after each operator, else one line per
    phase when it gives phases, else one line (the step's peak is the largest line's); the
    predicted largest size is tried, then its neighbour; if the prediction was off, the search
    gallops (steps 1, 2, 4, ...) away from it until the answer is bracketed (up, no further than
    the line through the two largest fits allows), then bisects.

    Every trial past the estimate steps is bounded by the worst case the largest fit so far
    allows: what a step adds to the memory it starts with (``peak - start``, ``start`` being the
    training state and the batch, or 0 when not measured) growing in proportion to the batch.
    The next size is at most ``lo * (max_overshoot * budget - start) / (peak(lo) - start)``, so
    no trial's peak passes ``max_overshoot`` x budget unless a step's memory grows faster than
    in proportion to its batch, however wrong the line is. Where the line is right it allows
    the jump to the prediction; where it is untrusted (peaks nearly flat at batch 1-2 while
    a hidden term grows, as under FSDP2) the search grows geometrically from the largest fit.

    Args:
        run_trial: runs one real step at a batch size and returns its peak bytes, the peak
            of each of its phases (``{"forward": ..., "backward": ..., "optimizer": ...}``),
            or a :class:`StepMemory` (phases and the memory after each operator); raises an
            out-of-memory error when the step cannot allocate.
        budget_bytes: the most a step's peak may be.
        max_batch_size: the largest size worth trying (e.g. the dataset size); ``None``: no cap.
        warmup: run one step at batch 1 first and leave it out of the estimate, so one-time
            allocations (optimizer state) are in place for the measured steps.
        release: frees what a failed step left behind.
        max_trials: a guard against a step that never runs out of memory with no cap.
        max_overshoot: the bound on a trial's peak, as a multiple of the budget, that limits
            how far past the largest fit the next trial may go (``math.inf``: no bound, for
            trials that allocate nothing, such as the planner's fake steps).
        settle_slope: where no operator timeline is measured (CUDA), add estimate steps at
            4, 8, ... until two successive pairs of them predict the same answer
            (:func:`_settled_points`), and fit the last two.
        time_budget_s: seconds the search may take; a search trial that the time of the steps
            so far says would end past it is not run, and the largest fit so far is the answer
            (:class:`_Clock`). ``None``: no limit.
        agree: turns this process's wish to stop into every rank's (``RankGroup.any``), so
            ranks searching in lockstep stop together.
        estimate_sizes: the two sizes the line is measured at. Larger ones, from a first guess,
            suit a unit whose small batches are noise (address space, where glibc's heap absorbs
            a small step); when the first does not fit, the search starts from below it.
        tolerance: the search is settled when the largest fit is within this fraction of the
            smallest failure (0: exact); the gallop's first stride is as large. For a unit whose
            noise is larger than a sample (address space moves in 8 MiB steps of glibc's heap,
            where an MLP's sample took 0.1 MiB: 19 trials to settle 1% below the budget).
        oom_scars_caller: a failed trial leaves the heap the caller trains in worse (trials in
            this process under a hard CPU limit): the last trial, one past the largest fit, is
            not run where the line through the two largest fits puts it over the budget by
            more than half a sample (:meth:`_Bracket.foresees_failure`).
        estimate_only: stop after the estimate steps (a first guess): the result's ``estimate``
            is the line, and nothing past it is tried.
        first_guess: a prediction made without real steps, tried after the warmup instead of
            estimate steps (:func:`_from_guess`); its seconds count in the result's and the time
            budget's. Its step is the one trial past no bound.

    Returns:
        The result, with every trial.

    Raises:
        BatchSizeTooLargeError: when batch size 1 does not fit.
        ValueError: for a budget or cap below 1, or ``max_overshoot`` below 1.
        RuntimeError: when ``max_trials`` trials did not settle the answer.
    """
    _check_bounds(budget_bytes, max_batch_size, max_overshoot)
    # A guess's seconds are the search's: the report's and the time budget's.
    start = time.perf_counter() - (0.0 if first_guess is None else first_guess.seconds)
    trials = _Trials(run_trial, budget_bytes, release=release, max_trials=max_trials)
    bracket = _Bracket(trials, budget_bytes, max_batch_size, max_overshoot, tolerance)
    clock = _Clock(trials, time_budget_s, start, agree=agree)
    begin = _starting_point(bracket, clock, first_guess, estimate_sizes, warmup=warmup, settle_slope=settle_slope)
    predicted = begin.predicted
    if predicted is not None and max_batch_size is not None:
        predicted = min(predicted, max_batch_size)
    if (begin.estimate is not None or first_guess is not None) and not estimate_only:
        clock.say_eta(predicted)
        _Search(bracket, predicted, clock, trust_prediction=begin.trusted, spare_the_caller=oom_scars_caller).run()
    return SearchResult(
        bracket.lo, budget_bytes, begin.estimate, predicted, trials.done, time.perf_counter() - start, clock.stopped,
        None if first_guess is None else first_guess.record(begin.guess_held),
    )


class _Start(NamedTuple):
    """Where the search starts: the line, its prediction, whether that is tried as it is (past
    the overshoot bound), and whether a first guess's line is the one."""

    estimate: Optional[Estimate]
    predicted: Optional[int]
    trusted: bool
    guess_held: bool = False


def _starting_point(
    bracket: "_Bracket", clock: "_Clock", first_guess: Optional[FirstGuess], sizes: Tuple[int, int], *, warmup: bool,
    settle_slope: bool,
) -> _Start:
    """The warmup, then the line the search starts from: measured by the estimate steps, or the
    first guess's (:func:`_from_guess`), checked at its warmup where it says what its first size
    adds (:func:`_warmup_agrees`; not on CUDA, whose first step holds its one-time workspaces).

    Raises:
        BatchSizeTooLargeError: when batch size 1 does not fit.
    """
    if first_guess is not None:
        at = first_guess.added_at
        size = at[0] if at is not None and warmup and (bracket.cap is None or at[0] <= bracket.cap) else 1
        if warmup and not bracket.run(size, "warmup"):
            if size == 1 or not bracket.run(1, "warmup"):
                raise BatchSizeTooLargeError(bracket.trials.done[-1].peak_bytes, bracket.budget_bytes)
            return _Start(None, None, False)  # 1 fits, 2 does not: settled
        if size == 1 or settle_slope or _warmup_agrees(first_guess, bracket.trials.done[-1]):
            begin = _from_guess(bracket, first_guess)
            if begin is not None:
                return begin
        warmup = False
    estimate = _measure_line(bracket, clock, sizes, warmup=warmup, settle_slope=settle_slope)
    predicted = None if estimate is None else estimate.max_batch_size(bracket.budget_bytes)
    # A line per operator through two steps that ran the same operators is the step's own
    # memory, so its prediction is tried as it is; cruder lines are held to the overshoot bound.
    return _Start(estimate, predicted, isinstance(estimate, OperatorMemoryEstimate))


def _from_guess(bracket: "_Bracket", guess: FirstGuess) -> Optional[_Start]:
    """The guess's real step. Where its peak is on the guess's line within half a sample, the
    search goes on from it. Else the line is not this step's (fake kernels unlike the real ones: an
    LSTM's guess said 86 where 62 fit): a real step at batch 2 and the line through it and the
    guess's step, far apart, predict instead. ``None`` where the step ran out of memory, which
    says nothing of the line: the estimate steps measure it (a search down from the guess with
    no line ran 5 more out-of-memory trials)."""
    size = max(1, guess.batch_size) if bracket.cap is None else min(max(1, guess.batch_size), bracket.cap)
    bracket.run(size, "guess")
    trial = bracket.trials.done[-1]
    if trial.peak_bytes is None:
        logs.info(f"probe: the first guess's step at batch {size} ran out of memory; real steps draw the line.")
        return None
    if guess.estimate is None or _on_the_line(guess.estimate, trial):
        return _Start(guess.estimate, size, True, guess_held=True)
    if bracket.settled():
        return _Start(guess.estimate, size, False)
    logs.info(f"probe: the first guess's line said {format_bytes(guess.estimate.peak_bytes(size))} at batch {size}, "
              f"its real step {format_bytes(trial.peak_bytes)}; one more real step at batch 2 draws the line.")
    if size <= 2 or not bracket.run(2, "estimate"):
        return _Start(guess.estimate, size, False)
    measured = sorted((t for t in bracket.trials.done if t.phase in ("estimate", "guess")), key=lambda t: t.batch_size)
    estimate = _fit_estimate(measured, bracket.trials.estimate_steps)
    predicted = estimate.max_batch_size(bracket.budget_bytes)
    return _Start(estimate, size if predicted is None else predicted, isinstance(estimate, OperatorMemoryEstimate))


def added_before_the_optimizer_step(trial: Trial) -> Optional[int]:
    """What ``trial``'s step added over its start before its optimizer step (forward, loss and
    backward: a first step's optimizer state is created after them), or ``None`` unmeasured."""
    phases = trial.phase_peak_bytes or {}
    before_step = [phases[name] for name in ("forward", "backward") if name in phases]
    if trial.start_bytes is None or not before_step:
        return None
    return max(before_step) - trial.start_bytes


def _warmup_agrees(guess: FirstGuess, warmup: Trial) -> bool:
    """Whether the real warmup added before its optimizer step (which creates its state) what the
    guess's step at the same batch added, within half a sample of the guess's line; said in a line
    when not (its real steps then draw the line)."""
    added = added_before_the_optimizer_step(warmup)
    if guess.added_at is None or guess.estimate is None or added is None:
        return True
    b, fake_added = guess.added_at
    if abs(added - fake_added) <= _half_a_sample(guess.estimate, b):
        return True
    logs.info(f"probe: the first guess's step at batch {b} added {format_bytes(fake_added)}, the real warmup "
              f"{format_bytes(added)}: the guess is not this step's; real steps draw the line.")
    return False


def _on_the_line(estimate: Estimate, trial: Trial) -> bool:
    """Whether ``trial``'s measured peak is within half a sample of ``estimate``'s at its size."""
    b, peak = trial.batch_size, trial.peak_bytes
    return peak is not None and abs(peak - estimate.peak_bytes(b)) <= _half_a_sample(estimate, b)


def _half_a_sample(estimate: Estimate, batch_size: int) -> float:
    """Half what one more sample adds at ``batch_size`` by ``estimate`` (at least half a byte)."""
    return max(1, estimate.peak_bytes(batch_size + 1) - estimate.peak_bytes(batch_size)) / 2


def _check_bounds(budget_bytes: int, max_batch_size: Optional[int], max_overshoot: float) -> None:
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes={budget_bytes} must be positive.")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be at least 1.")
    if not max_overshoot >= 1:
        raise ValueError(f"max_overshoot={max_overshoot} must be at least 1.")


def _measure_line(
    bracket: "_Bracket", clock: "_Clock", sizes: Tuple[int, int], *, warmup: bool, settle_slope: bool
) -> Optional[Estimate]:
    """The warmup and estimate steps, and the line through them; ``None`` where those steps
    settled the answer themselves (the first size did not fit, or the cap was reached), any
    search from below them run.

    Raises:
        BatchSizeTooLargeError: when batch size 1 does not fit.
    """
    trials, budget_bytes, cap = bracket.trials, bracket.budget_bytes, bracket.cap
    first, second = sizes
    if warmup and not bracket.run(1, "warmup"):
        raise BatchSizeTooLargeError(trials.done[-1].peak_bytes, budget_bytes)
    if not bracket.run(first, "estimate"):
        if first > 1:
            _Search(bracket, None, clock, trust_prediction=False).run()
        # Not even batch 1: the search from below reached it, or its second step (the optimizer's
        # state beside it) did not fit where the warmup's did, and training's steps are all second.
        if bracket.lo == 0 or first == 1:
            raise BatchSizeTooLargeError(trials.done[-1].peak_bytes, budget_bytes)
        return None
    if cap == first or not bracket.run(second, "estimate"):
        if first > 1 and not bracket.settled():
            _Search(bracket, None, clock, trust_prediction=False).run()
        return None
    steps = trials.estimate_steps
    if (first, second) == (1, 2) and len(steps) == 2 and not _same_operators(steps[1], steps[2]) and cap != 2:
        # Batch 1 often runs other operators (a view where larger batches copy): measure at 3.
        logs.info("probe: batch 1 and 2 ran different operators; one more estimate step at batch 3")
        if not bracket.run(3, "estimate"):
            return None
        del steps[1]
    measured = [t for t in trials.done if t.phase == "estimate"]
    if settle_slope and not steps:
        measured = _settled_points(bracket, measured, budget_bytes, cap)
    return _fit_estimate(measured, steps)


class _Trials:
    """Runs and records the search's real steps: one :class:`Trial` each, logged."""

    def __init__(self, run_trial: Callable, budget_bytes: int, *, release: Callable[[], None], max_trials: int) -> None:
        self.run_trial, self.budget_bytes, self.release = run_trial, budget_bytes, release
        self.max_trials = max_trials
        self.done: List[Trial] = []
        self.estimate_steps: Dict[int, StepMemory] = {}  # the estimate steps' memory after each operator

    def run(self, batch_size: int, phase: str, *, lo: int, hi: Optional[int]) -> Trial:
        """One real step at ``batch_size``; an out-of-memory error is a trial that did not fit.

        Raises:
            RuntimeError: when ``max_trials`` trials have run (``lo`` and ``hi`` say how far
                the search got).
        """
        if len(self.done) >= self.max_trials:
            raise RuntimeError(
                f"the batch size search ran {self.max_trials} trials without settling "
                f"(largest fit {lo}, smallest failure {hi}): set max_batch_size to cap it."
            )
        t0 = time.perf_counter()
        smaller_ran = any(not t.oom and t.batch_size < batch_size for t in self.done)
        measured, failure = catch_oom(lambda: self.run_trial(batch_size), after_a_smaller_step=smaller_ran)
        peak: Optional[int] = None
        phases: Optional[Dict[str, int]] = None
        start_bytes: Optional[int] = None
        if failure is not None:
            self.release()
        elif isinstance(measured, StepMemory):
            phases, peak, start_bytes = dict(measured.phase_peak_bytes), measured.peak_bytes, measured.start_bytes
            if phase in ("estimate", "guess") and measured.timeline:
                self.estimate_steps[batch_size] = measured
        elif isinstance(measured, Mapping):
            phases = {name: int(value) for name, value in measured.items()}
            peak = max(phases.values())
        else:
            peak = int(measured)
        oom = failure is not None
        fits = not oom and peak is not None and peak <= self.budget_bytes
        trial = Trial(batch_size, fits, peak, time.perf_counter() - t0, oom, phase, phases, start_bytes)
        self.done.append(trial)
        outcome = "fits" if fits else ("out of memory" if oom else "over budget")
        logs.info(
            f"probe trial {len(self.done)} ({phase}): batch_size={batch_size} {outcome}, "
            f"peak {format_bytes(peak)}, {trial.seconds:.2f}s"
        )
        return trial


class _Bracket:
    """What the trials so far say: ``lo`` is the largest size that fitted, ``hi`` the smallest
    that did not; and how far past ``lo`` the next trial may safely go."""

    def __init__(self, trials: _Trials, budget_bytes: int, cap: Optional[int], max_overshoot: float,
                 tolerance: float = 0.0) -> None:
        self.trials, self.budget_bytes, self.cap, self.max_overshoot = trials, budget_bytes, cap, max_overshoot
        self.tolerance = tolerance
        self.lo = 0
        self.hi: Optional[int] = None

    def run(self, batch_size: int, phase: str) -> bool:
        """A trial at ``batch_size``, taken into the bracket; whether it fitted."""
        trial = self.trials.run(batch_size, phase, lo=self.lo, hi=self.hi)
        if trial.fits:
            self.lo = max(self.lo, batch_size)
        else:
            self.hi = batch_size if self.hi is None else min(self.hi, batch_size)
        return trial.fits

    def upper(self) -> Optional[int]:
        """The largest size still possible: below the smallest failure, else the cap."""
        return self.hi - 1 if self.hi is not None else self.cap

    def settled(self) -> bool:
        upper = self.upper()
        return upper is not None and upper - self.lo <= int(self.tolerance * self.lo)

    def min_stride(self) -> int:
        """The gallop's first stride: the tolerance's share of the largest fit, at least 1."""
        return max(1, int(self.tolerance * self.lo))

    def _fit_trial(self, size: int) -> Optional[Trial]:
        return next((t for t in reversed(self.trials.done) if t.batch_size == size and t.fits), None)

    def bounded(self, overshoot: Optional[float] = None) -> Optional[int]:
        """The largest size whose peak stays within ``overshoot`` (``max_overshoot`` when
        ``None``) x budget if what a step adds grew in proportion to the batch from the largest
        fit (see :func:`search_max_batch_size`)."""
        overshoot = self.max_overshoot if overshoot is None else overshoot
        trial = self._fit_trial(self.lo)
        if trial is None or trial.peak_bytes is None or math.isinf(overshoot):
            return None
        start = min(trial.start_bytes or 0, trial.peak_bytes)
        added = trial.peak_bytes - start
        if added <= 0:
            return None
        return int(self.lo * (overshoot * self.budget_bytes - start) // added)

    def clamp(self, candidate: int, *, bounded: bool = True) -> int:
        """``candidate`` within the overshoot bound (when ``bounded``), above ``lo`` and at most
        :meth:`upper`."""
        top, bound = self.upper(), (self.bounded() if bounded else None)
        if bound is not None:
            candidate = min(candidate, bound)
        candidate = max(candidate, self.lo + 1)
        return min(candidate, top) if top is not None else candidate

    def _two_largest_fits(self) -> Optional[Tuple[Tuple[int, int], Tuple[int, int]]]:
        fits = sorted({t.batch_size: t.peak_bytes for t in self.trials.done
                       if t.fits and t.peak_bytes and t.phase != "warmup"}.items())
        return (fits[-2], fits[-1]) if len(fits) >= 2 else None

    def extrapolate(self) -> Optional[int]:
        """Where the line through the two largest fits' peaks meets the budget (``None``: fewer
        than two, or a line that does not rise)."""
        pair = self._two_largest_fits()
        if pair is None:
            return None
        (b1, p1), (b2, p2) = pair
        return _where_line_meets(self.budget_bytes, b1, p1, b2, p2)

    def foresees_failure(self, batch_size: int) -> bool:
        """Whether the line through the two largest fits' measured peaks puts ``batch_size`` over
        the budget by more than half a sample: a failure the measurements at the top of the
        range already show, with a sample's worth of room for the line's own error."""
        pair = self._two_largest_fits()
        if pair is None:
            return False
        (b1, p1), (b2, p2) = pair
        per_sample = (p2 - p1) / (b2 - b1)
        return per_sample > 0 and p2 + per_sample * (batch_size - b2) >= self.budget_bytes + per_sample / 2

    def judge_over(self, batch_size: int) -> None:
        """Takes ``batch_size`` as not fitting, without a trial."""
        self.hi = batch_size if self.hi is None else min(self.hi, batch_size)
        logs.info(f"probe: batch_size={batch_size} is not tried: the line through the two largest fits puts its "
                  "peak over the budget by more than half a sample, and a failed trial would leave this process's "
                  "heap worse for the training that follows.")

    def interpolate(self) -> Optional[int]:
        """Where the line through the measured peaks at ``lo`` and ``hi`` meets the budget."""
        lo, hi = self.lo, self.hi
        if lo < 1 or hi is None or hi - lo < 2:
            return None
        fit = self._fit_trial(lo)
        p_lo = None if fit is None else fit.peak_bytes
        p_hi = next((t.peak_bytes for t in reversed(self.trials.done) if t.batch_size == hi and not t.oom), None)
        if p_lo is None or p_hi is None:
            return None
        return _where_line_meets(self.budget_bytes, lo, p_lo, hi, p_hi)


def _where_line_meets(budget_bytes: int, b1: int, p1: int, b2: int, p2: int) -> Optional[int]:
    """The size where the line through peak ``p1`` at ``b1`` and ``p2`` at ``b2`` meets the
    budget, rounded down from ``b1`` (``None`` when the line does not rise)."""
    if p2 <= p1:
        return None
    return b1 + int((budget_bytes - p1) * (b2 - b1) // (p2 - p1))


class _Search:
    """The trials after the estimate: the prediction, then gallop, interpolate or bisect.

    Interpolating between measured peaks beats halving when the small-batch line was off (e.g.
    under FSDP2 the peak is nearly flat at batch 1-2, then grows 3x as fast); two interpolated
    trials in a row on the same side fall back to one halving.
    """

    def __init__(self, bracket: _Bracket, predicted: Optional[int], clock: "_Clock", *, trust_prediction: bool,
                 spare_the_caller: bool = False) -> None:
        self.bracket, self.predicted, self.clock = bracket, predicted, clock
        self.trust_prediction, self.spare_the_caller = trust_prediction, spare_the_caller
        self.direction = 0  # +1 while trials fit, -1 while they fail, until bracketed
        self.step = 1  # the gallop's next stride
        self.bracketed = False
        self.last_interpolated: Optional[bool] = None  # the outcome of the last interpolated trial
        self.from_interpolation = False

    def run(self) -> None:
        b = self.bracket
        # With no bound from the line (flat peaks), start by doubling. Between a fit and a failure
        # with no line (the second estimate step failed), where the fit's step, grown in proportion
        # to the batch, meets the budget: it grows by less than that, so the size fits or settles
        # it (a 152K x 64 model's fresh processes: 6 fitted, 9 failed, then 8 and 7 failed too).
        start_at = 2 * b.lo if b.hi is None or b.lo < 1 else b.bounded(overshoot=1.0)
        candidate = b.clamp(self.predicted if self.predicted is not None else (start_at or 2 * b.lo),
                            bounded=not self.trust_prediction)
        while not b.settled():
            within = self.clock.within_budget(candidate, b.lo)
            if within is None:
                break
            if within != candidate:  # not the interpolated size: its outcome says nothing of the line
                self.from_interpolation, candidate = False, within
            if self.spare_the_caller and candidate == b.lo + 1 and b.foresees_failure(candidate):
                b.judge_over(candidate)
                break
            fits = b.run(candidate, "search")
            moved = 1 if fits else -1
            if self.direction and moved != self.direction:
                self.bracketed = True
            self.direction = self.direction or moved
            if b.settled():
                break
            candidate = self._next(fits)

    def _next(self, fits: bool) -> int:
        b = self.bracket
        halve = self.from_interpolation and self.last_interpolated == fits
        if self.from_interpolation:
            self.last_interpolated = None if halve else fits
        guess = None if halve else b.interpolate()
        self.from_interpolation = guess is not None
        if guess is not None:
            return b.clamp(guess)
        if fits and self.predicted is not None and b.lo < self.predicted and not self.bracketed:
            return b.clamp(self.predicted, bounded=not self.trust_prediction)  # the bound stopped short of it
        if self.bracketed or halve:
            return b.clamp((b.lo + b.upper() + 1) // 2)
        stride = max(self.step, b.min_stride())
        if not fits:
            self.step = stride * 2
            return b.clamp(b.hi - stride)
        # Galloping up, no further than the line through the two largest fits allows: a
        # doubled stride from a fit just under the budget took two failed trials (6 fitted with
        # 5 MiB to spare; 8 failed, then 7) where the next size alone settles it. The next
        # stride doubles the move made, not the one the line held back.
        room = b.extrapolate()
        move = stride if room is None else min(stride, max(room - b.lo, b.min_stride()))
        self.step = 2 * move
        return b.clamp(b.lo + move)


class _Clock:
    """How long the search's next trial will take, by the line through the times of the two
    largest sizes that ran so far, and whether the time budget allows it."""

    def __init__(self, trials: _Trials, budget_s: Optional[float], start: float, *, agree: Callable[[bool], bool]) -> None:
        self.trials, self.budget_s, self.start, self.agree = trials, budget_s, start, agree
        self.stopped = False

    def seconds(self, batch_size: int) -> Optional[float]:
        """The predicted time of a trial at ``batch_size`` (``None`` before two sizes ran)."""
        ran = {t.batch_size: t.seconds for t in self.trials.done if not t.oom and t.phase != "warmup"}
        if len(ran) < 2:
            return None
        (b1, s1), (b2, s2) = sorted(ran.items())[-2:]
        return s2 + max(0.0, (s2 - s1) / (b2 - b1)) * (batch_size - b2)

    def say_eta(self, predicted: Optional[int]) -> None:
        """One line: the time a trial at the prediction should take, and the budget."""
        seconds = None if predicted is None else self.seconds(predicted)
        if seconds is None:
            return
        limit = "no time budget" if self.budget_s is None else f"a time budget of {self.budget_s:g}s"
        logs.info(
            f"probe: a step at the predicted batch {predicted} should take about {seconds:.1f}s by the "
            f"steps so far: the search about {2 * seconds:.0f}s at the least, with {limit}."
        )

    def within_budget(self, batch_size: int, largest_fit: int) -> Optional[int]:
        """``batch_size``, where a trial there ends within the budget; else the first of the
        sizes halfway down to ``largest_fit`` that does, said in a line (the steps of batch 1 and
        2 of a small model, their times noise, put a trial at 73460 past 600 s where it took 0.04 s,
        and the search stopped at 2); ``None`` where none does, said in a line. Every rank
        agrees on each size, so lockstep ranks try the same.
        """
        if self.budget_s is None:  # the same config on every rank: none of them asks
            return batch_size
        asked, asked_seconds = batch_size, self.seconds(batch_size)
        elapsed = time.perf_counter() - self.start
        # The budget spent is no trial's prediction: stop at once (every rank agreeing).
        while not self.agree(elapsed > self.budget_s):
            seconds = self.seconds(batch_size)
            if not self.agree(seconds is not None and elapsed + seconds > self.budget_s):
                if batch_size != asked:
                    logs.info(f"probe: a trial at batch {asked} would end past probe_time_budget={self.budget_s:g} "
                              f"by the steps so far; batch {batch_size} first, whose step says more.")
                return batch_size
            if batch_size - largest_fit <= 1:
                break
            batch_size = largest_fit + (batch_size - largest_fit) // 2
            elapsed = time.perf_counter() - self.start
        self.stopped = True
        about = "" if asked_seconds is None else f" a trial at batch {asked} would take about {asked_seconds:.0f}s more, and"
        logs.info(
            f"probe: stopped at batch {largest_fit}, the largest that fitted so far:{about} the search has "
            f"run {elapsed:.0f}s of probe_time_budget={self.budget_s:g}; raise probe_time_budget "
            "(or set it to null) to search further."
        )
        return None


# Where no operator timeline is measured (CUDA), a phase's peak is the largest of what is live
# at several moments of the step, and its slope can keep growing past batch 2: on an H100 a
# 152K-vocabulary model's backward peak grew 123 MiB a sample from batch 1 to 2 and 307 MiB from
# 8 on, so the line through 1 and 2 predicted 476 where 246 fit (5 out-of-memory trials). The
# estimate steps double until two successive pairs predict within SETTLED of each other.
SETTLED = 0.05
MAX_SETTLE_BATCH = 64


def _settled_points(
    bracket: "_Bracket", measured: List[Trial], budget_bytes: int, max_batch_size: Optional[int]
) -> List[Trial]:
    """The last two of the estimate steps, doubled from the largest measured until the
    answer they predict stops moving, a step does not fit, or :data:`MAX_SETTLE_BATCH`."""
    points = list(measured)
    previous = _fit_estimate(points[-2:], {}).max_batch_size(budget_bytes)
    size = points[-1].batch_size * 2
    while size <= min(MAX_SETTLE_BATCH, max_batch_size or MAX_SETTLE_BATCH) and (previous is None or size < previous):
        if not bracket.run(size, "estimate"):
            break
        points.append(bracket.trials.done[-1])
        current = _fit_estimate(points[-2:], {}).max_batch_size(budget_bytes)
        if previous is not None and current is not None and abs(current - previous) <= SETTLED * current:
            break
        previous, size = current, size * 2
    return points[-2:]


def _same_operators(a: StepMemory, b: StepMemory) -> bool:
    return a.operators is not None and b.operators is not None and a.operators == b.operators


def _fit_estimate(measured: List[Trial], steps: Dict[int, StepMemory]) -> Estimate:
    """The most detailed estimate the measurements allow: per operator, per phase, per step."""
    if len(steps) == 2:
        (b1, s1), (b2, s2) = sorted(steps.items())
        try:
            return OperatorMemoryEstimate.fit((b1, s1.timeline), (b2, s2.timeline), (s1.operators, s2.operators))
        except ValueError:
            pass  # the two steps ran different operators
    if all(t.phase_peak_bytes for t in measured):
        return PhaseMemoryEstimate.fit([(t.batch_size, t.phase_peak_bytes) for t in measured])
    return LinearMemoryEstimate.fit([(t.batch_size, t.peak_bytes) for t in measured])
