"""Checkpoints every N optimizer steps, so a crash loses minutes, not an epoch.

torchtune 0.6.1 checkpoints at epoch ends only, and a resumed run redoes the epoch. A step
checkpoint holds everything the next step depends on: the trainable weights, the optimizer,
the LR scheduler, the dataloader's position inside the epoch (fixed-size or token-budget
batches), the batch state and every rank's RNG. A run resumed from it takes the same steps
the uninterrupted run would have taken.

Files are ``<directory>/step_<N>.pt``, written to a temporary name, flushed to disk and renamed,
so a crash mid-write leaves the previous checkpoints and no partial file; only the last
``keep_last`` are kept.
"""

import os
import re
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from adaptive_batch.validation import check_positive_int

DIRNAME = "step_checkpoints"
LR_SCHEDULER_KEY = "lr_scheduler"
_NAME = re.compile(r"^step_(\d+)\.pt$")
_TEMP_PREFIX = ".step_writing_"


class StepCheckpoints:
    """The step checkpoints of a run's output directory.

    Args:
        directory: where they go (``<output_dir>/step_checkpoints``).
        every_n_steps: save after every this many optimizer steps; ``None`` never saves (a
            resume still finds what an earlier run saved).
        keep_last: how many to keep; older ones are removed after a new one is written.
        log: where each save is reported.

    Raises:
        ConfigError: for ``every_n_steps`` or ``keep_last`` that is not a positive int.
    """

    def __init__(
        self,
        directory: str,
        *,
        every_n_steps: Optional[int] = None,
        keep_last: int = 2,
        log: Callable[[str], None] = print,
    ) -> None:
        check_positive_int("save_every_n_steps", every_n_steps, allow_none=True)
        check_positive_int("keep_last_n_checkpoints", keep_last)
        self.directory = directory
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.log = log

    def due(self, global_step: int) -> bool:
        """Whether a checkpoint is due after ``global_step`` steps."""
        return self.every_n_steps is not None and global_step > 0 and global_step % self.every_n_steps == 0

    def saved(self) -> List[Tuple[int, str]]:
        """The saved checkpoints as ``(step, path)``, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        found = [(int(m.group(1)), name) for name in os.listdir(self.directory) if (m := _NAME.match(name))]
        return [(step, os.path.join(self.directory, name)) for step, name in sorted(found)]

    def latest(self) -> Optional[Tuple[int, str]]:
        """The newest checkpoint as ``(step, path)``, or ``None``."""
        saved = self.saved()
        return saved[-1] if saved else None

    def save(self, global_step: int, state: Dict[str, Any]) -> str:
        """Writes ``state`` as step ``global_step``'s checkpoint, atomically, and removes the
        ones past ``keep_last``; returns its path."""
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"step_{global_step}.pt")
        fd, temporary = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=".pt", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
        _fsync_directory(self.directory)
        removed = [old for _, old in self.saved()[: -self.keep_last]]
        for old in removed:
            os.unlink(old)
        note = f"; removed {', '.join(os.path.basename(p) for p in removed)}" if removed else ""
        self.log(f"Step {global_step}: checkpoint saved to {path}{note}.")
        return path

    def remove_partial_writes(self) -> None:
        """Deletes temporaries a crash left mid-write (never a finished checkpoint)."""
        if os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if name.startswith(_TEMP_PREFIX):
                    os.unlink(os.path.join(self.directory, name))
                    self.log(f"Removed a step checkpoint left half-written by an interrupted run: {name}")

    @staticmethod
    def load(path: str) -> Dict[str, Any]:
        """A saved checkpoint's state, on the CPU."""
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _fsync_directory(directory: str) -> None:
    """Makes the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
