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
no allocator option (where its caller set the probe's, as the Trainer does, it gives glibc's fast
thresholds back for training: :func:`~adaptive_batch.memory.device.relax_allocator_for_training`).
Under a hard CPU budget it gives the process the recipes' glibc settings
(said in one line), since the caller trains on the answer and glibc's defaults move a step's
peak from process to process; the answer is still this process's, and a fresh process may fit
a little more after a trial that ran out of memory here, unless ``build=`` runs the trials in
fresh processes (docs/probe.md). It is the recipes' probe
(:func:`~adaptive_batch.probe.service.search_and_check`, what ``probe_batch_size`` runs) without
the cache, the ranks and the report, unless ``build=`` takes the trials to fresh processes.
"""

from dataclasses import replace
import functools
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import BatchSizeTooLargeError, ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.memory.device import ADDRESS_SPACE_SOURCE, relax_allocator_for_training
from adaptive_batch.memory.oom import collections_of_new_objects
from adaptive_batch.probe.service import (
    DEFAULT_PROBE_TIME_BUDGET_S, MemorySpec, ProbeOptions, TrialLimits, search_and_check, step_budget,
)
from adaptive_batch.probe.target import ProbeTarget, check_make_batch, other_optimizers_put_back
from adaptive_batch.validation import check_callable, check_positive_number, check_safety_margin


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
        max_memory: the budget for a step's peak, parameters and optimizer state included (a
            soft budget counts the tensors of ``model``, ``optimizer`` and the step; others alive
            beside them, a frozen teacher passed to neither, are not: lower it by their size):
            bytes, a size (``"6GiB"``), or a fraction of the device (``0.9``, ``"90%"``). A size is
            a soft budget, judged by tensor bytes; a fraction of an address-space limit
            (``RLIMIT_AS``) is that limit less the rest, judged by real allocation failures.
        safety_margin: fraction of the budget held back; ``None``: 5% on CUDA, 1% on CPU, 0.3%
            when ``build`` takes the trials to fresh processes.
        max_batch_size: the largest size worth trying, e.g. the dataset's size.
        device: where the step runs; the model's device when ``None``.
        lr_scheduler: restored with the rest, when given.
        snapshot_dir: where the temporary copy of the training state goes (a temporary
            directory when ``None``).
        time_budget: seconds the search may take; past it the largest size that fitted so
            far is checked and returned, with a line saying so. ``None``: no limit.
        log: called with a line per trial, for the answer's check, and for what a hard budget
            means here (``None``: the ``adaptive_batch`` logger).
        build: a picklable top-level function returning a :class:`ProbeTarget` (the same
            step, batch maker, model and optimizer, built afresh). Under an outside ``RLIMIT_AS``
            on CPU with ``max_memory`` not a size below it (a hard budget), each trial then runs in a
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
            ``time_budget``, ``device``, ``lr_scheduler``, ``log`` or ``build``, a model without parameters (and no ``device``), or a
            ``make_batch`` that ignores its size; before any step runs; for ``max_batch_size=1``
            where the model cannot train a batch of 1 (its BatchNorm needs 2 samples); for a
            ``train_step`` that steps an optimizer over parameters that are not ``model``'s (the
            probe could not put them back), before that step.
        BatchSizeTooLargeError: when batch 1 does not fit (batch 2, where 1 cannot train).
    """
    _check_arguments(safety_margin=safety_margin, time_budget=time_budget, log=log, build=build)
    search = functools.partial(
        _search, train_step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory=max_memory,
        safety_margin=safety_margin, max_batch_size=max_batch_size, device=device, lr_scheduler=lr_scheduler,
        snapshot_dir=snapshot_dir, time_budget=time_budget, log=log, build=build,
    )
    started = time.perf_counter()
    try:
        return search()
    except Exception as e:  # noqa: BLE001 - a trial in a fresh process reports it as its traceback's text
        if not needs_two_samples(e):
            raise
    with logs.lines_to(log):
        if max_batch_size == 1:
            raise ConfigError(
                "max_batch_size=1, but a batch of 1 does not train (the model's BatchNorm needs 2 samples a channel): "
                "raise max_batch_size, or use a normalization without batch statistics (LayerNorm, GroupNorm)."
            ) from None
        logs.info("probe: a batch of 1 does not train (the model's BatchNorm needs 2 samples a channel): the search "
                  "runs again from 2, each trial's batch_size one less than the batch it trains.")
    # The search's first size is 1, its line and bounds measured from there: each size n stands for n + 1.
    # It has what the first search left of the time budget (a stopped search answers what it found);
    # with build= the budget is also each trial process's time before it is called hung: kept whole.
    left = time_budget if time_budget is None or build is not None else max(
        time_budget - (time.perf_counter() - started), MIN_TIME_LEFT_S)
    try:
        return 1 + search(make_batch=NextSize(make_batch),
                          max_batch_size=None if max_batch_size is None else max_batch_size - 1,
                          build=None if build is None else NextSizeBuild(build), time_budget=left)
    except BatchSizeTooLargeError as e:
        raise BatchSizeTooLargeError(e.bytes_needed, e.budget_bytes, e.source, e.rank, smallest=2) from None


def _check_arguments(*, safety_margin: Optional[float], time_budget: Optional[float], log: Any, build: Any) -> None:
    """Raises:
    ConfigError: for a bad one of these, each named as :func:`find_max_batch_size` takes it."""
    if safety_margin is not None:
        check_safety_margin(safety_margin, key="safety_margin")
    if time_budget is not None:  # not as the recipes' key, probe_time_budget, names it
        check_positive_number("time_budget", time_budget, "seconds, e.g. 600 (the default), or None for no limit")
    check_callable("log", log, "print, or a logger's info", allow_none=True)
    check_callable("build", build, "my_module.build_target, a top-level f() -> ProbeTarget(...)", allow_none=True)


# The least time a search from 2 is given when the first search spent the budget: its first trial.
MIN_TIME_LEFT_S = 0.001


def needs_two_samples(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal of a training batch of one sample (batch norm)."""
    return "Expected more than 1 value per channel when training" in str(error)


class NextSize:
    """``make_batch`` one sample larger: the search's size ``n`` trains ``n + 1`` (picklable,
    for a trial in a fresh process)."""

    def __init__(self, make_batch: Callable[[int], Any]) -> None:
        self.make_batch = make_batch

    def __call__(self, batch_size: int) -> Any:
        return self.make_batch(batch_size + 1)


class NextSizeBuild:
    """``build``'s target with its batch maker one sample larger (picklable where ``build`` is)."""

    def __init__(self, build: Callable[[], ProbeTarget]) -> None:
        self.build = build

    def __call__(self) -> ProbeTarget:
        target = self.build()
        return replace(target, make_batch=NextSize(target.make_batch))


def _search(train_step: Callable[[Any], None], *, make_batch: Callable[[int], Any], model: nn.Module,
            optimizer: Optional[torch.optim.Optimizer], max_memory: MemorySpec, safety_margin: Optional[float],
            max_batch_size: Optional[int], device: Optional[torch.device], lr_scheduler: Optional[Any],
            snapshot_dir: Optional[str], time_budget: Optional[float], log: Optional[Callable[[str], None]],
            build: Optional[Callable[[], ProbeTarget]]) -> int:
    """:func:`find_max_batch_size`'s search, from batch 1."""
    with logs.lines_to(log), collections_of_new_objects():
        options = ProbeOptions(
            max_memory=max_memory, memory_safety_margin=safety_margin, max_batch_size=max_batch_size,
            probe_time_budget=time_budget, probe_cache=False,
        )
        target = ProbeTarget(train_step, make_batch, model, optimizer, device, lr_scheduler).on_its_device()
        target = replace(target, make_batch=check_make_batch(make_batch))
        budget, capacity, in_children = step_budget(options, target, build=build)
        if build is not None and not in_children:
            logs.info(f"probe: build= is not used: {_why_build_is_not_used(capacity.source, target.device)}")
        if target.device.type == "cpu" and not budget.is_soft and build is None:
            logs.info(f"probe: {budget.describe()}; its trials run in this process, whose heap an out-of-memory trial "
                      "leaves worse than a fresh one's (find_max_batch_size(build=f) with f() -> ProbeTarget runs "
                      "them in fresh processes).")
        # The recipes' probe without their cache, ranks and report: each rank answers for itself.
        with other_optimizers_put_back(target):
            report = search_and_check(
                options, target, budget, capacity, TrialLimits.read(budget, capacity, target),
                rank_budgets=[budget.budget_bytes],
                cap=max_batch_size, seq_len=None, ranks=RankGroup.alone(), snapshot_dir=snapshot_dir,
                build=build if in_children else None,
            )
        # Where the caller set the probe's thresholds (the Trainer), a soft answer trains on glibc's fast ones.
        relax_allocator_for_training(target.device, soft_budget=budget.is_soft)
        return report.batch_size


def _why_build_is_not_used(capacity_source: str, device: torch.device) -> str:
    """Why the trials run in this process although ``build`` could make fresh ones: no
    address-space limit on CPU, or (under one) a soft budget, the only other case."""
    if device.type != "cpu" or capacity_source != ADDRESS_SPACE_SOURCE:
        return (f"fresh processes are for an address-space limit (RLIMIT_AS) on CPU; this process's limit is "
                f"{capacity_source} on {device.type}.")
    return ("a soft budget (max_memory as a size) is judged by tensor bytes, the same in any process; "
            "max_memory=None, or a share such as '90%', runs the trials in fresh processes.")
