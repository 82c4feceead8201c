"""The one memory budget: what a training step's peak may reach, and how that is judged.

Two kinds, said in the log and the report:

- **soft** (``max_memory`` below what the device can give): judged by the live tensor bytes of
  training's step (allocated bytes on CUDA), so every process gets the same answer. The machine
  guard the trials run under (:func:`trial_headroom_bytes`) is the machine's, never the budget's:
  glibc's arenas, MKL's and oneDNN's scratch are not tensors, and a guard at the budget made them
  decide (an MLP at 96 MiB answered anything from 2 to 747 in fresh processes).
- **hard** (an ``RLIMIT_AS``, a cgroup, available RAM, a card's memory): judged by real allocation
  failures under the limit's own unit (address space on CPU). A share of an ``RLIMIT_AS``
  (``max_memory="90%"``) is that limit less the rest: in tensor bytes a ViT's 90% of 1 GiB let
  trials past the limit's address space (7 out of memory in the caller) and left 6% unused.

The recipes, the library, the Trainer, the planner and the CLI all call this module.
"""

from dataclasses import dataclass
from typing import Iterator, Literal, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from adaptive_batch.memory.device import ADDRESS_SPACE_SOURCE, DeviceCapacity, format_bytes
from adaptive_batch.memory.tracker import live_tensor_bytes
from adaptive_batch.validation import check_safety_margin

BudgetKind = Literal["soft", "hard"]
SOFT: BudgetKind = "soft"
HARD: BudgetKind = "hard"
# The source of a budget set by ``max_memory``.
MAX_MEMORY_SOURCE = "max_memory"
# The default margin when every trial runs in a fresh process under an address-space limit.
FRESH_PROCESS_MARGIN = 0.003
# The default margin on the CPU when trials run in the process that trains.
IN_PROCESS_CPU_MARGIN = 0.01
# How far past the budget's headroom a trial may reach under a hard limit (the search's own bound).
MAX_TRIAL_OVERSHOOT = 1.25


def default_safety_margin(device_type: str, *, fresh_process_trials: bool = False) -> float:
    """The fraction of the budget held back when the config leaves it to the device.

    CUDA's caching allocator reserves more than it hands out (fragmentation), so 5%. On the CPU
    1%: under a soft budget for what kernels allocate outside tensors, under a hard limit for
    the heap an out-of-memory trial leaves the probing process (a Trainer's answer at 0% passed
    its check and ran out of memory in training). 0.3% when every trial runs in a fresh process
    under an address-space limit: the answer is judged in the limit's own unit by a process with
    no scars, while 1% cost a whole sample wherever one is over 1% of the headroom; fresh
    processes differ by about a MiB (an MLP's 10471 trained in 2 of 3, its 10470 in every one),
    which 0.1% of a GiB did not cover.
    """
    if device_type == "cuda":
        return 0.05
    return FRESH_PROCESS_MARGIN if fresh_process_trials else IN_PROCESS_CPU_MARGIN


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes a training step's peak may reach.

    Attributes:
        budget_bytes: the limit the probe holds steps to, after the safety margin.
        limit_bytes: the limit before the margin (``max_memory``, or what the device holds).
        safety_margin: the fraction of ``limit_bytes`` held back for fragmentation.
        source: where ``limit_bytes`` came from (``"max_memory"`` or the device's limit).
        kind: ``"soft"`` (judged by tensor bytes) or ``"hard"`` (judged by allocation failures).
        share: the share of an address-space limit ``max_memory`` asked for (``0.9``), whose
            rest is part of ``safety_margin``; ``None`` otherwise.
    """

    budget_bytes: int
    limit_bytes: int
    safety_margin: float
    source: str
    kind: BudgetKind = HARD
    share: Optional[float] = None

    @property
    def is_soft(self) -> bool:
        return self.kind == SOFT

    def describe(self) -> str:
        """The budget in words, for the log: its size, where it came from and how it is judged."""
        judged = "live tensor bytes" if self.is_soft else "real allocation failures"
        return f"a {self.kind} budget of {format_bytes(self.budget_bytes)} ({self._source_words()}; judged by {judged})"

    def limit_words(self) -> str:
        """Where the budget comes from, for the report's line: the limit, its share, the margin."""
        if self.share is None:
            return f"{format_bytes(self.limit_bytes)} from {self.source} less a {self.safety_margin:.0%} safety margin"
        margin = 1 - (1 - self.safety_margin) / self.share
        return (f"{self.share:.0%} of {format_bytes(self.limit_bytes)} ({ADDRESS_SPACE_SOURCE}) from {self.source} "
                f"less a {margin:.1%} safety margin")

    def _source_words(self) -> str:
        return self.source if self.share is None else f"{self.source}: {self.share:.0%} of {ADDRESS_SPACE_SOURCE}"

    def to_dict(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "limit_bytes": self.limit_bytes,
            "safety_margin": self.safety_margin,
            "source": self.source,
            "kind": self.kind,
            "share": self.share,
        }


def after_margin(limit_bytes: int, safety_margin: float) -> int:
    """``limit_bytes`` less the safety margin: what a step's peak may reach (the probe's and the
    planner's budget alike)."""
    return int(limit_bytes * (1 - safety_margin))


def memory_budget(
    *,
    max_memory_bytes: Optional[int],
    capacity: DeviceCapacity,
    live_bytes: int,
    safety_margin: Optional[float] = None,
    fresh_process_trials: bool = False,
    max_memory_fraction: Optional[float] = None,
) -> MemoryBudget:
    """The budget for a step's peak, from ``max_memory`` or from the device's headroom.

    Args:
        max_memory_bytes: the user's limit for a step's peak (parameters and optimizer state
            included), or ``None`` for the whole device.
        max_memory_fraction: the share of the device ``max_memory`` asked for, when it was one;
            of an ``RLIMIT_AS`` it is a hard budget, the limit less the rest as margin.
        capacity: the device's headroom, read after the model and optimizer were built.
        live_bytes: tensor bytes alive when ``capacity`` was read; they count in every peak.
        safety_margin: fraction in ``[0, 1)`` held back; ``None`` for the default of the
            device and the trials (:func:`default_safety_margin`).
        fresh_process_trials: the trials run in fresh processes
            (:func:`~adaptive_batch.probe.children.trials_in_children` decides), for the default margin.

    Raises:
        ValueError: if ``safety_margin`` is outside ``[0, 1)``.
    """
    device_limit = live_bytes + capacity.headroom_bytes
    share_of_limit = max_memory_fraction is not None and capacity.source == ADDRESS_SPACE_SOURCE
    if max_memory_bytes is not None and max_memory_bytes <= device_limit and not share_of_limit:
        limit, source, kind = max_memory_bytes, MAX_MEMORY_SOURCE, SOFT
    else:
        limit, source, kind = device_limit, capacity.source, HARD
    if safety_margin is None:
        device_type = capacity.device.split(":")[0]
        safety_margin = default_safety_margin(device_type, fresh_process_trials=fresh_process_trials)
    check_safety_margin(safety_margin)
    share = None
    if share_of_limit:  # max_memory set it; the rest of the limit is held back, judged in its own unit
        source, share = MAX_MEMORY_SOURCE, max_memory_fraction
        safety_margin = 1 - share * (1 - safety_margin)
    return MemoryBudget(
        budget_bytes=after_margin(limit, safety_margin),
        limit_bytes=int(limit),
        safety_margin=float(safety_margin),
        source=source,
        kind=kind,
        share=share,
    )


def _state_tensors(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """The tensors a training run keeps between steps: parameters, buffers, gradients and
    optimizer state."""
    yield from model.parameters()
    yield from model.buffers()
    for p in model.parameters():
        if p.grad is not None:
            yield p.grad
    if optimizer is not None:
        for leaf in tree_leaves(list(optimizer.state.values())):
            if isinstance(leaf, torch.Tensor):
                yield leaf


def state_tensors(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list:
    """:func:`_state_tensors` as a list, to add a batch's tensors to."""
    return list(_state_tensors(model, optimizer))


def training_state_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Bytes of the tensors a training run keeps between steps."""
    return live_tensor_bytes(_state_tensors(model, optimizer))


def trial_headroom_bytes(budget: MemoryBudget, capacity: DeviceCapacity, *, state_bytes: int) -> int:
    """The address space the probe's CPU trials may add to the process (the machine guard).

    Under a hard limit it is the budget's headroom times the trials' overshoot bound (never more
    than the machine gives), so a runaway trial fails to allocate. Under a soft budget it is what
    the machine can give: the budget is judged by tensor bytes, and the guard only keeps a trial
    from waking the kernel's OOM killer.
    """
    if budget.is_soft:
        return capacity.headroom_bytes
    budget_headroom = max(0, budget.limit_bytes - state_bytes)
    return min(capacity.headroom_bytes, int(MAX_TRIAL_OVERSHOOT * budget_headroom))


def check_reserve_bytes(budget: MemoryBudget, capacity: DeviceCapacity, *, device: torch.device, state_bytes: int) -> int:
    """On CPU under a hard limit, the heap the answer's consecutive-step check holds back: the
    safety margin's share of the trials' headroom, which training then has to spare. 0 elsewhere:
    on CUDA the check is held to the budget itself, and a soft budget by its tensor bytes."""
    if device.type != "cpu" or budget.is_soft:
        return 0
    return int(budget.safety_margin * trial_headroom_bytes(budget, capacity, state_bytes=state_bytes))
