"""The probe for a plain PyTorch loop, in one call.

::

    def step(batch):
        loss = loss_fn(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    batch_size = find_max_batch_size(
        step,
        make_batch=lambda b: {"x": torch.randn(b, 1024), "y": torch.randn(b, 1)},
        model=model,
        optimizer=optimizer,
        max_memory="90%",
    )

The guarantees are the recipes': every trial is a real step on a batch of the caller's worst
case, the answer fitted and the size above it did not, and the model, optimizer, scheduler and
RNG come out as they went in. The answer is then run as the caller's loop will run it, several
consecutive steps after the probe has put everything back, under the limits in place (what the
probe itself left mapped counts; on CUDA held to the budget), and the largest size that runs
them is the answer (:mod:`adaptive_batch.probe.verify`). Under a soft budget the call sets
no allocator option. Under a hard CPU budget it gives the process the recipes' glibc settings
(said in one line), since the caller trains on the answer and glibc's defaults move a step's
peak from process to process; the answer is still this process's, and a fresh process may fit
a little more after a trial that ran out of memory here, unless ``build=`` runs the trials in
fresh processes (docs/probe.md). It is the recipes' probe
(:func:`~adaptive_batch.probe.service.search_and_check`, what ``probe_batch_size`` runs) without
the cache, the ranks and the report, unless ``build=`` takes the trials to fresh processes.
"""

import logging
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import BatchSizeTooLargeError
from adaptive_batch.memory.budget import MemoryBudget, after_margin
from adaptive_batch.memory.device import (
    ADDRESS_SPACE_SOURCE,
    DeviceCapacity,
    format_bytes,
    glibc_mmap_threshold_set,
    prepare_allocator,
)
from adaptive_batch.probe.child import child_trial
from adaptive_batch.probe.search import search_max_batch_size
from adaptive_batch.probe.service import (
    DEFAULT_PROBE_TIME_BUDGET_S, MemorySpec, ProbeOptions, TrialLimits, search_and_check, step_budget,
)
from adaptive_batch.probe.target import ProbeTarget, check_make_batch
from adaptive_batch.probe.trials import probe_max_batch_size
from adaptive_batch.probe.verify import verify_steps
from adaptive_batch.validation import check_safety_margin

_LOG = logging.getLogger(__name__)


def find_max_batch_size(
    train_step: Callable[[Any], None],
    *,
    make_batch: Callable[[int], Any],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    max_memory: MemorySpec = "90%",
    safety_margin: Optional[float] = None,
    max_batch_size: Optional[int] = None,
    device: Optional[torch.device] = None,
    lr_scheduler: Optional[Any] = None,
    snapshot_dir: Optional[str] = None,
    time_budget: Optional[float] = DEFAULT_PROBE_TIME_BUDGET_S,
    log: Optional[Callable[[str], None]] = None,
    build: Optional[Callable[[], ProbeTarget]] = None,
) -> int:
    """The largest batch whose full training step fits in ``max_memory``.

    Args:
        train_step: one full step on a batch: forward, loss, backward, optimizer step, zero grad.
        make_batch: the worst-case batch of a given size (the longest inputs the run will see).
        model: the model ``train_step`` trains.
        optimizer: its optimizer, if the step keeps state.
        max_memory: the budget for a step's peak, parameters and optimizer state included:
            bytes, a size (``"6GiB"``), or a fraction of the device (``0.9``, ``"90%"``).
        safety_margin: fraction of the budget held back; ``None``: 5% on CUDA, 1% on CPU, none under an address-space limit.
        max_batch_size: the largest size worth trying, e.g. the dataset's size.
        device: where the step runs; the model's device when ``None``.
        lr_scheduler: restored with the rest, when given.
        snapshot_dir: where the temporary copy of the training state goes (a temporary
            directory when ``None``).
        time_budget: seconds the search may take; past it the largest size that fitted so
            far is checked and returned, with a line saying so. ``None``: no limit.
        log: called with a line per trial, for the answer's check, and for what a hard budget
            means here.
        build: a picklable top-level function returning a :class:`ProbeTarget` (the same
            step, batch maker, model and optimizer, built afresh). Under an outside ``RLIMIT_AS``
            on CPU with ``max_memory`` not below it (a hard budget), each trial then runs in a
            fresh process (:mod:`adaptive_batch.probe.child`) held to this process's headroom, so
            an out-of-memory trial or a crash cannot scar or end this one, and the answer is the
            largest batch that runs the first steps in a fresh process. Without it the trials run
            here and, after one runs out of memory, a fresh process may fit more (said in one line).
            A script that passes ``build`` calls this under ``if __name__ == "__main__":``, as
            multiprocessing requires. Under any hard CPU budget this process gets the recipes'
            glibc settings (:func:`~adaptive_batch.memory.device.return_freed_memory_to_os`,
            said in one line, to ``log`` or this module's logger), since it trains on the answer
            and glibc's defaults move a step's peak from process to process.

    Returns:
        The largest batch size that ran a real step within the budget, and then a step in
        this process as it stands after the probe.

    Raises:
        ConfigError: for a bad ``max_memory``, ``safety_margin``, ``max_batch_size``,
            ``time_budget`` or ``device``, a model without parameters (and no ``device``), or a
            ``make_batch`` that ignores its size; before any step runs.
        BatchSizeTooLargeError: when batch 1 does not fit.
    """
    if safety_margin is not None:
        check_safety_margin(safety_margin, key="safety_margin")
    options = ProbeOptions(
        max_memory=max_memory, memory_safety_margin=safety_margin, max_batch_size=max_batch_size,
        probe_time_budget=time_budget, probe_cache=False,
    )
    target = ProbeTarget(train_step, make_batch, model, optimizer, device, lr_scheduler).on_its_device()
    check_make_batch(make_batch)
    budget, capacity = step_budget(options, target)
    if target.device.type == "cpu" and not budget.is_soft:
        # The caller trains on the answer: under glibc's defaults its peak moved by 100 MiB from
        # process to process (BERT's answer trained in one fresh process and failed in the next).
        if glibc_mmap_threshold_set() is None:  # the Trainer and AdaptiveBatch have set and said it
            say = log if log is not None else _LOG.info
            prepare_allocator(target.device, probing=True, log=say, warn=say)
        # Only an address-space limit is each process's own: under a cgroup or the machine's
        # RAM a child's copy of the model would take from the caller's room.
        if build is not None and capacity.source == ADDRESS_SPACE_SOURCE:
            guess = _tensor_guess(target, budget=budget, snapshot_dir=snapshot_dir)
            return _probe_in_children(build, budget, capacity, guess=guess, max_batch_size=max_batch_size,
                                      time_budget=options.probe_time_budget, log=log)
        if log is not None:
            log(f"probe: {budget.describe()}; its trials run in this process, whose heap an out-of-memory trial "
                "leaves worse than a fresh one's: under an address-space limit (RLIMIT_AS), pass build=f() -> "
                "ProbeTarget to run them in fresh processes.")
    # The recipes' probe without their cache, ranks and report: each rank answers for itself.
    report = search_and_check(
        options, target, budget, capacity, TrialLimits.read(budget, capacity, target), rank_budgets=[budget.budget_bytes],
        cap=max_batch_size, seq_len=None, ranks=RankGroup.alone(), snapshot_dir=snapshot_dir, log=log,
    )
    return report.batch_size


# Address space moves in steps of glibc's heap (8 MiB and more), so the children's search settles
# within half a percent of the answer instead of crawling to one sample (19 trials on an MLP).
ADDRESS_SPACE_TOLERANCE = 0.005


def _tensor_guess(target: ProbeTarget, *, budget: MemoryBudget, snapshot_dir: Optional[str]) -> Optional[int]:
    """A first guess from steps at batch 1 and 2 in this process (nothing runs out of memory at
    those): where the operator lines' tensor bytes meet the budget. Address space holds more
    than tensors, so it guesses high; the children's trials measure from below it."""
    result = probe_max_batch_size(target, budget_bytes=budget.budget_bytes, max_batch_size=2, budget_source=budget.source,
                                  snapshot_dir=snapshot_dir)
    return None if result.estimate is None else result.estimate.max_batch_size(budget.budget_bytes)


def _probe_in_children(
    build: Callable[[], ProbeTarget],
    budget: MemoryBudget,
    capacity: DeviceCapacity,
    *,
    guess: Optional[int],
    max_batch_size: Optional[int],
    time_budget: Optional[float],
    log: Optional[Callable[[str], None]],
) -> int:
    """The search with every trial in a fresh process (:mod:`adaptive_batch.probe.child`),
    judged in the hard limit's own unit: the address space a trial's steps added, against this
    process's headroom less the safety margin. Each trial runs training's first consecutive
    steps, so no in-process check follows.

    Raises:
        BatchSizeTooLargeError: when batch 1 does not run in a fresh process.
    """
    headroom = capacity.headroom_bytes
    steps = verify_steps(torch.device("cpu"))
    if log is not None:
        log(f"probe: {budget.describe()}; each trial runs {steps} steps in a fresh process held to this process's "
            f"headroom of {format_bytes(headroom)} of address space, judged by the address space it adds.")
    # The line in address space is measured at a half and three quarters of the tensor guess
    # (tensors are part of address space, so the guess is high): at batch 1-2 glibc's heap absorbs
    # a step (a conv net's slope came out a quarter of the true one), and from a quarter and a half
    # the line still bent (4 out-of-memory trials); from here the conv net took 4 trials, none out
    # of memory.
    if guess is not None and max_batch_size is not None:
        guess = min(guess, max_batch_size)
    sizes = (1, 2) if guess is None or guess < 8 else (guess // 2, 3 * guess // 4)
    if log is not None:
        log(f"probe: the tensor bytes of steps at batch 1 and 2 put the answer at most at {guess}; "
            f"the line in address space is measured at {sizes[0]} and {sizes[1]}.")
    try:
        result = search_max_batch_size(
            # One trial longer than the whole probe may take is a hang.
            child_trial(build, headroom_bytes=headroom, steps=steps, timeout_s=time_budget),
            budget_bytes=after_margin(headroom, budget.safety_margin),
            max_batch_size=max_batch_size, warmup=False, log=log, max_overshoot=math.inf, time_budget_s=time_budget,
            release=lambda: None,  # nothing of a trial is left in this process
            estimate_sizes=sizes, tolerance=ADDRESS_SPACE_TOLERANCE,
        )
    except BatchSizeTooLargeError as e:
        raise BatchSizeTooLargeError(e.bytes_needed, e.budget_bytes, source=budget.source) from None
    return result.max_batch_size
