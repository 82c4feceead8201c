"""Recognising out-of-memory failures by type, and giving back what a failed step held."""

import gc
from typing import Optional

import torch

# The CPU allocator raises a plain RuntimeError; its message is the only mark it carries.
_CPU_OOM_MARKERS = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (CUDA, CPU allocator or Python ``MemoryError``)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(marker in message for marker in _CPU_OOM_MARKERS)
    return False


def release_memory(device: Optional[torch.device] = None) -> None:
    """Frees what an abandoned step left: cyclic garbage and, on CUDA, the allocator's cache.

    Call it after the exception (and its traceback, which holds the step's frames) is gone.
    """
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
