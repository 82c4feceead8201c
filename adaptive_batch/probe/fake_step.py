"""One training step run on fake tensors, measured by torch's ``MemTracker``: the planner's
instrument (:mod:`adaptive_batch.probe.plan` fits and searches over its rows).

The model is built on the meta device and given fake CPU storage; each part of a step
(forward and backward; optimizer step and zeroing) runs under its own tracker, whose peak is
read by category. Also here: a process group of fake ranks for FSDP2's shards, torchtune's
optimizer-in-backward hooks, and an optimizer of known state size for ones that cannot be
imported.
"""

import contextlib
import functools
from dataclasses import dataclass
import math
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# MemTracker's categories, as the table names them; temporaries of backward count as activations.
CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "activations",
    "Other": "other",
    # FSDPMemTracker's, for a rank's share under FSDP2: the all-gathered layer counts as
    # parameters, the reduce-scatter buffers as gradients.
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "All Gather": "parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients",
    "OptState": "optimizer_state",
    "Inputs": "activations",
}
CATEGORY_ORDER = ("parameters", "gradients", "optimizer_state", "activations", "buffers", "other")

# Trainable parameters -> one optimizer, or one per parameter (optimizer in backward).
BuildOptimizer = Callable[[List[nn.Parameter]], Union[torch.optim.Optimizer, List[torch.optim.Optimizer]]]
# Runs a model's forward and backward on a batch.
ForwardBackward = Callable[[nn.Module, Dict[str, torch.Tensor]], None]

@dataclass(frozen=True)
class PlanRow:
    """The peak of one batch size, whole and by category (bytes)."""

    batch_size: int
    peak_bytes: int
    categories: Dict[str, int]


def build_fake_model(
    build_model: Callable[[], nn.Module],
    fake_mode: FakeTensorMode,
    keep_layers: Optional[int] = None,
    shard: Optional[Callable[[nn.Module], None]] = None,
) -> nn.Module:
    """Builds the model on the meta device and gives it fake CPU storage.

    torchtune's rotary embeddings compute their cache at init; it is recomputed for real (it is
    small), since the meta build left it empty.

    Args:
        build_model: builds the model.
        fake_mode: the fake mode its tensors belong to.
        keep_layers: keep only the first this many of ``model.layers`` (see :func:`num_layers`).
        shard: applies FSDP2 to the meta model (under a process group) before it gets storage.
    """
    with torch.device("meta"):
        model = build_model()
    if keep_layers is not None:
        model.layers = model.layers[:keep_layers]
    if shard is not None:
        shard(model)
    with fake_mode:
        model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "rope_init"):
            with unset_fake_temporarily():
                module.rope_init()
    return model


def num_layers(build_model: Callable[[], nn.Module]) -> Optional[int]:
    """How many identical decoder layers the model has (``model.layers``, as torchtune's
    ``TransformerDecoder`` holds them), or ``None`` when it has no such list."""
    with torch.device("meta"):
        model = build_model()
    layers = getattr(model, "layers", None)
    return len(layers) if isinstance(layers, nn.ModuleList) else None


class _NoHook:
    def remove(self) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _peak_only_mem_tracker() -> type:
    """``MemTracker`` that keeps the peak of the whole step and no module's own: after every
    operator torch's walks every module it has seen (75 a step on a 1B model, 4.7 million
    visits for a QLoRA plan: 14 s of its 20), and the plan reads the step's peak alone. Where a
    torch release no longer calls ``_update_peak_stats``, this is ``MemTracker`` as it is."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakOnlyMemTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 - the module peaks it skips
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                    self._peak_mem[dev] = dev_snap["Total"]
                    self._peak_mem_snap[dev] = dict(dev_snap)

    return PeakOnlyMemTracker


def _tracked_peak(model: nn.Module, optimizers: List[torch.optim.Optimizer], run: Callable[[], None],
                  repeat: int = 1) -> "PlanRow":
    """Runs ``run`` ``repeat`` times under a fresh ``MemTracker`` (``FSDPMemTracker`` for a
    sharded model) that knows the model and optimizers; its peak by category (``batch_size`` 0:
    the caller sets it). Between runs the tracker forgets its per-module statistics (it refuses a
    second forward otherwise) and keeps the peak."""
    # Imported here: they bring torch's compiler and DTensor (about a second of start-up for
    # every process that imports adaptive_batch and never plans).
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(mod=model, optm=optimizers[0] if optimizers else None)
    else:
        tracker = _peak_only_mem_tracker()()
    # MemTracker hooks every parameter's gradient, which fails on frozen ones (LoRA's base
    # weights): mark those as hooked already, with handles that remove nothing.
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    if not isinstance(model, FSDPModule):
        tracker.track_external(model, *optimizers)
    with tracker:
        for i in range(repeat):
            if i:
                tracker.reset_mod_stats()
            run()
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
    return PlanRow(batch_size=0, peak_bytes=total, categories=categories)


@dataclass(frozen=True)
class StepPhases:
    """A fake step's peak in its two parts: forward and backward; optimizer step and zeroing
    (empty with the optimizer in backward). Each part's peak is linear in the layer count."""

    backward: PlanRow
    optimizer: Optional[PlanRow]

    def rows(self) -> List[PlanRow]:
        return [self.backward] + ([self.optimizer] if self.optimizer is not None else [])

    def peak(self, batch_size: int) -> PlanRow:
        top = max(self.rows(), key=lambda r: r.peak_bytes)
        return PlanRow(batch_size=batch_size, peak_bytes=top.peak_bytes, categories=dict(top.categories))


def fake_step_phases(
    model: nn.Module,
    optimizers: List[torch.optim.Optimizer],
    forward_backward: ForwardBackward,
    batch: Dict[str, torch.Tensor],
    *,
    optimizer_in_backward: bool = False,
    micro_batches: int = 1,
) -> StepPhases:
    """Runs one fake training step, each part under its own ``MemTracker``.

    With ``optimizer_in_backward`` each parameter's optimizer steps (and frees its gradient)
    as soon as the gradient is accumulated, as torchtune's ``optimizer_in_bwd`` runs it. With
    ``micro_batches`` above 1 forward and backward run that many times before the optimizer
    step, the gradients of the first alive through the next (gradient accumulation).
    """
    if optimizer_in_backward:
        backward = _tracked_peak(model, optimizers, lambda: forward_backward(model, batch))
        return StepPhases(backward, None)

    def step_and_zero() -> None:
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    backward = _tracked_peak(model, optimizers, lambda: forward_backward(model, batch), repeat=micro_batches)
    return StepPhases(backward, _tracked_peak(model, optimizers, step_and_zero))


def create_optimizer_state(model: nn.Module, optimizers: List[torch.optim.Optimizer]) -> None:
    """Each optimizer's state as its first step creates it, from zero gradients: a fake step
    measured after this is the steady state, with no forward and backward spent on getting there."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def extrapolate_row(a: PlanRow, b: PlanRow, at_a: int, at_b: int, to: int) -> PlanRow:
    """The line through ``a`` (at ``at_a``) and ``b`` (at ``at_b``), peak and categories, at ``to``."""

    def line(x: int, y: int) -> int:
        return int(round(x + (y - x) * (to - at_a) / (at_b - at_a)))

    categories = {name: line(a.categories[name], b.categories[name]) for name in CATEGORY_ORDER}
    return PlanRow(batch_size=a.batch_size, peak_bytes=line(a.peak_bytes, b.peak_bytes), categories=categories)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Optional[DeviceMesh]]:
    """A process group of ``world_size`` ranks that sends nothing (torch's ``fake`` backend),
    and its CPU mesh; ``None`` for one rank. Refused inside a real distributed run."""
    if world_size <= 1:
        yield None
        return
    if dist.is_initialized():
        raise ValueError("planning several ranks needs a process of its own: a process group is already set up.")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


class KnownStateOptimizer(torch.optim.Optimizer):
    """A stand-in for an optimizer the planner cannot import (bitsandbytes' 8-bit and paged
    AdamW on a machine without CUDA): its first step creates state of a known size per
    parameter and changes nothing.

    Args:
        params: the trainable parameters.
        bytes_per_element: state bytes per parameter element.
        small_bytes_per_element: for parameters under ``small_numel`` elements (bitsandbytes
            keeps those in 32-bit state).
        small_numel: see above.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        bytes_per_element: float,
        small_bytes_per_element: Optional[float] = None,
        small_numel: int = 0,
    ) -> None:
        super().__init__(params, {})
        self.bytes_per_element = bytes_per_element
        self.small_bytes_per_element = small_bytes_per_element or bytes_per_element
        self.small_numel = small_numel

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p in self.state and self.state[p]:
                    continue
                per = self.small_bytes_per_element if p.numel() < self.small_numel else self.bytes_per_element
                self.state[p]["state"] = torch.empty(math.ceil(p.numel() * per), dtype=torch.uint8, device=p.device)


def step_in_backward(params: List[nn.Parameter], optimizers: List[torch.optim.Optimizer]) -> None:
    """torchtune's ``register_optim_in_bwd_hooks``: a parameter's optimizer steps and frees its
    gradient once the gradient is accumulated."""
    by_param = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                by_param[p] = optimizer
    for p in params:
        optimizer = by_param[p]

        def hook(param: nn.Parameter, optimizer: torch.optim.Optimizer = optimizer) -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        p.register_post_accumulate_grad_hook(hook)
