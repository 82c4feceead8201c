"""Every error a caller of adaptive-batch may catch, in one place.

Each message names what went wrong, the value, and the fix.
"""

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

    def __init__(self, bytes_needed: Optional[int], budget_bytes: int) -> None:
        self.bytes_needed = bytes_needed
        self.budget_bytes = budget_bytes
        needed = (
            f"needs {format_bytes(bytes_needed)} ({bytes_needed} bytes)"
            if bytes_needed is not None
            else "ran out of memory before it finished"
        )
        super().__init__(
            f"batch size 1 does not fit: one training step {needed}, and "
            f"{format_bytes(budget_bytes)} ({budget_bytes} bytes) is available. Raise max_memory, "
            "shorten tokenizer.max_seq_len, or enable activation checkpointing."
        )


class BatchIncreaseFunctionError(ConfigError):
    """The batch increase function failed or returned something that is not an increment."""


class MicroBatchOutOfMemoryError(RuntimeError):
    """A step ran out of memory with micro-batches of one sample: nothing smaller to try."""


class PeerOutOfMemoryError(MemoryError):
    """Another rank (or this one) ran out of memory, so every rank drops the step together."""
