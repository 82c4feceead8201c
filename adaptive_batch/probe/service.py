"""The probe as one service: budget, cache, lockstep ranks, throughput choice, report.

:func:`probe_batch_size` is what a recipe and the ``adaptive-batch probe`` command both call.
It works out the budget (``max_memory`` or the device, less the safety margin, the smallest of
all ranks), reuses a cached result with the same key, else runs the real-step search of
:func:`adaptive_batch.probe.trials.probe_max_batch_size` in lockstep on every rank, optionally times
the candidates for the throughput objective, and writes ``batch_probe.json`` (and the plot).
"""

from contextlib import contextmanager
from dataclasses import dataclass, replace
import math
import os
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Tuple, Union

from adaptive_batch.distributed import MAX_MEMORY_ENV, RankGroup
from adaptive_batch.errors import BatchSizeTooLargeError, ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.memory.budget import (
    MemoryBudget,
    check_reserve_bytes as _check_reserve_bytes,
    memory_budget,
    trial_headroom_bytes,
)
from adaptive_batch.memory.device import (
    DeviceCapacity,
    address_space_limit_at,
    device_capacity,
    device_name,
    format_bytes,
    memory_fraction,
    parse_memory,
    prepare_allocator_for_a_hard_budget,
    proc_status_bytes,
)
from adaptive_batch.memory.oom import collections_of_new_objects, first_line
from adaptive_batch.memory.tracker import live_tensor_bytes
from adaptive_batch.probe.cache import ProbeCache, default_cache_dir, library_versions
from adaptive_batch.probe.children import search_in_children, trials_in_children
from adaptive_batch.probe.lockstep import LockstepTrial
from adaptive_batch.probe.search import ROUNDING_MODES, FirstGuess, FirstGuessFor, SearchResult, round_batch_size
from adaptive_batch.probe.throughput import OBJECTIVES, ThroughputChoice, probe_throughput
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.report import PROBE_FILENAME, CacheUse, ProbeReport, report_of_search, write_probe_report
from adaptive_batch.probe.trials import probe_max_batch_size
from adaptive_batch.probe.verify import largest_that_trains, runs_consecutive_steps, verify_steps
from adaptive_batch.validation import check_bool, check_choice, check_fraction, check_positive_int, check_positive_number, check_safety_margin

MemorySpec = Union[None, int, float, str]
_ANY_CAPACITY = 1 << 62


# Ten minutes: a probe on a GPU takes under one; on a CPU with no max_memory a single trial of
# a tiny model at batch 848 took 332 s (issue 26).
DEFAULT_PROBE_TIME_BUDGET_S = 600.0


@dataclass(frozen=True, kw_only=True)
class ProbeOptions:
    """The offline probe's settings; they check themselves when built.

    Attributes:
        use_maximum_batch_size: probe for the largest batch before training.
        max_memory: the budget for a step's peak: bytes, a size (``"6GiB"``), a fraction of
            the device (``0.8``, ``"80%"``), or ``None`` for the device.
        memory_safety_margin: fraction of the budget held back; ``None`` for the device's
            default (:func:`default_safety_margin`: 0.05 on CUDA, for the caching allocator's
            fragmentation; 0.01 on CPU; 0.003 under an address-space limit when the trials run in
            fresh processes, where a process with no scars judges the answer in the limit's unit).
        batch_size_rounding: ``"none"`` keeps the found size, ``"power_of_two"`` rounds down.
        max_batch_size: the largest batch the probe may choose (and growth's bound when not
            probing), or ``None``.
        batch_size_objective: ``"max_fit"`` (the largest) or ``"throughput"`` (the smallest
            within ``throughput_tolerance`` of the best samples per second).
        throughput_tolerance: the fraction of the best rate a smaller batch may fall short by.
        probe_cache: reuse a cached probe result with the same key.
        probe_cache_dir: where the cache lives, or ``None`` for the user's cache directory.
        plot: draw memory against batch size to ``batch_probe.png``.
        probe_time_budget: seconds the search may take: it stops at the largest size that
            fitted when the next trial would end past it (a trial's time is predicted from the
            steps so far); ``None`` for no limit.
        probe_first_guess: start the real trials at the answer fake steps of the model predict
            (nothing allocated), where the caller knows the model (the recipes) and the budget
            counts tensor bytes; ``False`` measures the line from real steps instead.

    Raises:
        ConfigError: for the first bad value.
    """

    use_maximum_batch_size: bool = False
    max_memory: MemorySpec = None
    memory_safety_margin: Optional[float] = None
    batch_size_rounding: Literal["none", "power_of_two"] = "none"
    max_batch_size: Optional[int] = None
    batch_size_objective: Literal["max_fit", "throughput"] = "max_fit"
    throughput_tolerance: float = 0.02
    probe_cache: bool = True
    probe_cache_dir: Optional[str] = None
    plot: bool = False
    probe_time_budget: Optional[float] = DEFAULT_PROBE_TIME_BUDGET_S
    probe_first_guess: bool = True

    def __post_init__(self) -> None:
        check_bool("use_maximum_batch_size", self.use_maximum_batch_size)
        # The form only: fractions and the device's size are checked by max_memory_bytes.
        self.max_memory_bytes(_ANY_CAPACITY)
        if self.memory_safety_margin is not None:
            check_safety_margin(self.memory_safety_margin)
        check_choice(
            "batch_size_rounding", self.batch_size_rounding, ROUNDING_MODES, "use batch_size_rounding=none to keep the exact size."
        )
        check_positive_int("max_batch_size", self.max_batch_size, allow_none=True)
        check_choice(
            "batch_size_objective",
            self.batch_size_objective,
            OBJECTIVES,
            "max_fit takes the largest batch that fits, throughput the fastest.",
        )
        check_fraction(
            "throughput_tolerance",
            self.throughput_tolerance,
            "0.02 takes the smallest batch within 2% of the best samples per second",
        )
        if self.probe_time_budget is not None:
            check_positive_number(
                "probe_time_budget", self.probe_time_budget,
                f"seconds, e.g. {DEFAULT_PROBE_TIME_BUDGET_S:g} (the default), or null for no limit",
            )
        check_bool("probe_cache", self.probe_cache)
        check_bool("probe_first_guess", self.probe_first_guess)
        if self.probe_cache_dir is not None and not isinstance(self.probe_cache_dir, str):
            raise ConfigError(f"probe_cache_dir={self.probe_cache_dir!r} must be a directory path or null.")
        if check_bool("plot", self.plot):
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "plot=True needs matplotlib, which is not installed: pip install 'adaptive-batch[plot]', "
                    "or set plot=False."
                ) from None

    def max_memory_bytes(self, capacity_bytes: Optional[int]) -> Optional[int]:
        """``max_memory`` in bytes for a device that holds ``capacity_bytes``.

        Raises:
            ConfigError: for a fraction without a known capacity, or more than the device.
        """
        try:
            return parse_memory(self.max_memory, capacity_bytes=capacity_bytes)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def step_budget(
    options: ProbeOptions, target: ProbeTarget, *, build: Optional[Callable[[], ProbeTarget]] = None,
    distributed: bool = False,
) -> "tuple[MemoryBudget, DeviceCapacity, bool]":
    """The budget for a step's peak on ``target.device`` (``max_memory`` or the device, less the
    margin), the capacity it was read from, and whether the trials run in fresh processes
    (:func:`~adaptive_batch.probe.children.trials_in_children`: then the default margin is theirs).
    A hard CPU budget gets the allocator settings its caller trains the answer on, where nobody
    set them yet (:func:`~adaptive_batch.memory.device.prepare_allocator_for_a_hard_budget`).

    Raises:
        ConfigError: for a ``max_memory`` the device cannot give.
    """
    # The recipes, AdaptiveBatch and the Trainer set and say the allocator's settings before
    # this (prepare_allocator); a budget is known to be hard only once it is read, here.
    device = target.device
    capacity = device_capacity(device)
    max_memory = options.max_memory_bytes(capacity.device_bytes)
    live = live_tensor_bytes(target.state_tensors())

    def budget(in_children: bool) -> MemoryBudget:
        return memory_budget(max_memory_bytes=max_memory, capacity=capacity, live_bytes=live,
                             safety_margin=options.memory_safety_margin, fresh_process_trials=in_children,
                             max_memory_fraction=memory_fraction(options.max_memory))

    in_children = trials_in_children(build, budget(False), capacity, device=device, distributed=distributed)
    read = budget(in_children)
    prepare_allocator_for_a_hard_budget(device, soft_budget=read.is_soft)
    return read, capacity, in_children


@dataclass(frozen=True)
class TrialLimits:
    """What the trials and the answer's check are held to, read before any step grows the heap.

    Attributes:
        address_space: the soft ``RLIMIT_AS`` the CPU trials run under (``None`` elsewhere): the
            address space now plus :func:`~adaptive_batch.memory.budget.trial_headroom_bytes`,
            what ``prlimit --as`` would give. Available RAM and a cgroup limit are soft (a trial
            past them wakes the kernel's OOM killer); under this one it fails to allocate, which
            the search catches.
        reserve_bytes: the heap the consecutive-step check holds back
            (:func:`~adaptive_batch.memory.budget.check_reserve_bytes`).
    """

    address_space: Optional[int]
    reserve_bytes: int

    @classmethod
    def read(cls, budget: MemoryBudget, capacity: DeviceCapacity, target: ProbeTarget) -> "TrialLimits":
        state = live_tensor_bytes(target.state_tensors())
        vm_size = proc_status_bytes("VmSize") if target.device.type == "cpu" else None
        address_space = None if vm_size is None else vm_size + trial_headroom_bytes(budget, capacity, state_bytes=state)
        return cls(address_space, _check_reserve_bytes(budget, capacity, device=target.device, state_bytes=state))


@contextmanager
def trial_memory_limit(limit_bytes: Optional[int], *, announce: bool = False) -> Iterator[Optional[int]]:
    """Holds the block to ``limit_bytes`` of address space (see :class:`TrialLimits`); a tighter
    limit already set stays, and the previous one is back on exit. With ``announce`` the limit
    is said in a line (once a probe: the search's, not the timing's).

    Yields:
        The limit in force, or ``None`` when ``limit_bytes`` is ``None``.
    """
    if limit_bytes is None:
        yield None
        return
    with address_space_limit_at(limit_bytes) as limit:
        if announce and limit == limit_bytes:
            logs.info(
                f"probe: trials run under a soft RLIMIT_AS of {format_bytes(limit)}, so a trial past the "
                "budget fails to allocate instead of waking the kernel's OOM killer; lifted after them."
            )
        yield limit


def probe_batch_size(
    options: ProbeOptions,
    target: ProbeTarget,
    *,
    seq_len: Optional[int] = None,
    dataset_size: Optional[int] = None,
    output_dir: Optional[str] = None,
    ranks: Optional[RankGroup] = None,
    cache_fields: Optional[Dict[str, Any]] = None,
    log: Optional[Callable[[str], None]] = None,
    save_report: bool = True,
    build: Optional[Callable[[], ProbeTarget]] = None,
    first_guess: Optional[FirstGuessFor] = None,
    held: Tuple[Any, ...] = (),
    trial_fields: Optional[Dict[str, Any]] = None,
) -> ProbeReport:
    """Finds the batch to train with (or reuses a cached result) and writes the report.

    Args:
        options: the probe's settings.
        target: what the trials train (its model, optimizer and scheduler are put back).
        seq_len: the sequence length of the worst-case batch's rows, for the report and cache key.
        dataset_size: the samples one rank has, a cap on the batch (``None``: no cap but
            ``options.max_batch_size``).
        output_dir: where ``batch_probe.json``, the plot and the temporary snapshot go (``None``:
            no report written, the snapshot in a temporary directory).
        ranks: the data-parallel ranks (the default process group's, or this process alone
            outside one, when ``None``).
        cache_fields: what changes a step's memory (model, optimizer, dtype, ...), for the
            cache key; the budget, device, caps and versions are added here.
        log: where progress lines go (``None``: the ``adaptive_batch`` logger).
        save_report: write ``batch_probe.json`` (and the plot); ``False`` when the caller
            writes it once after adding to it (the controller).
        build: a picklable function that builds ``target`` afresh (the recipes build it from
            their config). Under a hard limit in address space on one process, every trial then
            runs in a fresh process (:mod:`adaptive_batch.probe.children`), so an out-of-memory
            trial or a crash cannot scar or end this one.
        first_guess: ``guess(budget_bytes, cap)``, the answer predicted without real steps by a
            caller that knows the model (the recipes: fake steps of their config's model); the
            search starts there where the guess counts what the budget counts.
        held: tensors the run holds beside the target's state through every step (a noise
            scale's copy of the gradients), counted with it (:attr:`ProbeTarget.held`).
        trial_fields: what the run's settings add to a trial beside ``cache_fields`` (its
            micro-batches, the noise scale), for the cache key.

    Returns:
        The report: what ``batch_probe.json`` holds (``batch_size`` is the one to use).

    Raises:
        BatchSizeTooLargeError: when batch 1 does not fit.
        ConfigError: for a ``max_memory`` the device cannot give, or a device this torch lacks.
    """
    with logs.lines_to(log), collections_of_new_objects():
        target = replace(target, held=(*target.held, *held)).on_its_device()
        ranks = ranks or RankGroup(target.device)
        budget, capacity, in_children = step_budget(options, target, build=build, distributed=ranks.distributed)
        # Every rank searches against the smallest budget; each measures against its own.
        rank_budgets = ranks.gather(budget.budget_bytes)
        caps = [c for c in (dataset_size, options.max_batch_size) if c is not None]
        cap = min(caps) if caps else None
        limits = TrialLimits.read(budget, capacity, target)
        check = _AnswerCheck(target, limits, min(rank_budgets), budget.is_soft, ranks, output_dir)
        cache = ProbeCache(options.probe_cache_dir or default_cache_dir()) if options.probe_cache else None
        key = dict(
            cache_fields or {}, **(trial_fields or {}), seq_len=seq_len, device=device_name(target.device), budget_bytes=min(rank_budgets),
            rank_budget_bytes=rank_budgets, batch_size_cap=cap, batch_size_rounding=options.batch_size_rounding,
            batch_size_objective=options.batch_size_objective, throughput_tolerance=options.throughput_tolerance,
            versions=library_versions(),
        )
        cached = None if cache is None else _trusted_cache_entry(cache, key, ranks, check)
        if cached is not None:
            cached.cache = CacheUse(hit=True, path=cache.path(key))
            path = _publish(cached, options, output_dir, ranks, save_report)
            logs.info(
                f"use_maximum_batch_size: probe cache hit ({cache.path(key)}): batch_size="
                f"{cached.batch_size}, no probing; probe_cache=False probes again." + ("" if path is None else f" Details in {path}")
            )
            return cached
        logs.info(f"use_maximum_batch_size: probing {'' if cap is None else f'up to batch {cap} '}"
                  f"{'' if seq_len is None else f'at seq_len={seq_len} '}with {budget.describe()}.")
        report = search_and_check(options, target, budget, capacity, limits, rank_budgets=rank_budgets, cap=cap,
                                  seq_len=seq_len, ranks=ranks, snapshot_dir=output_dir,
                                  build=build if in_children else None, first_guess=first_guess,
                                  dataset_size=dataset_size)
        if cache is not None and not report.stopped_by_time:  # a longer search may find more
            report.cache = CacheUse(hit=False, path=ranks.decide_on_main(lambda: cache.store(key, report)))
        logs.info(report.describe())
        path = _publish(report, options, output_dir, ranks, save_report)
        logs.info(f"use_maximum_batch_size: the batch to use is {report.batch_size}" + ("" if path is None else f"; details in {path}"))
        return report


@dataclass(frozen=True)
class _AnswerCheck:
    """Training's own consecutive steps at an answer, held to the budget: the check every
    answer (the search's, a cached one) passes before it is trusted."""

    target: ProbeTarget
    limits: TrialLimits
    budget_bytes: int
    soft: bool
    ranks: RankGroup
    snapshot_dir: Optional[str]

    def _kwargs(self) -> Dict[str, Any]:
        return dict(snapshot_dir=self.snapshot_dir, budget_bytes=self.budget_bytes, soft_budget=self.soft,
                    reserve_bytes=self.limits.reserve_bytes, agree=self.ranks.any)

    def passes(self, batch_size: int) -> bool:
        return runs_consecutive_steps(batch_size, self.target, **self._kwargs())

    def largest_up_to(self, batch_size: int) -> int:
        return largest_that_trains(batch_size, self.target, **self._kwargs())


def _trusted_cache_entry(
    cache: ProbeCache, key: Dict[str, Any], ranks: RankGroup, check: _AnswerCheck
) -> Optional[ProbeReport]:
    """The cached report for ``key`` when its answer trains here, else ``None``."""
    cached = ranks.decide_on_main(lambda: cache.load(key))
    if cached is None or check.passes(cached.largest_that_trains):
        return cached
    logs.info(f"use_maximum_batch_size: the probe cache's batch_size={cached.largest_that_trains} did not train here; "
              "probing again.")
    return None


def search_and_check(
    options: ProbeOptions,
    target: ProbeTarget,
    budget: MemoryBudget,
    capacity: DeviceCapacity,
    limits: TrialLimits,
    *,
    rank_budgets: List[int],
    cap: Optional[int],
    seq_len: Optional[int],
    ranks: RankGroup,
    snapshot_dir: Optional[str],
    build: Optional[Callable[[], ProbeTarget]] = None,
    first_guess: Optional[FirstGuessFor] = None,
    dataset_size: Optional[int] = None,
) -> ProbeReport:
    """The real-step search in lockstep on every rank, the answer's check, the rounding and the
    objective, with no cache, report file or line but the trials' and the check's (both entry
    points call it). With ``build`` (:func:`~adaptive_batch.probe.children.trials_in_children`)
    every trial runs in a fresh process, the check here; ``first_guess``: where the search starts
    (:func:`_guess_where_units_match`).

    Raises:
        BatchSizeTooLargeError: when batch 1 does not fit (naming the rank whose budget is smallest).
    """
    common_budget = min(rank_budgets)
    check = _AnswerCheck(target, limits, common_budget, budget.is_soft, ranks, snapshot_dir)
    lockstep: List[LockstepTrial] = []

    def agree_on_outcomes(run_trial: Callable[[int], int]) -> LockstepTrial:
        lockstep.append(LockstepTrial(ranks, run_trial, budget_bytes=budget.budget_bytes, common_budget_bytes=common_budget))
        return lockstep[-1]

    if build is not None:
        result = search_in_children(build, budget, capacity, max_batch_size=cap, time_budget=options.probe_time_budget)
    else:
        guess = _guess_where_units_match(first_guess, options, budget, target, ranks, common_budget, cap)
        with _smallest_rank_named(budget, rank_budgets, ranks):
            result = probe_max_batch_size(
                target, budget_bytes=common_budget, max_batch_size=cap, snapshot_dir=snapshot_dir,
                wrap_trial=agree_on_outcomes, trial_limit=lambda: trial_memory_limit(limits.address_space, announce=True),
                budget_source=budget.source, time_budget_s=options.probe_time_budget, agree=ranks.any,
                oom_scars_caller=_oom_scars_caller(budget, target, ranks), first_guess=guess,
            )
    # Also after fresh processes' trials: a LoRA answer that ran there ran out of memory here.
    verified = check.largest_up_to(result.max_batch_size)
    batch_size = round_batch_size(verified, options.batch_size_rounding)
    throughput = None
    if options.batch_size_objective == "throughput":
        throughput = _fastest(options, target, batch_size, ranks, limits, snapshot_dir=snapshot_dir)
        batch_size = throughput.batch_size
    return report_of_search(
        result, batch_size=batch_size, seq_len=seq_len, device=target.device, budget=budget, capacity=capacity,
        trial_address_space_limit=limits.address_space, batch_size_cap=cap, batch_size_objective=options.batch_size_objective,
        world_size=ranks.world_size, verified_batch_size=verified, verify_steps=verify_steps(target.device),
        trials_in_fresh_processes=build is not None,
        ranks=ranks.gather(lockstep[0].report()) if lockstep else [],  # each rank against its own budget
        throughput=throughput, epoch_share=epoch_share(result, dataset_size),
    )


def _oom_scars_caller(budget: MemoryBudget, target: ProbeTarget, ranks: RankGroup) -> bool:
    """An out-of-memory trial in this process scars the heap it trains in (CUDA's cache empties)."""
    return not budget.is_soft and target.device.type == "cpu" and not ranks.distributed


def _guess_where_units_match(
    guess_for: Optional[FirstGuessFor], options: ProbeOptions, budget: MemoryBudget, target: ProbeTarget,
    ranks: RankGroup, budget_bytes: int, cap: Optional[int],
) -> Optional[FirstGuess]:
    """The caller's first guess, where it counts what the budget counts: tensor bytes (a soft
    budget, or CUDA's allocator) on one process. A hard CPU limit counts address space, and
    lockstep ranks would each need their own guess. A guess that fails is no guess: the
    search measures its own line, and the answer is the same."""
    if guess_for is None or not options.probe_first_guess or ranks.distributed or (
            not budget.is_soft and target.device.type == "cpu"):
        return None
    try:
        # The guess's fake step holds the model's state alone: what the run holds beside it is not its to fill.
        guess = guess_for(budget_bytes - live_tensor_bytes(target.held), cap)
    except Exception as e:  # noqa: BLE001 - an operator fake tensors lack, a model the planner cannot build
        logs.warning(f"probe: no first guess ({type(e).__name__}: {first_line(e)}); measuring the line from real steps.")
        return None
    if guess is not None:
        logs.info(f"probe: first guess batch_size={guess.batch_size} from {guess.source} in {guess.seconds:.1f}s "
                  "(nothing allocated); the real trials start there.")
    return guess


def epoch_share(result: SearchResult, dataset_size: Optional[int]) -> Optional[float]:
    """The search's seconds as a share of one epoch at its answer, the epoch's steps timed by the
    search's own trial at that size (``None``: no dataset size)."""
    batch_size = result.max_batch_size
    step = next((t.seconds for t in reversed(result.trials) if t.batch_size == batch_size and t.fits), None)
    if not dataset_size or not step:
        return None
    return result.total_seconds / (math.ceil(dataset_size / batch_size) * step)


@contextmanager
def _smallest_rank_named(budget: MemoryBudget, rank_budgets: List[int], ranks: RankGroup) -> Iterator[None]:
    """Every rank stops with the figures of the rank whose budget is the smallest: it is named."""
    try:
        yield
    except BatchSizeTooLargeError as e:
        if not ranks.distributed:
            raise
        common_budget = min(rank_budgets)
        source = MAX_MEMORY_ENV if budget.source == "max_memory" and os.environ.get(MAX_MEMORY_ENV) else budget.source
        raise BatchSizeTooLargeError(e.bytes_needed, common_budget, source, rank=rank_budgets.index(common_budget)) from None


def _fastest(
    options: ProbeOptions,
    target: ProbeTarget,
    batch_size: int,
    ranks: RankGroup,
    limits: TrialLimits,
    *,
    snapshot_dir: Optional[str],
) -> ThroughputChoice:
    """The throughput objective: ranks time the same steps; rank 0's choice holds for all."""
    timed = probe_throughput(
        target, max_batch_size=batch_size, tolerance=options.throughput_tolerance, snapshot_dir=snapshot_dir,
        trial_limit=lambda: trial_memory_limit(limits.address_space),
    )
    choice = ranks.broadcast(timed)
    logs.info(
        f"batch_size_objective=throughput: batch {choice.batch_size} is within "
        f"{choice.tolerance:.0%} of the best {choice.best_samples_per_second:.1f} samples/s."
    )
    return choice


def _publish(
    report: ProbeReport, options: ProbeOptions, output_dir: Optional[str], ranks: RankGroup, save: bool
) -> Optional[str]:
    if output_dir is None:
        return None
    if not save:
        return _report_path(output_dir)
    return save_probe_report(report, output_dir, ranks, plot=options.plot)


def save_probe_report(
    report: ProbeReport,
    output_dir: str,
    ranks: RankGroup,
    *,
    plot: bool = False,
) -> str:
    """Rank 0 writes ``batch_probe.json`` (and the plot when asked, its path said in a line);
    returns its path."""
    if not ranks.is_main:
        return _report_path(output_dir)
    path = write_probe_report(report, output_dir)
    if plot:
        from adaptive_batch.probe.plot import plot_probe_report

        logs.info(f"plot: memory against batch size in {plot_probe_report(report, f'{output_dir}/batch_probe.png')}")
    return path


def _report_path(output_dir: str) -> str:
    return f"{output_dir}/{PROBE_FILENAME}"
