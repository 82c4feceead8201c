"""Every error a caller of adaptive-batch may catch, in one place.

Each message names what went wrong, the value, and the fix.
"""

import errno
import os
import shutil
from typing import Optional

from adaptive_batch.memory.device import format_bytes


class ConfigError(ValueError):
    """A setting the run cannot use; the message names the key, the value and the fix."""


class BatchSizeTooLargeError(RuntimeError):
    """Not even batch size 1 fits in the memory budget.

    Attributes:
        bytes_needed: measured peak of a batch-1 step, or ``None`` when it failed to allocate.
        budget_bytes: the budget it was measured against.
    """

    def __init__(
        self, bytes_needed: Optional[int], budget_bytes: int, source: str = "max_memory", rank: Optional[int] = None,
        smallest: int = 1,
    ) -> None:
        from adaptive_batch.distributed import MAX_MEMORY_ENV

        self.bytes_needed = bytes_needed
        self.budget_bytes = budget_bytes
        self.source = source
        self.rank = rank
        self.smallest = smallest  # 2 for a model whose BatchNorm cannot train 1
        needed = (
            f"needs {format_bytes(bytes_needed)} ({bytes_needed} bytes)"
            if bytes_needed is not None
            else "ran out of memory before it finished"
        )
        # Raising max_memory only helps when it set the budget; otherwise the device did.
        whose = "" if rank is None else f"rank {rank}'s "
        if source == "max_memory":
            more = "Raise max_memory"
        elif source == MAX_MEMORY_ENV:
            more = f"Raise {whose}value in {MAX_MEMORY_ENV}"
        else:
            more = f"Free memory ({source} set the budget)"
        where = "" if rank is None else f"rank {rank}: "
        super().__init__(
            f"{where}batch size {smallest} does not fit: one training step {needed}, and "
            f"{format_bytes(budget_bytes)} ({budget_bytes} bytes) is available. {more}, "
            "shorten the longest sample (tokenizer.max_seq_len in a torchtune config, the tokenizer's max_length "
            "with Hugging Face), or enable activation checkpointing."
        )

    def __reduce__(self):
        return type(self), (self.bytes_needed, self.budget_bytes, self.source, self.rank, self.smallest)


class BatchIncreaseFunctionError(ConfigError):
    """The batch increase function failed or returned something that is not an increment."""


class MicroBatchOutOfMemoryError(RuntimeError):
    """A step ran out of memory with micro-batches of one sample: nothing smaller to try."""


class PeerOutOfMemoryError(MemoryError):
    """Another rank (or this one) ran out of memory, so every rank drops the step together."""


class CheckpointWriteError(RuntimeError):
    """A file of the run could not be written (out of disk space, quota, permission); nothing
    half-written was left under its name.

    Attributes:
        path: the file (or checkpoint) that was not written.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self):  # one rank's error is raised on every rank
        return type(self), (str(self), self.path)

    @classmethod
    def from_error(cls, path: str, error: BaseException) -> "CheckpointWriteError":
        """The error for ``path`` whose write failed with ``error``."""
        reason = "out of disk space" if is_disk_full(error) else f"{type(error).__name__}: {error}"
        return cls(f"{path} could not be written ({reason}{_free_space(path)}); nothing was written under its name", path)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is the file system out of space or quota (torch's C++ writer reports it
    as a ``RuntimeError`` naming the failed write)."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, RuntimeError) and "file write failed" in str(error)


def _free_space(path: str) -> str:
    """``, N free`` on ``path``'s file system, or nothing when that cannot be read."""
    directory = os.path.dirname(os.path.abspath(path))
    while directory and not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    try:
        return f", {format_bytes(shutil.disk_usage(directory).free)} free there"
    except OSError:
        return ""


class RunStopped(BaseException):
    """The run stopped at a signal (SIGTERM, SIGINT): after a finished step, or at once in setup.

    A stop, like ``KeyboardInterrupt``, is no error: a builder's or a library's ``except
    Exception`` that reports failures must not turn it into one.

    Attributes:
        signum: the signal's number; the process exits with ``128 + signum``, as a shell does.
    """

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    def __reduce__(self):
        return type(self), (str(self), self.signum)
