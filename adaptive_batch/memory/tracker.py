"""Peak memory of one training step, measured while it runs.

CUDA: the caching allocator's ``max_memory_allocated``. CPU has no allocator statistics, so
:class:`LiveTensorCounter` counts the bytes of live tensor storages: every storage an operator
returns is counted once and uncounted when it is freed. It holds only weak references, so a step
that fails with an out-of-memory error leaves nothing alive behind it (torch's ``MemTracker``
keeps the failed step's tensors, and every later trial then fails).
"""

import contextlib
from dataclasses import dataclass, field
import functools
import threading
from typing import Callable, Dict, Iterable, Iterator, List, Optional
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from adaptive_batch.memory.device import proc_status_bytes


def tensor_storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages that hold ``t``'s data: its own, or for a wrapper subclass those of the
    tensors it wraps (a ``DTensor``'s local shard, an NF4 tensor's quantized data and scales),
    whose own storage reports the global size and holds nothing."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # torch 2.13's DTensor also lists its mesh
                yield from tensor_storages(inner)
    else:
        yield t.untyped_storage()


def live_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storages once)."""
    seen = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for storage in tensor_storages(t):
            key = storage._cdata
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


# ``UntypedStorage.resize_`` is no operator, so no dispatch mode sees it: while any counter is
# entered one wrapper stands in for it (process-wide, as the method is) and tells the counters
# entered on the calling thread, as a dispatch mode covers its own thread.
_resize_lock = threading.Lock()
_resize_original: List[Callable[..., object]] = []  # the method the wrapper replaced, while installed
_resize_users = 0
_counters_here = threading.local()


def _counted_resize(storage: torch.UntypedStorage, size: int) -> object:
    out = _resize_original[0](storage, size)
    for counter in getattr(_counters_here, "entered", ()):
        counter._resized(storage)
    return out


def _follow_resizes(counter: "LiveTensorCounter") -> None:
    global _resize_users
    with _resize_lock:
        if _resize_users == 0:
            _resize_original.append(torch.UntypedStorage.resize_)
            torch.UntypedStorage.resize_ = functools.wraps(_resize_original[0])(_counted_resize)
        _resize_users += 1
    _counters_here.entered = [*getattr(_counters_here, "entered", ()), counter]


def _unfollow_resizes(counter: "LiveTensorCounter") -> None:
    global _resize_users
    entered = list(getattr(_counters_here, "entered", ()))
    if counter in entered:
        entered.remove(counter)
    _counters_here.entered = entered
    with _resize_lock:
        _resize_users -= 1
        if _resize_users == 0:
            torch.UntypedStorage.resize_ = _resize_original.pop()


class LiveTensorCounter(TorchDispatchMode):
    """Counts live tensor bytes on one device type and keeps the peak.

    A storage resized in place (``UntypedStorage.resize_``, which no dispatch mode sees) counts
    at its new size: FSDP2 frees each layer's unsharded parameters that way and keeps the
    storage, so counting them by their first size held every layer of the model unsharded at
    once (9.4 MB over a 4-layer model's true peak on each of 2 ranks, and more the deeper the
    model, where torch's ``FSDPMemTracker`` and the planner counted one layer).

    Args:
        baseline: tensors alive before the measured code (parameters, optimizer state, the
            batch); they are part of the peak.
        device_type: only storages on this device type count.
    """

    def __init__(self, baseline: Iterable[torch.Tensor] = (), device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase = STEP_PHASES[0]
        self.phase_peak_bytes: Dict[str, int] = {}
        # Live bytes right after each operator's outputs exist: the step's memory over time.
        self.timeline: List[int] = []
        self.operators: List[object] = []
        self._refs: Dict[int, weakref.ref] = {}
        self._sizes: Dict[int, int] = {}  # the bytes each tracked storage counts for now
        for t in baseline:
            self._track(t)
        self.start_phase(self.phase)

    def __enter__(self) -> "LiveTensorCounter":
        _follow_resizes(self)
        try:
            return super().__enter__()
        except BaseException:
            _unfollow_resizes(self)
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            _unfollow_resizes(self)

    def start_phase(self, phase: str) -> None:
        """From now on the bytes count towards ``phase``'s peak; what is alive counts at once."""
        self.phase = phase
        self.phase_peak_bytes[phase] = max(self.phase_peak_bytes.get(phase, 0), self.live_bytes)

    def _release(self, key: int, _ref: weakref.ref) -> None:
        if self._refs.pop(key, None) is not None:
            self.live_bytes -= self._sizes.pop(key)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self._refs:
            if storage.device.type == self.device_type and storage.nbytes():
                self._track_storage(storage)
            return
        nbytes = storage.nbytes()
        self._add(nbytes - self._sizes[key])
        self._sizes[key] = nbytes

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type or t.is_meta:
            return
        for storage in tensor_storages(t):
            self._track_storage(storage)

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda r, k=key: self._release(k, r))
        self._sizes[key] = nbytes
        self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self.live_bytes > self.phase_peak_bytes.get(self.phase, 0):
            self.phase_peak_bytes[self.phase] = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        self.timeline.append(self.live_bytes)
        self.operators.append(func)
        return out


def measure_peak_bytes(
    fn: Callable[[], None],
    device: torch.device,
    baseline: Iterable[torch.Tensor] = (),
) -> int:
    """Runs ``fn`` and returns the peak bytes of tensor memory on ``device`` while it ran.

    Args:
        fn: the code to measure, e.g. one full training step.
        device: where the step runs.
        baseline: tensors alive before ``fn`` (CPU only; CUDA's allocator already counts them).

    Returns:
        Peak bytes of live tensors, baseline included.

    Raises:
        Whatever ``fn`` raises, out-of-memory errors included.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    counter = LiveTensorCounter(baseline, device_type=device.type)
    with counter:
        fn()
    return counter.peak_bytes


@dataclass
class StepMemory:
    """What one measured training step held.

    Attributes:
        phase_peak_bytes: the peak of each phase that ran (see :data:`STEP_PHASES`).
        timeline: on CPU, the live bytes after each operator of the step, in order; the same
            step at another batch size usually runs the same operators, and then two timelines
            give a line per operator (:class:`~adaptive_batch.memory.estimator.OperatorMemoryEstimate`).
        operators: the operators the timeline follows, to check that two steps ran the same.
        start_bytes: what was live when the step began (training state and batch), which the
            step holds throughout; ``None`` when not measured.
    """

    phase_peak_bytes: Dict[str, int]
    timeline: Optional[List[int]] = field(default=None, repr=False)
    operators: Optional[List[object]] = field(default=None, repr=False)
    start_bytes: Optional[int] = None

    @property
    def peak_bytes(self) -> int:
        return max(self.phase_peak_bytes.values())


# A training step's phases, in order: the model's forward; the loss and backward; the optimizer
# step (and zeroing the gradients).
STEP_PHASES = ("forward", "backward", "optimizer")


class _CudaPhases:
    """Per-phase peaks from CUDA's allocator: the peak statistic is read and reset at each
    phase change."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phase = STEP_PHASES[0]
        self.phase_peak_bytes: Dict[str, int] = {}
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    def start_phase(self, phase: str) -> None:
        self.close()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.phase = phase

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        peak = int(torch.cuda.max_memory_allocated(self.device))
        self.phase_peak_bytes[self.phase] = max(self.phase_peak_bytes.get(self.phase, 0), peak)


@contextlib.contextmanager
def _phase_hooks(
    model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer], start_phase: Callable[[str], None]
) -> Iterator[None]:
    """Marks the phases of a step with the model's forward hooks and the optimizer's step hooks."""
    handles = []
    if model is not None:
        handles.append(model.register_forward_pre_hook(lambda module, args: start_phase("forward")))
        handles.append(model.register_forward_hook(lambda module, args, out: start_phase("backward")))
    if optimizer is not None:
        handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: start_phase("optimizer")))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def measure_phase_peaks(
    fn: Callable[[], None],
    device: torch.device,
    baseline: Iterable[torch.Tensor] = (),
    *,
    model: Optional[nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> StepMemory:
    """Runs one training step and returns the peak bytes of each of its :data:`STEP_PHASES`
    (and, on CPU, the step's memory after each operator).

    The forward starts and ends with ``model``'s forward; the backward phase holds the loss and
    the backward; the optimizer phase starts with ``optimizer.step()``. At small batches the
    step's peak is often set by the optimizer step (temporaries over a large embedding), which
    does not grow with the batch, while the backward does: a line per phase predicts what one
    line through the step's peaks cannot.

    Args:
        fn: one full training step.
        device: where the step runs.
        baseline: tensors alive before ``fn`` (CPU only).
        model: the model the step runs (its forward marks the forward phase).
        optimizer: the optimizer the step steps.

    Returns:
        Peak bytes per phase that ran, baseline included (the step's peak is their maximum),
        and the timeline on CPU.

    Raises:
        Whatever ``fn`` raises, out-of-memory errors included.
    """
    if device.type == "cuda":
        start = torch.cuda.memory_allocated(device)
        phases = _CudaPhases(device)
        with _phase_hooks(model, optimizer, phases.start_phase):
            fn()
        phases.close()
        return StepMemory(dict(phases.phase_peak_bytes), start_bytes=start)
    counter = LiveTensorCounter(baseline, device_type=device.type)
    start = counter.live_bytes
    with _phase_hooks(model, optimizer, counter.start_phase), counter:
        fn()
    return StepMemory(dict(counter.phase_peak_bytes), counter.timeline, counter.operators, start)


def reset_peak_rss() -> bool:
    """Resets the kernel's resident-set high-water mark of this process (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> Optional[int]:
    """This process's resident-set high-water mark since the last :func:`reset_peak_rss`."""
    return proc_status_bytes("VmHWM")
