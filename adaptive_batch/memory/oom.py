"""Recognising out-of-memory failures by type, and giving back what a failed step held."""

from contextlib import contextmanager
import gc
import threading
from typing import Callable, Iterator, Optional, Tuple, TypeVar

import torch

from adaptive_batch.memory.device import free_mkl_buffers

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
    # A C++ allocation failure inside a kernel (MKL's and oneDNN's scratch, a std::vector).
    "std::bad_alloc",
)
# Failures that are an allocation failure only once a smaller batch of the same step has run:
# oneDNN reports a scratchpad it could not allocate as a primitive it could not create, and
# cuBLAS a handle it could not allocate as not initialised; at the first step either may be a
# real misconfiguration, which must not pass for "batch 1 does not fit".
_OOM_MARKERS_AFTER_A_SMALLER_STEP = (
    "could not create a primitive",
    "CUBLAS_STATUS_NOT_INITIALIZED",
)


def is_oom_error(exc: BaseException, *, after_a_smaller_step: bool = False) -> bool:
    """Whether ``exc`` is an allocation failure (CUDA, cuDNN, cuBLAS, the CPU allocator, a C++
    ``std::bad_alloc``, or Python's ``MemoryError``).

    Args:
        exc: the exception.
        after_a_smaller_step: a smaller batch of the same step has run, so oneDNN's "could not
            create a primitive" and cuBLAS's "not initialized" can only be a failed allocation.
    """
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        markers = _OOM_MARKERS + (_OOM_MARKERS_AFTER_A_SMALLER_STEP if after_a_smaller_step else ())
        return any(marker in message for marker in markers)
    return False


T = TypeVar("T")


def catch_oom(fn: Callable[[], T], *, after_a_smaller_step: bool = False) -> Tuple[Optional[T], Optional[str]]:
    """Runs ``fn()``; an out-of-memory error (:func:`is_oom_error`, with ``after_a_smaller_step``)
    comes back as its first line instead of raising.

    The error and its traceback (which hold the failed step's frames, and through them its
    tensors) are gone when this returns, so a :func:`release_memory` after it frees them.

    Returns:
        ``(result, None)``, or ``(None, message)`` when ``fn`` ran out of memory.

    Raises:
        Whatever else ``fn`` raises.
    """
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if not is_oom_error(exc, after_a_smaller_step=after_a_smaller_step):
            raise
        return None, first_line(exc)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none (Python's own
    ``MemoryError`` arrives empty)."""
    return (str(exc) or type(exc).__name__).splitlines()[0]


_collections_of_new_objects = 0  # the depth of nested collections_of_new_objects blocks
_froze_here = False  # whether the outermost block set the objects aside (and so puts them back)
# Once seen, a freeze of the process's own is taken to last: gc.get_freeze_count() walks every
# frozen object (50 ms for 500K), and a service freezes once, after its imports.
_process_froze = False
_collections_lock = threading.Lock()  # entry and exit, from any thread


@contextmanager
def collections_of_new_objects() -> Iterator[None]:
    """Inside the block, the cyclic garbage collector visits only objects made in it.

    A full ``gc.collect()`` visits every object the process holds: 0.3 s each where torch and
    Transformers are imported, as long as a small model's trial step. The garbage a trial leaves
    (its traceback's frames, an abandoned step's graph) is all made after the probe starts, so
    the garbage already there is collected once, the objects left are set aside
    (``gc.freeze``) until the block ends, and collected as before after it. Blocks nest: the
    outermost one sets them aside and puts them back. A process that froze its own objects
    (a server after its imports) keeps its freeze: nothing is set aside or put back here. That
    freeze is asked about until it is seen, and taken to last from then on (a process that undoes
    it later has its collections visit every object, as without the block).

    Within the block, an object from before it that becomes cyclic garbage waits for the block's
    end (a step that drops one holds its memory until then), and a ``gc.freeze()`` made inside
    the block is undone with the block's own.
    """
    global _collections_of_new_objects, _froze_here, _process_froze
    with _collections_lock:
        _collections_of_new_objects += 1
        if _collections_of_new_objects == 1:
            _process_froze = _process_froze or gc.get_freeze_count() > 0
            _froze_here = not _process_froze
            gc.collect()
            if _froze_here:
                gc.freeze()
    try:
        yield
    finally:
        with _collections_lock:
            _collections_of_new_objects -= 1
            if _collections_of_new_objects == 0 and _froze_here:
                gc.unfreeze()


def release_memory(device: Optional[torch.device] = None, *, cublas_workspaces: bool = False) -> None:
    """Frees what an abandoned or measured step left: cyclic garbage, the buffers MKL keeps for
    the step's product shapes (:func:`~adaptive_batch.memory.device.free_mkl_buffers`) and, on
    CUDA, the allocator's cache.

    Call it after the exception (and its traceback, which holds the step's frames) is gone.

    Args:
        device: where the step ran.
        cublas_workspaces: on CUDA, also free cuBLAS's workspaces (one per thread that ran a
            product: the forward's and autograd's), so the next step makes them where a fresh
            process's first step does (see :func:`~adaptive_batch.probe.verify.runs_consecutive_steps`).
    """
    gc.collect()
    free_mkl_buffers()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds only
        if cublas_workspaces and clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
