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
A plan for CUDA adds the cuBLAS workspaces a card's step keeps (``device_type``).
"""

from dataclasses import asdict, dataclass, field
import math
import time
from typing import Callable, Dict, Iterable, List, Optional, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from adaptive_batch.errors import BatchSizeTooLargeError
import adaptive_batch.logs as logs
from adaptive_batch.memory.budget import after_margin
from adaptive_batch.memory.device import CUBLAS_WORKSPACES_PER_STEP, cublas_workspace_bytes
from adaptive_batch.memory.estimator import LinearMemoryEstimate
from adaptive_batch.probe.fake_step import (
    CATEGORY_ORDER,
    BuildOptimizer,
    ForwardBackward,
    PlanRow,
    StepPhases,
    build_fake_model,
    create_optimizer_state,
    extrapolate_row,
    fake_process_group,
    fake_step_phases,
    num_layers,
    step_in_backward,
)
from adaptive_batch.probe.search import powers_of_two, search_max_batch_size
from adaptive_batch.validation import check_safety_margin


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
        assumptions: what the plan assumed (defaults filled in, layers extrapolated, an
            optimizer's state size), to print with it.
        world_size: the data-parallel ranks planned for (the batch and the peaks are one
            rank's).
    """

    seq_len: int
    measured: List[PlanRow]
    estimate: LinearMemoryEstimate
    device_memory_bytes: Optional[int]
    budget_bytes: Optional[int]
    max_batch_size: Optional[int]
    rows: List[PlanRow] = field(default_factory=list)
    seconds: float = 0.0
    assumptions: List[str] = field(default_factory=list)
    world_size: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    def row_at(self, batch_size: int) -> PlanRow:
        """The predicted peak at ``batch_size``: its own fake step where one was measured,
        else the line through the two measured steps nearest to it."""
        return _predict_row({r.batch_size: r for r in self.measured}, batch_size)


# Layer counts measured when extrapolating: not 1, where the first and last layer are one.
MEASURED_LAYERS = (2, 3)


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
    optimizer_in_backward: bool = False,
    extrapolate_layers: bool = True,
    assumptions: Iterable[str] = (),
    adjust_bytes: Optional[Dict[str, int]] = None,
    device_type: str = "cpu",
    world_size: int = 1,
    shard: Optional[Callable[[nn.Module, DeviceMesh], None]] = None,
    micro_batches: Callable[[int], int] = lambda batch_size: 1,
) -> MemoryPlan:
    """Predicts a training step's peak at every batch size, allocating nothing.

    Models with a list of identical decoder layers (``model.layers``) are planned from copies
    with 2 and 3 layers: each part of a fake step (forward and backward; the optimizer step)
    is linear in the layer count, so the two give every layer count, and a 70B model plans in
    the time of a 3-layer one. ``extrapolate_layers=False`` steps the whole model.

    Args:
        build_model: builds the model (it is called under the meta device).
        build_optimizer: makes the optimizers for a list of trainable parameters: one
            optimizer, or with ``optimizer_in_backward`` one per parameter.
        forward_backward: runs forward, loss and backward of the model on a batch with
            ``tokens`` and ``labels`` of shape ``[batch, seq_len]``.
        seq_len: the length every sample is planned at (the worst case a batch can have).
        device_memory_bytes: the memory to plan for; ``None`` for the table only.
        safety_margin: fraction of it held back, as the probe does.
        max_batch_size: cap on the answer.
        table_batch_sizes: the rows of the table; default powers of two up to past the answer.
        optimizer_in_backward: each parameter steps in backward and frees its gradient.
        extrapolate_layers: plan from 2 and 3 layers when the model has more than 3.
        assumptions: what the caller assumed (a default sequence length, an optimizer's state
            size), carried into the plan.
        adjust_bytes: bytes added to every step's peak, by category (negative to take off):
            what the fake model stands in for differently (e.g. NF4 weights planned dense).
        device_type: the device planned for; on ``"cuda"`` the step's cuBLAS workspaces are added
            (fake tensors make none; a card's step holds one per thread from its first product).
        world_size: plan one rank's share of a data-parallel run over this many ranks:
            ``shard(model, mesh)`` applies FSDP2 under a fake process group of that size
            (no other process, nothing sent), and ``FSDPMemTracker`` counts the rank's sharded
            parameters, gradients and optimizer state, its all-gathered layers and its
            reduce-scatter buffers. The batch is per rank.
        shard: see ``world_size``; needed when it is above 1.
        micro_batches: ``f(batch_size)``, the micro-batches a step at that size runs before its
            optimizer step (:func:`~adaptive_batch.schedule.global_batch.micro_batches_per_trial`),
            as the probe's trial runs them.

    Returns:
        The plan.

    Raises:
        ValueError: for a ``seq_len`` under 1 or a margin outside ``[0, 1)``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1.")
    check_safety_margin(safety_margin, key="safety_margin")
    if world_size > 1 and shard is None:
        raise ValueError(f"world_size={world_size} needs shard, the function that applies FSDP2.")
    assumptions = list(assumptions)
    if device_type.startswith("cuda"):
        adjust_bytes = _with_cublas_workspaces(adjust_bytes, assumptions)
    with fake_process_group(world_size) as mesh:
        return _plan(
            build_model=build_model,
            build_optimizer=build_optimizer,
            forward_backward=forward_backward,
            seq_len=seq_len,
            device_memory_bytes=device_memory_bytes,
            safety_margin=safety_margin,
            max_batch_size=max_batch_size,
            table_batch_sizes=table_batch_sizes,
            optimizer_in_backward=optimizer_in_backward,
            extrapolate_layers=extrapolate_layers,
            assumptions=[*assumptions] + ([f"one rank's share of {world_size} under FSDP2; the batch is per rank"] if mesh else []),
            adjust_bytes=adjust_bytes,
            shard=None if mesh is None else (lambda model: shard(model, mesh)),
            world_size=world_size,
            micro_batches=micro_batches,
        )


def _plan(
    *,
    build_model: Callable[[], nn.Module],
    build_optimizer: BuildOptimizer,
    forward_backward: ForwardBackward,
    seq_len: int,
    device_memory_bytes: Optional[int],
    safety_margin: float,
    max_batch_size: Optional[int],
    table_batch_sizes: Optional[Iterable[int]],
    optimizer_in_backward: bool,
    extrapolate_layers: bool,
    assumptions: List[str],
    adjust_bytes: Optional[Dict[str, int]],
    shard: Optional[Callable[[nn.Module], None]],
    world_size: int,
    micro_batches: Callable[[int], int],
) -> MemoryPlan:
    start = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    step = _FakeSteps(
        build_model, build_optimizer, fake_mode, extrapolate_layers=extrapolate_layers, shard=shard,
        optimizer_in_backward=optimizer_in_backward, forward_backward=forward_backward, seq_len=seq_len,
        micro_batches=micro_batches, adjust_bytes=adjust_bytes,
    )
    with fake_mode:
        step.create_optimizer_state()
        measured = {b: step(b) for b in (1, 2)}
    estimate = LinearMemoryEstimate.fit([(r.batch_size, r.peak_bytes) for r in measured.values()])

    budget = None if device_memory_bytes is None else after_margin(device_memory_bytes, safety_margin)
    best = None
    if budget is not None:
        best = _search_in_fake_steps(step, measured, fake_mode, budget, max_batch_size)
    if table_batch_sizes is None:
        table_batch_sizes = _default_table(best)
    rows = [
        _predict_row(measured, b)
        for b in sorted(set(table_batch_sizes) | ({best} if best else set()))
    ]
    notes = list(assumptions)
    if step.counts != (None,):
        notes.append(f"{step.layers} decoder layers extrapolated from fake steps with {step.counts[0]} and {step.counts[1]}")
    if optimizer_in_backward:
        notes.append("optimizer in backward: each gradient freed after its parameter's step")
    return MemoryPlan(
        seq_len=seq_len,
        measured=[measured[b] for b in sorted(measured)],
        estimate=estimate,
        device_memory_bytes=device_memory_bytes,
        budget_bytes=budget,
        max_batch_size=best,
        rows=rows,
        seconds=time.perf_counter() - start,
        assumptions=notes,
        world_size=world_size,
    )


class _FakeSteps:
    """The planned step at any batch size: the model (or, with ``extrapolate_layers``, two
    copies with :data:`MEASURED_LAYERS` layers, extrapolated to the whole depth) and its
    optimizers on fake tensors."""

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        build_optimizer: BuildOptimizer,
        fake_mode: FakeTensorMode,
        *,
        extrapolate_layers: bool,
        shard: Optional[Callable[[nn.Module], None]],
        optimizer_in_backward: bool,
        forward_backward: ForwardBackward,
        seq_len: int,
        micro_batches: Callable[[int], int],
        adjust_bytes: Optional[Dict[str, int]],
    ) -> None:
        self.layers = num_layers(build_model) if extrapolate_layers else None
        self.counts = MEASURED_LAYERS if self.layers is not None and self.layers > MEASURED_LAYERS[-1] else (None,)
        self._forward_backward, self._seq_len, self._in_backward = forward_backward, seq_len, optimizer_in_backward
        self._micro_batches, self._adjust_bytes = micro_batches, adjust_bytes
        self._steppers = {}
        for keep in self.counts:
            model = build_fake_model(build_model, fake_mode, keep_layers=keep, shard=shard)
            with fake_mode:
                trainable = [p for p in model.parameters() if p.requires_grad]
                optimizers = _as_list(build_optimizer(trainable))
            if optimizer_in_backward:
                step_in_backward(trainable, optimizers)
            self._steppers[keep] = (model, optimizers)

    def create_optimizer_state(self) -> None:
        for model, optimizers in self._steppers.values():
            create_optimizer_state(model, optimizers)

    def __call__(self, b: int) -> PlanRow:
        batch = {name: torch.zeros(b, self._seq_len, dtype=torch.long) for name in ("tokens", "labels")}
        phases = {
            keep: fake_step_phases(model, optimizers, self._forward_backward, batch,
                                   optimizer_in_backward=self._in_backward, micro_batches=self._micro_batches(b))
            for keep, (model, optimizers) in self._steppers.items()
        }
        if self.counts == (None,):
            return _adjusted(phases[None].peak(b), self._adjust_bytes)
        (k1, low), (k2, high) = sorted(phases.items())
        whole = StepPhases(
            *[extrapolate_row(x, y, k1, k2, self.layers) if x is not None else None for x, y in zip(
                (low.backward, low.optimizer), (high.backward, high.optimizer))]
        )
        return _adjusted(whole.peak(b), self._adjust_bytes)


def _with_cublas_workspaces(adjust_bytes: Optional[Dict[str, int]], assumptions: List[str]) -> Dict[str, int]:
    """``adjust_bytes`` with a CUDA step's cuBLAS workspaces, the forward's and the backward's."""
    each = cublas_workspace_bytes()
    assumptions.append(f"CUDA: {CUBLAS_WORKSPACES_PER_STEP} cuBLAS workspaces of {each / 2**20:g} MiB "
                       "(CUBLAS_WORKSPACE_CONFIG, else torch's default on Hopper), the forward's and the backward's")
    adjusted = dict(adjust_bytes or {})
    adjusted["other"] = adjusted.get("other", 0) + CUBLAS_WORKSPACES_PER_STEP * each
    return adjusted


def _adjusted(row: PlanRow, adjust_bytes: Optional[Dict[str, int]]) -> PlanRow:
    if not adjust_bytes:
        return row
    categories = {name: row.categories[name] + adjust_bytes.get(name, 0) for name in CATEGORY_ORDER}
    return PlanRow(row.batch_size, row.peak_bytes + sum(adjust_bytes.values()), categories)


def _as_list(optimizers: Union[torch.optim.Optimizer, List[torch.optim.Optimizer]]) -> List[torch.optim.Optimizer]:
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


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
        # Fake steps allocate nothing: no bound on how far a trial may go. A plan says no trial.
        with logs.quiet():
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


def _predict_row(measured: Dict[int, PlanRow], batch_size: int) -> PlanRow:
    """Each category on the line through the two measured steps nearest to ``batch_size``
    (bracketing it where they can). Not the line through batch 1 and 2 alone: on a large
    vocabulary the peak grows faster per sample above batch 1 than from 1 to 2, and that line
    put the 152K-vocabulary model's peak at batch 438 at half what a CUDA step measured."""
    if batch_size in measured:
        return measured[batch_size]
    sizes = sorted(measured)
    below = [b for b in sizes if b < batch_size]
    above = [b for b in sizes if b > batch_size]
    if below and above:
        lo, hi = below[-1], above[0]
    elif below:
        lo, hi = below[-2:] if len(below) > 1 else (below[-1], below[-1])
    else:
        lo, hi = above[:2] if len(above) > 1 else (above[0], above[0])
    if lo == hi:
        raise ValueError("a prediction needs two measured batch sizes")
    a, b = measured[lo], measured[hi]

    def line(x: int, y: int) -> int:
        return int(round(x + (y - x) * (batch_size - lo) / (hi - lo)))

    categories = {name: line(a.categories[name], b.categories[name]) for name in CATEGORY_ORDER}
    return PlanRow(batch_size=batch_size, peak_bytes=line(a.peak_bytes, b.peak_bytes), categories=categories)


def _default_table(best: Optional[int]) -> List[int]:
    return powers_of_two(max(8, 2 * best) if best else 64)
