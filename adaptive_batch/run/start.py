"""The batch a run starts with, and the largest micro-batch, once the probe has spoken.

Pure decisions over the probe's report and the settings: they return numbers and a plan, say
them in a line, and write nothing (the controller writes the report once, after them).
"""

from typing import Optional, Tuple

from adaptive_batch.errors import ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.probe.report import ProbeReport
from adaptive_batch.probe.search import round_batch_size
from adaptive_batch.probe.service import ProbeOptions
from adaptive_batch.run.options import AdaptiveBatchOptions
from adaptive_batch.schedule.global_batch import KEY as GLOBAL_KEY
from adaptive_batch.schedule.global_batch import GlobalBatchSplit, fastest_split, split_global_batch
from adaptive_batch.schedule.growth import GrowthOptions


def first_batch(
    options: AdaptiveBatchOptions,
    *,
    batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    dataset_size: int,
    report: Optional[ProbeReport],
    resuming: bool = False,
) -> Tuple[int, int, Optional[GlobalBatchSplit]]:
    """The first step's samples per rank, the largest micro-batch, and the plan of a fixed
    ``global_batch_size`` (``None`` without one).

    Raises:
        ConfigError: when a rank's share of the global batch is more than its samples.
    """
    global_batch = options.global_batch.global_batch_size
    if global_batch is None:
        start, micro = starting_batch(
            batch_size=batch_size, gradient_accumulation_steps=gradient_accumulation_steps, report=report,
            probe=options.probe, growth=options.growth, token_budget=options.tokens.max_tokens is not None,
            resuming=resuming,
        )
        return start, micro, None
    plan = global_batch_plan(
        global_batch, world_size=world_size, dataset_size=dataset_size, batch_size=batch_size, report=report,
        throughput_tolerance=options.probe.throughput_tolerance,
    )
    logs.info(plan.describe() + "; the global batch and the LR stay, an out-of-memory error halves the micro-batch.")
    return global_batch // world_size, plan.micro_batch_limit, plan


def starting_batch(
    *,
    batch_size: int,
    gradient_accumulation_steps: int,
    report: Optional[ProbeReport],
    probe: ProbeOptions,
    growth: GrowthOptions,
    token_budget: bool = False,
    resuming: bool = False,
) -> Tuple[int, int]:
    """The first step's samples (per rank) and the largest micro-batch.

    Without growth the micro-batch is the probed batch when probing, else ``batch_size``, a step
    ``gradient_accumulation_steps`` of them. With growth ``batch_size`` x ``gradient_accumulation_steps``
    is the first step, the largest batch that fits (or ``max_batch_size``) the largest micro-batch.

    Raises:
        ConfigError: for a ``batch_size`` (times the accumulation, under growth) over
            ``max_batch_size`` where the probe does not run (nor a ``token_budget``, which draws
            up to it, nor growth by accumulation, which splits it).
    """
    accumulation = gradient_accumulation_steps
    if growth.batch_increase_function is None:
        if report is None:
            # Token budgets draw as many samples as fit the budget, max_batch_size at most.
            if probe.max_batch_size is not None and batch_size > probe.max_batch_size and not token_budget:
                raise ConfigError(
                    f"batch_size={batch_size} is over max_batch_size={probe.max_batch_size}, the bound of the probe "
                    f"and of growth, neither of which runs: set batch_size to at most {probe.max_batch_size}, or "
                    "remove max_batch_size."
                )
            return batch_size * accumulation, batch_size
        micro = report.batch_size
        logs.info(f"use_maximum_batch_size: training with batch_size={micro}")
        return micro * accumulation, micro
    # Growth is bounded by the largest batch that ran consecutive steps (not the search's answer,
    # which may have failed them), whatever batch the objective chose.
    bound = (probe.max_batch_size if report is None
             else round_batch_size(report.largest_that_trains, probe.batch_size_rounding))
    start = batch_size * accumulation
    with_accumulation = growth.grow_with_accumulation
    # A resumed run's start is its checkpoint's (one from before this check started there).
    if report is None and start > bound and not (with_accumulation or token_budget or resuming):
        # Nothing was measured: the bound is the user's own, and the LR was set for the batch asked.
        raise ConfigError(
            f"batch_size={batch_size} x gradient_accumulation_steps={accumulation} is over "
            f"max_batch_size={bound}, the bound of growth: set batch_size to at most {bound}, raise max_batch_size, "
            "or set grow_with_accumulation=True to train it in micro-batches."
        )
    if start > bound and not with_accumulation:  # said first: the start line below is the one trained
        logs.warning(
            f"batch_size={batch_size} x gradient_accumulation_steps={accumulation} is over "
            f"the largest batch that fits, {bound}: starting at {bound}."
        )
        start = bound
    logs.info(
        f"batch_increase_function: starting at {start} samples a step, micro-batches of up to "
        f"{bound}; growth " + ("may pass it by gradient accumulation." if with_accumulation else "stops there.")
    )
    return start, bound


def global_batch_plan(
    global_batch: int,
    *,
    world_size: int,
    dataset_size: int,
    batch_size: int,
    report: Optional[ProbeReport],
    throughput_tolerance: float,
) -> GlobalBatchSplit:
    """How a rank runs its share of ``global_batch``: micro-batches of the probed batch (or
    the fastest split of it), else of ``batch_size``.

    Raises:
        ConfigError: when a rank's share is more than its samples.
    """
    share = global_batch // world_size
    if share > dataset_size:
        raise ConfigError(
            f"{GLOBAL_KEY}={global_batch} is {share} samples a rank a step, more than the "
            f"{dataset_size} samples a rank has: lower {GLOBAL_KEY} to at most {dataset_size * world_size}."
        )
    if report is not None and report.throughput is not None and report.throughput.trials:
        return fastest_split(global_batch, world_size=world_size, trials=[(t.batch_size, t.seconds_per_step) for t in report.throughput.trials],
                             tolerance=throughput_tolerance)
    if report is not None:
        return split_global_batch(global_batch, world_size=world_size, largest_micro_batch=report.batch_size)
    return split_global_batch(global_batch, world_size=world_size, largest_micro_batch=batch_size, chosen_by="batch_size")
