"""One optimizer step's batch run as micro-batches, retried smaller after an out-of-memory.

The global batch (what one optimizer step learns from) is split into micro-batches of at most
``micro_batch_limit`` rows, as equal as possible, whose gradients accumulate. The loss is summed
per token over all of them and divided by the step's token count once, so the update equals
the one a single big batch would give. When a micro-batch runs out of memory the step's
partial gradients are dropped and the same rows run again in halves: no sample is lost or seen
twice, and the lowered limit is returned for the steps after.
"""

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.errors import MicroBatchOutOfMemoryError, PeerOutOfMemoryError
import adaptive_batch.logs as logs
from adaptive_batch.memory.oom import catch_oom, release_memory
from adaptive_batch.schedule.global_batch import micro_batch_sizes

Batch = Any  # any structure of tensors (see adaptive_batch.data.layout)
ForwardBackward = Callable[[Batch], Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AccumulatedStep:
    """What :func:`accumulate_gradients` ran.

    Attributes:
        loss_sum: the summed (per-token loss x tokens) over all micro-batches, detached.
        num_tokens: the step's count of tokens that carry a loss.
        micro_batch_sizes: the sizes that finally ran.
        micro_batch_limit: the limit after any retries (lower than asked if one ran out).
        oom_retries: how many times the step was restarted smaller.
        oom_messages: the out-of-memory messages, one per retry.
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    micro_batch_sizes: List[int]
    micro_batch_limit: int
    oom_retries: int = 0
    oom_messages: List[str] = field(default_factory=list)


def accumulate_gradients(
    forward_backward: ForwardBackward,
    batch: Batch,
    *,
    rows: int,
    micro_batch_limit: int,
    zero_grad: Callable[[], None],
    retry_on_oom: bool = True,
    device: Optional[torch.device] = None,
    agree_on_oom: Optional[Callable[[bool], bool]] = None,
    observer: Optional[Any] = None,
    min_micro_batches: int = 1,
    layout: BatchLayout = BatchLayout(),
) -> AccumulatedStep:
    """Runs forward and backward over ``batch`` in micro-batches, accumulating gradients.

    Args:
        forward_backward: runs one micro-batch's forward and backward; returns its summed
            loss (per-token loss x tokens) and token count.
        batch: the whole step's collated batch.
        rows: its samples (every tensor with this many along ``layout.batch_dim`` is split).
        micro_batch_limit: the most rows one micro-batch may have.
        zero_grad: drops the gradients, to restart a step that ran out of memory.
        retry_on_oom: restart the step in smaller micro-batches after an out-of-memory error,
            with a warning; when ``False`` the error propagates.
        device: the device, to give its cached memory back between attempts.
        agree_on_oom: for data-parallel ranks, ``agree(failed) -> failed on any rank`` after
            every micro-batch, so all ranks restart with the same smaller micro-batches (an error
            raised inside a collective leaves a rank waiting there, out of reach).
        observer: told ``start()`` at every attempt, ``before_micro_batch(piece)`` before each
            forward and ``after_micro_batch(tokens)`` after each backward (the noise scale's
            :class:`~adaptive_batch.schedule.noise_scale.MicroBatchGradients`, ``NormLayerGradients``).
        min_micro_batches: split the step into at least this many (2: two gradients to
            compare, ``noise_scale_split_step``); the limit is unchanged by it.
        layout: where the batch's samples lie (any structure; the first dimension by default).

    Returns:
        The step's summed loss, token count and what ran.

    Raises:
        MicroBatchOutOfMemoryError: if even one-sample micro-batches run out of memory.
        RuntimeError: any other error of ``forward_backward``, or an out-of-memory error
            when ``retry_on_oom`` is ``False``.
    """
    limit = micro_batch_limit
    messages: List[str] = []
    while True:
        sizes = micro_batch_sizes(rows, limit, min_micro_batches)
        if observer is not None:
            observer.start()
        run = partial(_run_micro_batches, forward_backward, batch, sizes, layout, agree_on_oom, observer)
        sums, message = catch_oom(run) if retry_on_oom else (run(), None)
        if message is None:
            return AccumulatedStep(*sums, sizes, limit, len(messages), messages)
        # Out of the except block, so the traceback no longer holds the failed step's tensors.
        zero_grad()
        release_memory(device)
        messages.append(message)
        limit = _halved_limit(max(sizes), rows, message)


def _halved_limit(largest: int, rows: int, message: str) -> int:
    """The limit a step that ran out of memory in micro-batches of up to ``largest`` retries at,
    said in a warning.

    Raises:
        MicroBatchOutOfMemoryError: when ``largest`` was already one sample.
    """
    if largest == 1:
        raise MicroBatchOutOfMemoryError(
            f"out of memory with micro-batches of 1 sample ({message}); the model and "
            "optimizer alone nearly fill the memory: lower max_seq_len or free memory."
        )
    limit = max(1, largest // 2)
    logs.warning(
        f"out of memory in a step of {rows} samples in micro-batches of up to {largest} "
        f"({message}); retrying it in micro-batches of up to {limit}."
    )
    return limit


def _run_micro_batches(
    forward_backward: ForwardBackward,
    batch: Batch,
    sizes: List[int],
    layout: BatchLayout,
    agree_on_oom: Optional[Callable[[bool], bool]],
    observer: Optional[Any] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    loss_sum = num_tokens = None
    for piece in layout.split(batch, sizes):
        if observer is not None:
            observer.before_micro_batch(piece)
        if agree_on_oom is None:
            loss, tokens = forward_backward(piece)
        else:
            result, failure = catch_oom(lambda: forward_backward(piece))
            if agree_on_oom(failure is not None):
                raise PeerOutOfMemoryError(failure or "out of memory on another rank")
            loss, tokens = result
        if observer is not None:
            observer.after_micro_batch(tokens)
        loss_sum = loss if loss_sum is None else loss_sum + loss
        num_tokens = tokens if num_tokens is None else num_tokens + tokens
    return loss_sum, num_tokens


@dataclass
class StepOutcome:
    """One optimizer step's forward and backward, summed over ranks.

    Attributes:
        accumulated: what ran on this rank (micro-batches, retries).
        samples: this rank's samples.
        global_samples: the samples of all ranks.
        num_tokens: the tokens that carry a loss, all ranks.
        padded_tokens: the batch's padded size in tokens, all ranks.
        loss: the mean loss per counted token, all ranks.
        interval: the growth boundary whose batch the step ran (the epoch, per epoch).
        noise_scale: the gradient noise scale in samples after this step, when measured.
        lr: the LR the optimizer step used (NaN without an attached LR).
        grad_norm: what the optimizer step returned (the clipped gradients' norm, or ``None``).
        global_step: optimizer steps taken, this one included.
    """

    accumulated: AccumulatedStep
    samples: int
    global_samples: int
    num_tokens: float
    padded_tokens: float
    loss: float
    interval: int = 0
    noise_scale: Optional[float] = None
    lr: float = float("nan")
    grad_norm: Any = None
    global_step: int = 0

    def metrics(self, *, samples_seen: int, tokens_seen: int, world_size: int, seconds: float) -> Dict[str, float]:
        """The batch's per-step metrics, for the metric logger (keys as the recipes log them)."""
        # Without an input tensor to read (a batch with no ``input_key``) padding is not counted.
        padding = {} if not self.padded_tokens else {
            "padded_tokens": int(self.padded_tokens), "padding_fraction": 1 - self.num_tokens / self.padded_tokens,
        }
        return {
            "batch_size": self.global_samples,
            "micro_batch_size": max(self.accumulated.micro_batch_sizes),
            "grad_accum_steps": len(self.accumulated.micro_batch_sizes),
            "samples_seen": samples_seen,
            "tokens_seen": tokens_seen,
            "oom_retries": self.accumulated.oom_retries,
            "tokens_per_second_per_gpu": self.num_tokens / world_size / seconds,
            "real_tokens": int(self.num_tokens),
            **padding,
        }
