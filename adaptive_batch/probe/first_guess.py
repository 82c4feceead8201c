"""The probe's first guess: the answer predicted from fake steps of the same model.

A fake step (``FakeTensorMode``: shapes and sizes, no memory) runs the model's forward, loss,
backward and optimizer step with nothing allocated. Measured by the same live-tensor counter as
the probe's real CPU trials, two fake steps (batch 2 and 3: batch 1 often runs other operators)
give the same line per operator the real estimate steps give, and so the same prediction, in a
fraction of their time on a large vocabulary (0.4 s against 5.8 s on the 128K-vocabulary
config). The real search then starts there: its warmup (at batch 2, where it is checked against
the fake step at 2), the guess and its neighbour, instead of the warmup, two or three estimate
steps, the prediction and its neighbour.

The unit is tensor bytes, which is what a soft budget on CPU and CUDA's allocator count; a hard
CPU limit counts address space, where the guess says nothing (the caller leaves it out there).
"""

import time
from typing import Callable, Dict, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from adaptive_batch.errors import BatchSizeTooLargeError
import adaptive_batch.logs as logs
from adaptive_batch.probe.fake_step import BuildOptimizer, ForwardBackward, build_fake_model, create_optimizer_state
from adaptive_batch.probe.search import FirstGuess, added_before_the_optimizer_step, search_max_batch_size
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.trials import measure_training_step

# The two batch sizes the guess's line goes through.
GUESS_SIZES = (2, 3)
GUESS_SOURCE = "fake steps"


def guess_max_batch_size(
    *,
    build_model: Callable[[], nn.Module],
    build_optimizer: BuildOptimizer,
    forward_backward: ForwardBackward,
    seq_len: int,
    budget_bytes: int,
    max_batch_size: Optional[int] = None,
    micro_batches: Callable[[int], int] = lambda batch_size: 1,
) -> Optional[FirstGuess]:
    """Predicts the largest batch whose step fits ``budget_bytes`` from fake steps at batch 2 and 3
    of the whole model (the probe's line per operator), allocating nothing.

    Args:
        build_model: builds the model (called under the meta device).
        build_optimizer: makes the optimizer for a list of trainable parameters (one optimizer).
        forward_backward: forward, loss and backward on a batch of ``tokens`` and ``labels``
            of shape ``[batch, seq_len]``.
        seq_len: the worst-case sample length, as the probe's batches have it.
        budget_bytes: the step's budget, as the probe's.
        max_batch_size: the cap on the answer.
        micro_batches: the micro-batches a trial at a batch size runs before its optimizer step.

    Returns:
        The guess, or ``None`` where the fake steps draw no line (batch 2 or 3 is already over
        the budget, or the peak does not grow with the batch): the real steps then draw it.

    Raises:
        Whatever a fake step raises (an operator with no fake kernel, a model the builder cannot
        make on the meta device); :func:`~adaptive_batch.probe.service.probe_batch_size` takes
        that for no guess.
    """
    start = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake_model(build_model, fake_mode)
    with fake_mode:
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad])
        create_optimizer_state(model, [optimizer])
        target = _fake_target(model, optimizer, forward_backward, seq_len, micro_batches)
        try:
            with logs.quiet():
                result = search_max_batch_size(
                    lambda b: measure_training_step(target, target.make_batch(b)), budget_bytes=budget_bytes, max_batch_size=max_batch_size, warmup=False,
                    release=lambda: None, max_overshoot=float("inf"), estimate_sizes=GUESS_SIZES, estimate_only=True,
                )
        except BatchSizeTooLargeError:
            return None
    guess = result.predicted_max_batch_size
    if result.estimate is None or not guess:
        return None
    first = result.trials[0]
    added = added_before_the_optimizer_step(first)
    return FirstGuess(guess, result.estimate, time.perf_counter() - start, GUESS_SOURCE,
                      None if added is None else (first.batch_size, added))


def _fake_target(model: nn.Module, optimizer: torch.optim.Optimizer, forward_backward: ForwardBackward, seq_len: int,
                 micro_batches: Callable[[int], int]) -> ProbeTarget:
    """The fake model's training step on token batches, as a probe target: its trials are then
    measured by :func:`~adaptive_batch.probe.trials.measure_training_step`, as real ones are."""

    def train_step(batch: Dict[str, torch.Tensor]) -> None:
        for _ in range(micro_batches(len(batch["tokens"]))):
            forward_backward(model, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def make_batch(batch_size: int) -> Dict[str, torch.Tensor]:
        return {name: torch.zeros(batch_size, seq_len, dtype=torch.long) for name in ("tokens", "labels")}

    return ProbeTarget(train_step, make_batch, model, optimizer, torch.device("cpu"))
