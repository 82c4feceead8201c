"""The probe's answer checked the way training runs it: consecutive steps, nothing freed between.

A trial starts on an emptied cache; training's second step does not. What grows between them
(on CUDA the caching allocator's reserved-but-unallocated blocks, on CPU glibc's kept heap) is
what a found batch that fails at step 2 or 7 ran into on the card. So the answer runs several
consecutive real steps with the training state put back afterwards, on CUDA held to the budget
(``set_per_process_memory_fraction``, so the reserved memory counts, not only the allocated),
and the largest size that passes is the answer.

On CUDA the check starts as a fresh process's training does: the optimizer state is put back
(empty, before a run's first step) and cuBLAS's workspaces are freed. cuBLAS takes one from the
caching allocator per thread at its first product and keeps it; kept from the probe's first
small trial they sit below everything, while a fresh process makes them among step 1's
activations, where they split the room step 2's large blocks need. On an H200 the tiny model's
answer, 87 under 2 GiB, passed a check with them kept and failed at step 2 in a fresh process;
with cuBLAS's workspaces at size 0 the fresh process trained it (``benchmarks/gpu_fragmentation.py``).
They are freed after the check too, so training in the probing process starts as the check did.
"""

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

import adaptive_batch.logs as logs
from adaptive_batch.batch_tensors import tensors_of
from adaptive_batch.faults import stop_point
from adaptive_batch.memory.device import cuda_index, cuda_memory_fraction
from adaptive_batch.memory.oom import catch_oom, release_memory
from adaptive_batch.memory.tracker import measure_peak_bytes
from adaptive_batch.probe.target import ProbeTarget

# How far the answer steps down after a failed check: a few sizes of a large batch at once,
# then a bisection back up between the passing and the failing size.
STEP_DOWN = 0.02
# Consecutive steps the answer must run. On CPU a step's allocations grow over the first few
# (optimizer state in place, glibc's heap keeping freed blocks). On CUDA the reserved memory
# crept for longer (a 152K-vocabulary model on an H100 ran 6 steps and failed the 7th), and a
# step costs a fraction of a second.
VERIFY_STEPS = {"cpu": 3, "cuda": 10}


def verify_steps(device: torch.device) -> int:
    """How many consecutive steps the answer must run on ``device``."""
    return VERIFY_STEPS.get(device.type, VERIFY_STEPS["cpu"])


@contextmanager
def cuda_memory_cap(device: torch.device, limit_bytes: Optional[int]) -> Iterator[None]:
    """On CUDA, holds this process's reserved memory to ``limit_bytes`` (a larger allocation is
    a real out-of-memory error) and puts the previous fraction back; elsewhere does nothing."""
    if device.type != "cuda" or limit_bytes is None:
        yield
        return
    index = cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    previous = cuda_memory_fraction(device)
    torch.cuda.set_per_process_memory_fraction(min(previous, limit_bytes / total), index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, index)


# The held-back share of the heap is taken in blocks of this size: large enough to stand for a
# step's large tensors, small enough to fit the holes a grown heap already has.
RESERVE_BLOCK = 2 * 2**20


@contextmanager
def heap_reserve(device: torch.device, reserve_bytes: int) -> Iterator[None]:
    """On CPU, takes ``reserve_bytes`` (the safety margin's share of the headroom) from the heap
    for the block, so the steps in it pass with that much less room than training will have:
    the room for what glibc's heap lays out differently from one step to the next. An
    ``RLIMIT_AS`` lowered by as much would hold back nothing in a heap the trials already grew
    to the limit; the taken blocks do. Elsewhere (CUDA is held by :func:`cuda_memory_cap`) does
    nothing.

    Raises:
        RuntimeError: an out-of-memory error when the reserve itself does not fit.
    """
    blocks = reserve_bytes // RESERVE_BLOCK if device.type == "cpu" else 0
    taken = [torch.empty(RESERVE_BLOCK, dtype=torch.uint8) for _ in range(blocks)]
    try:
        yield
    finally:
        del taken


def runs_consecutive_steps(
    batch_size: int,
    target: ProbeTarget,
    *,
    snapshot_dir: Optional[str] = None,
    budget_bytes: Optional[int] = None,
    reserve_bytes: int = 0,
    soft_budget: bool = False,
    agree: Callable[[bool], bool] = lambda failed: failed,
) -> bool:
    """Whether ``batch_size`` runs :func:`verify_steps` consecutive real steps of ``target`` now,
    as the caller's loop will, with the training state put back afterwards; a failure is said in
    a line.

    Args:
        batch_size: the size to check.
        target: what the steps train, on its resolved device.
        snapshot_dir: where the temporary copy of the training state goes.
        budget_bytes: on CUDA the steps are held to it; ``None`` for the device as it is.
        reserve_bytes: on CPU the heap held back from the steps (see :func:`heap_reserve`).
        soft_budget: on CPU, judge ``budget_bytes`` by each step's live tensor bytes (a soft
            budget's measure, the same in every process); a step over it fails the check.
        agree: turns this process's outcome into every rank's (``RankGroup.any`` of the failures).

    Returns:
        ``True`` when every step ran (on every rank).

    Raises:
        Whatever the step raises other than an out-of-memory error.
    """
    device = target.device
    steps = verify_steps(device)
    by_tensors = soft_budget and device.type == "cpu" and budget_bytes is not None

    def run() -> Optional[str]:
        with heap_reserve(device, reserve_bytes):
            for step in range(steps):
                stop_point()
                batch = target.make_batch(batch_size)
                if not by_tensors:
                    target.train_step(batch)
                    continue
                baseline = target.state_tensors() + list(tensors_of(batch))
                peak = measure_peak_bytes(lambda: target.train_step(batch), device, baseline)
                if peak > budget_bytes:
                    return f"step {step + 1}'s live tensors peaked at {peak} bytes, over the budget's {budget_bytes}"
        return None

    release_memory(device, cublas_workspaces=True)
    # The state goes back after the cap is lifted: restoring is not training's to pay for.
    with target.snapshot(snapshot_dir), cuda_memory_cap(device, budget_bytes):
        # The check runs a size the search saw fit, or one below it.
        over_budget, failure = catch_oom(run, after_a_smaller_step=True)
    release_memory(device, cublas_workspaces=True)
    failure = failure or over_budget
    failed = agree(failure is not None)
    if failed:
        logs.info(f"probe: batch {batch_size} did not run {steps} consecutive steps within the budget ({failure or 'another rank'}).")
    return not failed



def largest_that_trains(batch_size: int, target: ProbeTarget, **check: Any) -> int:
    """The largest size up to ``batch_size`` that passes :func:`runs_consecutive_steps`
    (``check`` is its keyword arguments): 2% lower at a time until one passes, then, on CUDA, a
    bisection back up to the size just below one that failed.

    Returns:
        ``batch_size`` if it passes, else the largest smaller size that does (1 at the least).
    """
    if batch_size <= 1 or runs_consecutive_steps(batch_size, target, **check):
        return batch_size
    # One size at a time, however many fail: in a heap the search's out-of-memory trials scarred
    # (bf16 under a real limit), a faster walk (4%, 8%, ...) answered 23 where 99 was found, and
    # training there ran out of memory and crashed in oneDNN; the walk to 3 trained.
    bad, good = batch_size, _step_down(batch_size)
    while good > 1 and not runs_consecutive_steps(good, target, **check):
        bad, good = good, _step_down(good)
    # Back up only on CUDA, where a step's memory repeats: on CPU glibc's heap moves by 16-33 MiB
    # between runs, so a size that passed just under a failing one can fail in the next step.
    while target.device.type == "cuda" and bad - good > 1:
        middle = (good + bad) // 2
        if runs_consecutive_steps(middle, target, **check):
            good = middle
        else:
            bad = middle
    logs.info(f"probe: the answer is {good}, which runs {verify_steps(target.device)} consecutive steps; {bad} did not.")
    if good * 2 <= batch_size:
        logs.warning(
            f"probe: the answer's check fell from the search's {batch_size} to {good}: steps that ran in the search "
            "failed here, likely in a heap its out-of-memory trials left worse than a fresh process's (bf16 kernels "
            "that allocate outside torch too); trials in fresh processes (find_max_batch_size(build=f)) or a soft "
            "max_memory find what a fresh process trains."
        )
    return good


def _step_down(batch_size: int) -> int:
    return max(1, min(batch_size - 1, int(batch_size * (1 - STEP_DOWN))))
