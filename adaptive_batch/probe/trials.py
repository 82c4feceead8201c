"""The offline probe: real training steps at trial batch sizes, then everything put back.

:func:`probe_max_batch_size` takes a :class:`~adaptive_batch.probe.target.ProbeTarget` (a
training-step callable, a batch maker and the state they change), so it works for any loop, not
only the recipes in this repository::

    target = ProbeTarget(lambda batch: my_step(model, optimizer, batch),
                         lambda b: worst_case_batch(b, seq_len=2048), model, optimizer, torch.device("cuda"))
    result = probe_max_batch_size(target, budget_bytes=70 * 2**30)
"""

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, Optional

import torch

from adaptive_batch.batch_tensors import tensors_of
from adaptive_batch.errors import BatchSizeTooLargeError
from adaptive_batch.faults import fault_point, stop_point
from adaptive_batch.memory.device import free_mkl_buffers
from adaptive_batch.memory.oom import collections_of_new_objects, release_memory
from adaptive_batch.memory.tracker import StepMemory, measure_phase_peaks
from adaptive_batch.probe.search import FirstGuess, SearchResult, search_max_batch_size
from adaptive_batch.probe.target import ProbeTarget


def measure_training_step(target: ProbeTarget, batch: Any) -> StepMemory:
    """Runs ``target.train_step(batch)`` once on ``target.device`` and measures it: the peak of
    each phase and, on CPU, the memory after each operator, with the training state and the batch
    counted. Afterwards MKL's buffers for the step's product shapes are given back
    (:func:`free_mkl_buffers`): kept, those of every size a probe tries pile up in a process that
    trains one size (with 2 threads, 26 MiB by the 6th trial of the 152K-vocabulary config, enough
    for its true maximum to fail).

    Raises:
        Whatever the step raises, out-of-memory errors included (its gradients are dropped).
    """
    model, optimizer = target.model, target.optimizer
    baseline = target.state_tensors() + list(tensors_of(batch))
    try:
        return measure_phase_peaks(lambda: target.train_step(batch), target.device, baseline, model=model,
                                   optimizer=optimizer)
    finally:
        # A step that failed half-way leaves gradients behind.
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        free_mkl_buffers()


@collections_of_new_objects()
def probe_max_batch_size(
    target: ProbeTarget,
    *,
    budget_bytes: int,
    max_batch_size: Optional[int] = None,
    snapshot_dir: Optional[str] = None,
    wrap_trial: Optional[Callable[[Callable[[int], int]], Callable[[int], int]]] = None,
    trial_limit: Optional[Callable[[], ContextManager]] = None,
    budget_source: str = "max_memory",
    time_budget_s: Optional[float] = None,
    agree: Callable[[bool], bool] = lambda stop: stop,
    oom_scars_caller: bool = False,
    restore_state: bool = True,
    estimate_only: bool = False,
    first_guess: Optional[FirstGuess] = None,
) -> SearchResult:
    """Finds the largest batch whose full training step fits in ``budget_bytes``.

    Each trial runs ``target.train_step(target.make_batch(b))``, measuring each phase's peak and, on
    CPU, each operator's (:func:`measure_training_step`); state and RNG come back after the last.

    Args:
        target: what the trials train, on its resolved device.
        budget_bytes: the most a step's peak may be.
        max_batch_size: the largest size worth trying (e.g. the dataset size).
        snapshot_dir: where the temporary snapshot file goes.
        wrap_trial: wraps the measured trial, e.g. ``LockstepTrial`` (ranks agree on every outcome).
        trial_limit: a context the trials (not the snapshot) run in (``trial_memory_limit``).
        budget_source: what set ``budget_bytes``, for the advice when batch 1 does not fit.
        time_budget_s, oom_scars_caller, estimate_only, first_guess, agree: as :func:`search_max_batch_size`.
        restore_state: ``False``: no snapshot (a process that ends after the trials).

    Returns:
        The search result with every trial.

    Raises:
        BatchSizeTooLargeError: when batch size 1 does not fit.
    """
    device = target.device

    def run_trial(batch_size: int) -> StepMemory:
        measured = measure_training_step(target, target.make_batch(batch_size))
        fault_point("probe_trial")
        stop_point()
        return measured

    with (target.snapshot(snapshot_dir) if restore_state else nullcontext()), (trial_limit() if trial_limit is not None else nullcontext()):
        try:
            result = search_max_batch_size(
                run_trial if wrap_trial is None else wrap_trial(run_trial),
                budget_bytes=budget_bytes, max_batch_size=max_batch_size, release=lambda: release_memory(device),
                settle_slope=device.type == "cuda",  # no operator timeline there
                time_budget_s=time_budget_s, agree=agree, oom_scars_caller=oom_scars_caller,
                estimate_only=estimate_only, first_guess=first_guess,
            )
        except BatchSizeTooLargeError as e:
            raise BatchSizeTooLargeError(e.bytes_needed, e.budget_bytes, source=budget_source) from None
    release_memory(device)
    return result


def worst_case_text_batch(
    batch_size: int,
    *,
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    seed: int = 0,
) -> Dict[str, torch.Tensor]:
    """A batch of ``batch_size`` sequences all ``seq_len`` tokens long, every label counted.

    Real batches are padded to their longest sample, so none is larger than this one; token
    values come from a private generator and leave the global RNG alone.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    tokens = tokens.to(device)
    return {"tokens": tokens, "labels": tokens.clone()}
