"""Predicting a training step's peak memory without allocating it.

The model is built on the meta device, then given fake storage (``FakeTensorMode``): every
tensor has a shape, a dtype and a size in bytes, and none has memory. Full training steps
(forward, loss, backward, optimizer step) run on fake batches under torch's ``MemTracker``,
which records the peak and what it is made of: parameters, gradients, optimizer state,
activations. Two measured batch sizes give the same line the probe fits
(``peak(b) = fixed + per_sample * b``), per category, and so the largest batch for any device
memory, on a laptop, for an 80 GB card.

Blind spots: kernels whose memory differs between devices (CUDA's fused attention keeps no
``seq x seq`` matrix, the CPU math path does), the CUDA context and the caching allocator's
fragmentation (what ``memory_safety_margin`` is for), and anything ``torch.compile`` changes.
"""

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker

from adaptive_batch.estimator import LinearMemoryEstimate
from adaptive_batch.search import BatchSizeTooLargeError, powers_of_two, search_max_batch_size

# MemTracker's categories, as the table names them; temporaries of backward count as activations.
CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "activations",
    "Other": "other",
}
CATEGORY_ORDER = ("parameters", "gradients", "optimizer_state", "activations", "buffers", "other")

BuildOptimizer = Callable[[nn.Module], torch.optim.Optimizer]
ForwardBackward = Callable[[nn.Module, Dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class PlanRow:
    """The peak of one batch size, whole and by category (bytes)."""

    batch_size: int
    peak_bytes: int
    categories: Dict[str, int]


@dataclass
class MemoryPlan:
    """What :func:`plan_memory` predicts.

    Attributes:
        seq_len: the sequence length every sample was planned at.
        measured: every fake-measured step (batch 1 and 2, and the search's), by batch size.
        estimate: the line ``peak(b) = fixed + per_sample * b`` through batch 1 and 2: where the
            search starts, and the table's rows between measured steps.
        device_memory_bytes: the memory planned for, or ``None``.
        budget_bytes: that memory less the safety margin, or ``None``.
        max_batch_size: the largest batch whose own fake step is within the budget, the size
            above it over (or the cap); ``None`` without a budget, 0 when batch 1 is over.
        rows: predicted peaks for the table's batch sizes.
        seconds: how long planning took.
    """

    seq_len: int
    measured: List[PlanRow]
    estimate: LinearMemoryEstimate
    device_memory_bytes: Optional[int]
    budget_bytes: Optional[int]
    max_batch_size: Optional[int]
    rows: List[PlanRow] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def build_fake_model(build_model: Callable[[], nn.Module], fake_mode: FakeTensorMode) -> nn.Module:
    """Builds the model on the meta device and gives it fake CPU storage.

    torchtune's rotary embeddings compute their cache at init; it is recomputed for real (it is
    small), since the meta build left it empty.
    """
    with torch.device("meta"):
        model = build_model()
    with fake_mode:
        model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "rope_init"):
            with unset_fake_temporarily():
                module.rope_init()
    return model


class _NoHook:
    def remove(self) -> None:
        pass


def fake_step_peak(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    forward_backward: ForwardBackward,
    batch: Dict[str, torch.Tensor],
) -> PlanRow:
    """Runs one fake training step under a fresh ``MemTracker``; its peak by category."""
    tracker = MemTracker()
    # MemTracker hooks every parameter's gradient, which fails on frozen ones (LoRA's base
    # weights): mark those as hooked already, with handles that remove nothing.
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    tracker.track_external(model, optimizer)
    with tracker:
        forward_backward(model, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    snapshot = tracker.get_tracker_snapshot("peak")
    categories = {name: 0 for name in CATEGORY_ORDER}
    total = 0
    for per_device in snapshot.values():
        for kind, nbytes in per_device.items():
            label = getattr(kind, "value", kind)
            if label == "Total":
                total += nbytes
            else:
                categories[CATEGORIES.get(label, "other")] += nbytes
    return PlanRow(batch_size=int(batch["tokens"].shape[0]), peak_bytes=total, categories=categories)


def plan_memory(
    *,
    build_model: Callable[[], nn.Module],
    build_optimizer: BuildOptimizer,
    forward_backward: ForwardBackward,
    seq_len: int,
    device_memory_bytes: Optional[int] = None,
    safety_margin: float = 0.0,
    max_batch_size: Optional[int] = None,
    table_batch_sizes: Optional[Iterable[int]] = None,
) -> MemoryPlan:
    """Predicts a training step's peak at every batch size, allocating nothing.

    Args:
        build_model: builds the model (it is called under the meta device).
        build_optimizer: makes the optimizer for the built model (its trainable parameters).
        forward_backward: runs forward, loss and backward of the model on a batch with
            ``tokens`` and ``labels`` of shape ``[batch, seq_len]``.
        seq_len: the length every sample is planned at (the worst case a batch can have).
        device_memory_bytes: the memory to plan for; ``None`` for the table only.
        safety_margin: fraction of it held back, as the probe does.
        max_batch_size: cap on the answer.
        table_batch_sizes: the rows of the table; default powers of two up to past the answer.

    Returns:
        The plan.

    Raises:
        ValueError: for a ``seq_len`` under 1 or a margin outside ``[0, 1)``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1.")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin={safety_margin} must be in [0, 1).")
    start = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake_model(build_model, fake_mode)
    with fake_mode:
        optimizer = build_optimizer(model)

        def batch(b: int) -> Dict[str, torch.Tensor]:
            tokens = torch.zeros(b, seq_len, dtype=torch.long)
            return {"tokens": tokens, "labels": torch.zeros(b, seq_len, dtype=torch.long)}

        def step(b: int) -> PlanRow:
            return fake_step_peak(model, optimizer, forward_backward, batch(b))

        # The first step creates the optimizer state: later steps are the steady state.
        step(1)
        measured = {b: step(b) for b in (1, 2)}
    estimate = LinearMemoryEstimate.fit([(r.batch_size, r.peak_bytes) for r in measured.values()])

    budget = None if device_memory_bytes is None else int(device_memory_bytes * (1 - safety_margin))
    best = None
    if budget is not None:
        best = _search_in_fake_steps(step, measured, fake_mode, budget, max_batch_size)
    if table_batch_sizes is None:
        table_batch_sizes = _default_table(best)
    rows = [
        measured.get(b) or _predict_row(measured[1], measured[2], b)
        for b in sorted(set(table_batch_sizes) | ({best} if best else set()))
    ]
    return MemoryPlan(
        seq_len=seq_len,
        measured=[measured[b] for b in sorted(measured)],
        estimate=estimate,
        device_memory_bytes=device_memory_bytes,
        budget_bytes=budget,
        max_batch_size=best,
        rows=rows,
        seconds=time.perf_counter() - start,
    )


def _search_in_fake_steps(
    step: Callable[[int], PlanRow],
    measured: Dict[int, PlanRow],
    fake_mode: FakeTensorMode,
    budget: int,
    max_batch_size: Optional[int],
) -> int:
    """The probe's search, over fake steps: the line through batch 1 and 2 is where it starts,
    never the answer, which is a batch whose own fake step was within the budget. (On a large
    vocabulary the optimizer step sets the peak at batch 1 and 2, the line is nearly flat, and
    answering with it overstated the batch.)"""

    def run_trial(b: int) -> int:
        if b not in measured:
            with fake_mode:
                measured[b] = step(b)
        return measured[b].peak_bytes

    try:
        # Fake steps allocate nothing: no bound on how far a trial may go.
        result = search_max_batch_size(
            run_trial,
            budget_bytes=budget,
            max_batch_size=max_batch_size,
            warmup=False,
            release=lambda: None,
            max_overshoot=math.inf,
        )
    except BatchSizeTooLargeError:
        return 0
    return result.max_batch_size


def _predict_row(one: PlanRow, two: PlanRow, batch_size: int) -> PlanRow:
    """Each category on its own line through the steps at batch 1 and 2."""
    categories = {
        name: one.categories[name] + (two.categories[name] - one.categories[name]) * (batch_size - 1)
        for name in CATEGORY_ORDER
    }
    peak = one.peak_bytes + (two.peak_bytes - one.peak_bytes) * (batch_size - 1)
    return PlanRow(batch_size=batch_size, peak_bytes=peak, categories=categories)


def _default_table(best: Optional[int]) -> List[int]:
    return powers_of_two(max(8, 2 * best) if best else 64)
