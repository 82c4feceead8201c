"""The search with every trial in a fresh process, for a hard limit in address space.

Under an outside ``RLIMIT_AS`` on CPU a trial that runs out of memory scars the process that ran
it (glibc moves the thread to another arena for good) and a crash in a native kernel ends it.
Where the caller can build the training parts again (``build``: the recipes and the CLI build
them from the config, a library user passes a function), each trial is a child process
(:mod:`adaptive_batch.probe.child`) held to this process's headroom, and the answer is the
largest batch that runs training's first steps in a fresh process.
"""

from dataclasses import dataclass
import math
from typing import Callable, Optional, Tuple

import torch

from adaptive_batch.errors import BatchSizeTooLargeError
import adaptive_batch.logs as logs
from adaptive_batch.memory.budget import MemoryBudget, after_margin
from adaptive_batch.memory.device import ADDRESS_SPACE_SOURCE, DeviceCapacity, format_bytes
from adaptive_batch.probe.child import ChildOutOfMemoryError, child_trial, run_in_child, trial_processes
from adaptive_batch.probe.search import SearchResult, search_max_batch_size
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.trials import probe_max_batch_size
from adaptive_batch.probe.verify import verify_steps

# Address space moves in steps of glibc's heap (8 MiB and more), so the children's search settles
# within half a percent of the answer instead of crawling to one sample (19 trials on an MLP).
ADDRESS_SPACE_TOLERANCE = 0.005


def trials_in_children(build: Optional[Callable[[], ProbeTarget]], budget: MemoryBudget, capacity: DeviceCapacity,
                       *, device: torch.device, distributed: bool) -> bool:
    """Whether the trials go to fresh processes: a ``build`` to make them from, a hard budget
    set by an address-space limit on CPU (each process's own: under a cgroup or the machine's RAM
    a child's copy of the model takes from the caller's room), and no other rank to step with."""
    return (build is not None and device.type == "cpu" and not budget.is_soft
            and capacity.source == ADDRESS_SPACE_SOURCE and not distributed)


def search_in_children(
    build: Callable[[], ProbeTarget],
    budget: MemoryBudget,
    capacity: DeviceCapacity,
    *,
    max_batch_size: Optional[int],
    time_budget: Optional[float],
) -> SearchResult:
    """The search judged in the hard limit's own unit: the address space a child's steps added,
    against this process's headroom less the safety margin. Each trial runs training's first
    consecutive steps, and the first guess is a fresh process's too: nothing runs here (the
    caller then checks the answer in its own process).

    Raises:
        BatchSizeTooLargeError: when batch 1 does not run in a fresh process.
    """
    with trial_processes():  # their fork server ends with the search
        return _search(build, budget, capacity, max_batch_size=max_batch_size, time_budget=time_budget)


def _search(build: Callable[[], ProbeTarget], budget: MemoryBudget, capacity: DeviceCapacity, *,
            max_batch_size: Optional[int], time_budget: Optional[float]) -> SearchResult:
    headroom = capacity.headroom_bytes
    steps = verify_steps(torch.device("cpu"))
    logs.info(f"probe: {budget.describe()}; each trial runs {steps} steps in a fresh process held to this process's "
              f"headroom of {format_bytes(headroom)} of address space, judged by the address space it adds.")
    try:
        first = run_in_child(build, TensorGuess(budget.budget_bytes, budget.source), headroom_bytes=headroom,
                             timeout_s=time_budget)
    except ChildOutOfMemoryError:  # batch 2 died: the search's trials say what fits
        first = FirstGuess(None, ())
    guess = first.batch_size
    if guess is not None and max_batch_size is not None:
        guess = min(guess, max_batch_size)
    # The line in address space is measured at a half and three quarters of the tensor guess
    # (tensors are part of address space, so the guess is high): at batch 1-2 glibc's heap absorbs
    # a step (a conv net's slope came out a quarter of the true one), and from a quarter and a half
    # the line still bent (4 out-of-memory trials); from here the conv net took 4 trials, none out
    # of memory. Under 8 a sample is over an eighth of the headroom, which no heap absorbs: the
    # line is measured at the guess and one below it, where the answer most likely is (a 152K
    # vocabulary's guess of 5 took trials at 1, 2, 5 and 6).
    sizes = _estimate_sizes(guess)
    logs.info(f"probe: {first.describe()}; the line in address space is measured at {sizes[0]} and {sizes[1]}.")
    try:
        return search_max_batch_size(
            # One trial longer than the whole probe may take is a hang.
            child_trial(build, headroom_bytes=headroom, steps=steps, timeout_s=time_budget),
            budget_bytes=after_margin(headroom, budget.safety_margin),
            max_batch_size=max_batch_size, warmup=False, max_overshoot=math.inf, time_budget_s=time_budget,
            release=lambda: None,  # nothing of a trial is left in this process
            estimate_sizes=sizes, tolerance=ADDRESS_SPACE_TOLERANCE,
        )
    except BatchSizeTooLargeError as e:
        raise BatchSizeTooLargeError(e.bytes_needed, e.budget_bytes, source=budget.source) from None


@dataclass(frozen=True)
class FirstGuess:
    """What :class:`TensorGuess` answers: its guess (``None``: none) and the batch sizes of the
    real steps it ran, which the log and the benchmarks count."""

    batch_size: Optional[int]
    steps: Tuple[int, ...]

    def describe(self) -> str:
        """What the guess ran and answered, for the probe's line."""
        if self.batch_size is None:
            return ("the first guess's process gave no guess (it ran out of memory, or its steps drew no line): "
                    "the search starts from batch 1")
        sizes = ", ".join(str(b) for b in self.steps)
        return (f"the tensor bytes of {len(self.steps)} steps at batch {sizes} in a fresh process put the answer at "
                f"most at {self.batch_size}")


@dataclass(frozen=True)
class TensorGuess:
    """A fresh process's first guess: where the operator lines of steps at batch 1 and 2 (or 2 and 3) meet
    the budget in tensor bytes (a process that dies at those gives no guess). Address space holds
    more than tensors, so it guesses high; the children's trials measure from below it. In a
    child, not here: two steps in the process that trains left 11 MiB of a Trainer's heap behind,
    which the answer's check there then had to find room for. Its steps are no trials of the
    search: they are not said."""

    budget_bytes: int
    budget_source: str
    # Up to 3, estimate steps only: where batch 1 runs other operators than 2 (a 152K x 64
    # model's chunked loss) the line is drawn through 2 and 3; through 1 and 2 its phases
    # guessed 13 where 6 fit. Where they run the same, no step at 3 is taken.
    batch_size: int = 3

    def __call__(self, target: ProbeTarget, start: int, build_peak: int) -> FirstGuess:
        try:
            with logs.quiet():
                result = probe_max_batch_size(target.on_its_device(), budget_bytes=self.budget_bytes,
                                              max_batch_size=self.batch_size,
                                              budget_source=self.budget_source, restore_state=False,
                                              estimate_only=True)
        except BatchSizeTooLargeError:  # the search's own first trial says it, in this process's words
            return FirstGuess(None, ())
        steps = tuple(t.batch_size for t in result.trials)
        return FirstGuess(None if result.estimate is None else result.estimate.max_batch_size(self.budget_bytes), steps)


def _estimate_sizes(guess: Optional[int]) -> Tuple[int, int]:
    """Where the children's line in address space is measured, from the tensor guess."""
    if guess is None or guess <= 2:
        return (1, 2)
    return (guess - 1, guess) if guess < 8 else (guess // 2, 3 * guess // 4)
