"""Recognising out-of-memory failures by type, and giving back what a failed step held."""

import gc
from typing import Optional

import torch

# Allocation failures that arrive as a plain RuntimeError, marked only by their message: the
# CPU allocator's; CUDA's from outside the caching allocator (a kernel launch, a context);
# cuDNN's and cuBLAS's when their workspace cannot be allocated (cuDNN reports some of those as
# NOT_SUPPORTED; Lightning and Composer treat it as out of memory too).
_OOM_MARKERS = (
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_ALLOC_FAILED",
)


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (CUDA, cuDNN, cuBLAS, the CPU allocator, or
    Python's ``MemoryError``)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(marker in message for marker in _OOM_MARKERS)
    return False


def release_memory(device: Optional[torch.device] = None) -> None:
    """Frees what an abandoned step left: cyclic garbage and, on CUDA, the allocator's cache.

    Call it after the exception (and its traceback, which holds the step's frames) is gone.
    """
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
