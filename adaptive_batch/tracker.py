"""Peak memory of one training step, measured while it runs.

CUDA: the caching allocator's ``max_memory_allocated``. CPU has no allocator statistics, so
:class:`LiveTensorCounter` counts the bytes of live tensor storages: every storage an operator
returns is counted once and uncounted when it is freed. It holds only weak references, so a step
that fails with an out-of-memory error leaves nothing alive behind it (torch's ``MemTracker``
keeps the failed step's tensors, and every later trial then fails).
"""

import weakref
from typing import Callable, Dict, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from adaptive_batch.memory import proc_status_bytes


def live_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storages once)."""
    seen = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class LiveTensorCounter(TorchDispatchMode):
    """Counts live tensor bytes on one device type and keeps the peak.

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
        self._refs: Dict[int, weakref.ref] = {}
        for t in baseline:
            self._track(t)

    def _release(self, key: int, nbytes: int, _ref: weakref.ref) -> None:
        if self._refs.pop(key, None) is not None:
            self.live_bytes -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type or t.is_meta:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda r, k=key, n=nbytes: self._release(k, n, r))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
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
