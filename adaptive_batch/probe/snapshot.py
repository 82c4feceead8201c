"""Putting a training run back exactly as it was after probing it with real steps.

The snapshot goes to a file, not to memory: a copy of the weights in memory would itself take
the room the probe is measuring. The file never has a name on Linux (``O_TMPFILE``), so a run
killed while probing leaves nothing behind (the kernel frees it with the process) and another
rank sweeping the same directory cannot take it away. Where a file system cannot make unnamed
files, it is created with its owner's process id in the name and unlinked at once.
"""

import contextlib
import errno
import glob
import os
import socket
import tempfile
from types import TracebackType
from typing import Any, BinaryIO, Dict, Optional, Tuple, Type

import torch
from torch import nn

import adaptive_batch.logs as logs
from adaptive_batch.memory.oom import is_oom_error
from adaptive_batch.rng import rng_state, set_rng_state


class TrainingStateSnapshot:
    """Saves model (its gradients and non-persistent buffers too), optimizer, LR scheduler and RNG
    state on entry and restores it on exit; the steps inside start with no gradients.

    Used as a context manager around probe steps; the state is restored whether the block ends
    normally or with an error, and the snapshot file is removed.

    Args:
        model: the model whose parameters and buffers the steps change.
        optimizer: the optimizer (its state, e.g. Adam moments, is created by the first step).
        lr_scheduler: an LR scheduler, or ``None``.
        directory: where the snapshot file goes (e.g. the run's output directory); stale
            snapshot files found there are removed, each said in a line.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        lr_scheduler: Optional[Any] = None,
        directory: Optional[str] = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.directory = directory
        self._file: Optional[BinaryIO] = None
        self._path: Optional[str] = None  # where to read it back from
        self._named: Optional[str] = None  # its name, where the platform cannot unlink it early
        self._rng: Optional[Dict[str, Any]] = None

    def save(self) -> None:
        """Writes the state to an unnamed temporary file and remembers the RNG state."""
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
        remove_stale_snapshots(self.directory)
        fd, self._named = _unnamed_or_owned_file(self.directory or tempfile.gettempdir())
        self._file = os.fdopen(fd, "w+b")
        self._path = f"/proc/self/fd/{fd}" if self._named is None else self._named
        # Gradients a caller holds mid-accumulation go to the file and out of the trials' way.
        grads = {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}
        model_state = self.model.state_dict()
        # Buffers a state_dict leaves out (persistent=False: a step counter, a running average
        # the forward keeps) are the model's state too.
        unsaved = {name: b for name, b in self.model.named_buffers() if name not in model_state}
        state = {"model": model_state, "grads": grads, "buffers": unsaved}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        torch.save(state, self._file)
        self._file.flush()
        del state, grads, model_state, unsaved
        for p in self.model.parameters():
            p.grad = None
        self._rng = rng_state()

    def restore(self) -> None:
        """Loads the saved state back in place and closes (frees) the file.

        Raises:
            RuntimeError: if :meth:`save` was not called.
        """
        if self._path is None or self._rng is None or self._file is None:
            raise RuntimeError("TrainingStateSnapshot.restore() called before save().")
        # mmap keeps the load from holding a second full copy of the weights in memory;
        # weights_only: the file sits in a directory others can write to.
        try:
            state = torch.load(self._path, mmap=True, weights_only=True)
        except RuntimeError as e:
            if not is_oom_error(e) and "unable to mmap" not in str(e):
                raise
            # Under an address-space limit the trials' freed blocks may be all the room left:
            # glibc kept them, so a plain read (into malloc'd memory) can reuse them; a new
            # mapping cannot.
            state = torch.load(self._path, mmap=False, weights_only=True)
        self.model.load_state_dict(state["model"])
        _put_back_buffers(self.model, state.get("buffers", {}))
        saved_grads = state.get("grads", {})
        for name, p in self.model.named_parameters():
            grad = saved_grads.get(name)  # a CPU one out of the file's mapping; a card's is loaded fresh
            p.grad = None if grad is None else grad.clone() if grad.device.type == "cpu" else grad
        if self.optimizer is not None:
            # The saved values go back into the tensors the steps left (load_state_dict would
            # allocate new ones): the memory the caller trains on is then laid out as it was
            # for the checked steps. Under an address-space limit a reallocated optimizer state
            # fragmented glibc's heap enough that the checked batch failed the caller's 2nd step.
            kept = _state_tensors(self.optimizer)
            self.optimizer.state.clear()
            self.optimizer.load_state_dict(state["optimizer"])
            _into_kept_memory(self.optimizer, kept)
            del kept
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        del state
        self._file.close()
        if self._named is not None:
            os.remove(self._named)
        self._file = self._path = self._named = None
        set_rng_state(self._rng)

    def __enter__(self) -> "TrainingStateSnapshot":
        self.save()
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.restore()


def _put_back_buffers(model: nn.Module, saved: Dict[str, torch.Tensor]) -> None:
    """The saved buffers back: into the live ones where they still fit, else as they were (a
    buffer the steps replaced with another shape, an expanded view, one set to ``None``)."""
    with torch.no_grad():
        for name, value in saved.items():
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            live = owner._buffers.get(attr)
            if live is not None and live.shape == value.shape and live.dtype == value.dtype and live.is_contiguous():
                live.copy_(value)
            else:
                owner._buffers[attr] = value.clone()


SNAPSHOT_PREFIX = ".probe_snapshot_"


def _unnamed_or_owned_file(directory: str) -> Tuple[int, Optional[str]]:
    """A file open for reading and writing in ``directory``, and its name where it has one.

    Two ranks of one run share an output directory, and each sweeps it for stale snapshots
    before saving its own: a name that lived even between ``mkstemp`` and ``unlink`` was once
    swept away under the other rank (whose unlink then failed).
    """
    if hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
        try:
            return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    fd, path = tempfile.mkstemp(prefix=f"{SNAPSHOT_PREFIX}{os.getpid()}@{socket.gethostname()}_", suffix=".pt",
                                dir=directory)
    if not os.path.isdir("/proc/self/fd"):  # pragma: no cover - Linux has /proc
        return fd, path
    with contextlib.suppress(FileNotFoundError):  # swept already: the open descriptor holds the file
        os.unlink(path)
    return fd, None


def _owner_lives(path: str) -> bool:
    """Whether the process named in a snapshot file's name (``.probe_snapshot_<pid>@<host>_...``)
    may live: one of this host that runs, or one of another host (a shared file system), which
    cannot be asked. Names without a process id come from older versions, whose runs are over."""
    owner = os.path.basename(path)[len(SNAPSHOT_PREFIX) :].split("_", 1)[0]
    pid, _, host = owner.partition("@")
    if not pid.isdigit():
        return False
    if host and host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_snapshots(directory: Optional[str]) -> int:
    """Removes snapshot files that a killed run left in ``directory``: a file whose owner still
    runs (another rank, between creating and unlinking it) is left alone.

    Returns:
        How many files were removed.
    """
    removed = 0
    for path in glob.glob(os.path.join(directory or tempfile.gettempdir(), SNAPSHOT_PREFIX + "*.pt")):
        if _owner_lives(path):
            continue
        try:
            size = os.path.getsize(path)
            os.remove(path)
        except OSError:
            continue
        removed += 1
        logs.info(f"probe: removed {path} ({size} bytes), a snapshot a killed run left behind.")
    return removed


def _state_tensors(optimizer: torch.optim.Optimizer) -> Dict[Any, torch.Tensor]:
    """The optimizer's state tensors by (parameter, key)."""
    return {
        (id(param), key): value
        for param, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def _into_kept_memory(optimizer: torch.optim.Optimizer, kept: Dict[Any, torch.Tensor]) -> None:
    """Copies the loaded state into the tensors in ``kept`` where one of the same shape, dtype
    and device exists, and otherwise into new memory.

    ``Optimizer.load_state_dict`` keeps a loaded CPU tensor as it is when dtype and device
    already match, so without the copy the state would live in a mapping of the (deleted)
    snapshot file and keep the whole file mapped: address space a later step under a limit
    cannot use.
    """
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            old = kept.get((id(param), key))
            if old is not None and (old.shape, old.dtype, old.device) == (value.shape, value.dtype, value.device):
                with torch.no_grad():
                    old.copy_(value)
                state[key] = old
            elif value.device.type == "cpu":
                state[key] = value.clone()
