"""The truths the probe's answers are judged against, measured by tools that are not ours.

A soft budget's truth is torch's own ``MemTracker`` on the caller's training step: the largest
batch whose tracked peak (parameters, gradients, optimizer state and activations) is within the
budget. Our counter (``adaptive_batch.memory.tracker``) is never its own reference.
"""

from typing import Any, Callable, Optional

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from adaptive_batch.probe.snapshot import TrainingStateSnapshot


def memtracker_peak_bytes(step: Callable[[], None], *, model: torch.nn.Module,
                          optimizer: Optional[torch.optim.Optimizer], device: torch.device) -> int:
    """``MemTracker``'s peak of ``step()`` on ``device``, the model's and the optimizer's state
    included (and the batch, when ``step`` makes it)."""
    tracker = MemTracker()
    tracker.track_external(*(m for m in (model, optimizer) if m is not None))
    with tracker:
        step()
    peaks = tracker.get_tracker_snapshot("peak")
    return int(next(v["Total"] for k, v in peaks.items() if torch.device(k).type == device.type))


def memtracker_max_batch_size(
    train_step: Callable[[Any], None],
    make_batch: Callable[[int], Any],
    *,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    budget_bytes: int,
    upper: int,
    device: torch.device = torch.device("cpu"),
    snapshot_dir: Optional[str] = None,
    smallest: int = 1,
) -> int:
    """The largest batch up to ``upper`` whose ``MemTracker`` peak is within ``budget_bytes``,
    by doubling and bisection from ``smallest`` (a step's tensor peak grows with its batch; 2
    for a model whose BatchNorm cannot train 1); ``smallest - 1`` when ``smallest`` is over. The
    training state is put back afterwards. Each measured step runs after one warm-up step at the
    same size, so the optimizer state exists, as in training's second step."""
    def peak(b: int) -> int:
        with TrainingStateSnapshot(model, optimizer, directory=snapshot_dir):
            train_step(make_batch(b))
            # The batch is made inside: it is alive through the step, as in training.
            return memtracker_peak_bytes(lambda: train_step(make_batch(b)), model=model, optimizer=optimizer, device=device)

    lo, hi = smallest - 1, smallest
    while hi <= upper and peak(hi) <= budget_bytes:  # doubling, then bisection
        lo, hi = hi, 2 * hi
    hi = min(hi, upper + 1)
    while hi - lo > 1:
        middle = (lo + hi) // 2
        if peak(middle) <= budget_bytes:
            lo = middle
        else:
            hi = middle
    return lo
