"""Checkpoints every N optimizer steps, so a crash loses minutes, not an epoch.

torchtune 0.6.1 checkpoints at epoch ends only, and a resumed run redoes the epoch. A step
checkpoint holds everything the next step depends on: the trainable weights, the optimizer,
the LR scheduler, the dataloader's position inside the epoch (fixed-size or token-budget
batches), the batch state and every rank's RNG. A run resumed from it takes the same steps
the uninterrupted run would have taken.

The checkpoint is handed what it saves (:meth:`StepCheckpoints.attach`): a function giving the
weights, optimizer and recipe keys, and the stateful objects of the position (dataloader, LR
scheduler, random generators), which it restores itself; it decides when a save is due
(:meth:`StepCheckpoints.after_step`) and which saved one a resume starts from
(:meth:`StepCheckpoints.resume_state`).

Files are ``<directory>/step_<N>.pt``, written to a temporary name, flushed to disk and renamed,
so a crash mid-write leaves the previous checkpoints and no partial file; only the last
``keep_last`` are kept.
"""

import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple

import torch

from adaptive_batch.distributed import RankGroup, check_same_world_size
from adaptive_batch.errors import CheckpointWriteError, ConfigError
from adaptive_batch.files import atomic_write, remove_partial_writes
import adaptive_batch.logs as logs
from adaptive_batch.validation import check_positive_int

DIRNAME = "step_checkpoints"
LR_SCHEDULER_KEY = "lr_scheduler"
_NAME = re.compile(r"^step_(\d+)\.pt$")
RANKS_KEY = "world_size"


class Stateful(Protocol):
    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Any) -> None: ...


class StepCheckpoints:
    """The step checkpoints of a run's output directory.

    Args:
        directory: where they go (``<output_dir>/step_checkpoints``).
        every_n_steps: save after every this many optimizer steps; ``None`` never saves (a
            resume still finds what an earlier run saved).
        keep_last: how many to keep; older ones are removed after a new one is written.
        ranks: the data-parallel ranks: every one gathers the state, rank 0 writes.
        log: where each save is reported (``None``: the ``adaptive_batch`` logger).

    Raises:
        ConfigError: for ``every_n_steps`` or ``keep_last`` that is not a positive int.
    """

    def __init__(
        self,
        directory: str,
        *,
        every_n_steps: Optional[int] = None,
        keep_last: int = 2,
        ranks: Optional[RankGroup] = None,
        log: Optional[Callable[[str], None]] = None,
    ) -> None:
        check_positive_int("save_every_n_steps", every_n_steps, allow_none=True)
        check_positive_int("keep_last_n_checkpoints", keep_last)
        self.directory = directory
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.ranks = ranks or RankGroup(torch.device("cpu"))
        self.log = log
        self._state: Callable[[], Dict[str, Any]] = dict
        self._position: Dict[str, Stateful] = {}

    def attach(self, state: Callable[[], Dict[str, Any]], position: Mapping[str, Optional[Stateful]]) -> None:
        """What a checkpoint holds: ``state()`` (weights, optimizer, recipe keys; called on every
        rank) and each object of ``position`` under its name (``None`` ones are left out)."""
        self._state = state
        self._position = {name: obj for name, obj in position.items() if obj is not None}

    def after_step(self, global_step: int) -> Optional[str]:
        """Saves when one is due after ``global_step`` steps (every rank calls it); returns the
        path written."""
        return self.save_now(global_step) if self.due(global_step) else None

    def save_now(self, global_step: int) -> str:
        """Saves the state after ``global_step`` steps (every rank calls it; rank 0 writes);
        returns the path written.

        Raises:
            CheckpointWriteError: on every rank, when rank 0 could not write it.
        """
        state = {**self._state(), **{name: obj.state_dict() for name, obj in self._position.items()}}
        state[RANKS_KEY] = self.ranks.world_size
        # A failed write stops every rank with rank 0's message.
        return self.ranks.decide_on_main(lambda: self.save(global_step, state), errors=(CheckpointWriteError,))

    def resume_state(self, epoch_step: int) -> Optional[Dict[str, Any]]:
        """The newest readable step checkpoint's state, when it is newer than the epoch
        checkpoint's ``epoch_step`` (-1: none); ``None`` when the epoch checkpoint is the one to
        resume. An unreadable one (corrupt, cut short, empty) is reported and the one before it
        tried.

        Raises:
            ConfigError: when it was written by another number of ranks.
        """
        with logs.lines_to(self.log):
            for step, path in reversed(self.saved()):
                # At the same step the epoch checkpoint wins: it ends the epoch, and resuming from
                # it starts the next one, where a step checkpoint would re-enter the finished epoch.
                if step <= epoch_step:
                    logs.info(f"Resuming from the epoch checkpoint (step {epoch_step}): {path} is not newer.")
                    return None
                try:
                    state = self.load(path)
                except Exception as e:  # a truncated zip, an empty file, bytes that are no pickle
                    logs.info(f"The step checkpoint {path} cannot be read ({type(e).__name__}: {e}); trying the one before it.")
                    continue
                since = f"the epoch checkpoint is at step {epoch_step}" if epoch_step >= 0 else "no epoch checkpoint yet"
                logs.info(f"Resuming from the step checkpoint {path} (step {step}; {since}).")
                return self._checked(state, path)
        return None

    def _checked(self, state: Dict[str, Any], path: str) -> Dict[str, Any]:
        """``state`` when it was written by this run's number of ranks.

        Raises:
            ConfigError: otherwise, or when it did not record them.
        """
        if RANKS_KEY not in state:
            raise ConfigError(
                f"resume_from_checkpoint=True: the step checkpoint {path} was written by an older adaptive-batch; "
                f"delete {self.directory} to resume from the epoch checkpoint, or start a new output_dir."
            )
        check_same_world_size(state[RANKS_KEY], self.ranks.world_size, f"the step checkpoint {path}")
        return state

    def restore_position(self, state: Mapping[str, Any]) -> None:
        """Loads each attached position object from ``state`` (a checkpoint's).

        Raises:
            ConfigError: when the checkpoint has no state for one (e.g. an LR scheduler added).
        """
        for name, obj in self._position.items():
            if name not in state:
                raise ConfigError(
                    f"resume_from_checkpoint=True: the step checkpoint has no {name!r} state and this run has one; "
                    f"resume with the settings it was written with, or start a new output_dir."
                )
            obj.load_state_dict(state[name])

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
        ones past ``keep_last``; returns its path.

        Raises:
            CheckpointWriteError: when it cannot be written (the earlier ones are kept).
        """
        path = os.path.join(self.directory, f"step_{global_step}.pt")
        atomic_write(path, lambda f: torch.save(state, f), fault="step_checkpoint_written")
        removed = [old for _, old in self.saved()[: -self.keep_last]]
        for old in removed:
            os.unlink(old)
        note = f"; removed {', '.join(os.path.basename(p) for p in removed)}" if removed else ""
        with logs.lines_to(self.log):
            logs.info(f"Step {global_step}: checkpoint saved to {path}{note}.")
        return path

    def remove_partial_writes(self) -> None:
        """Deletes temporaries a crash left mid-write (never a finished checkpoint)."""
        with logs.lines_to(self.log):
            remove_partial_writes(self.directory)

    @staticmethod
    def load(path: str) -> Dict[str, Any]:
        """A saved checkpoint's state, on the CPU."""
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)

