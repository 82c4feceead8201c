"""SIGTERM and SIGINT stop the run between steps, where a checkpoint can hold it exactly.

A scheduler sends SIGTERM before it kills a job; Ctrl-C sends SIGINT. Either one asks the run
to finish the step it is in and stop; the recipe then saves what it can and says how to
resume. A second signal ends the process at once, as that signal would with no handler. On
several ranks, every rank stops after the same step: the ranks agree at each step's end
whether any of them was signalled.
"""

import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Dict, Optional

import torch

from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import RunStopped
import adaptive_batch.faults as faults
import adaptive_batch.logs as logs

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _HandledSignals:
    """SIGTERM and SIGINT go to ``_handle`` inside the context, and back to what they did after."""

    _previous: Dict[int, Any]

    def __enter__(self) -> Any:
        self._previous = {}
        # Python lets only the main thread install handlers; elsewhere signals keep their default.
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        raise NotImplementedError


class StopSignals(_HandledSignals):
    """A context in which SIGTERM and SIGINT are noted instead of ending the process.

    Args:
        ranks: the data-parallel ranks, which agree on stopping.
        log: where a received signal is reported (``None``: the ``adaptive_batch`` logger).
    """

    def __init__(self, ranks: Optional[RankGroup] = None, log: Optional[Callable[[str], None]] = None) -> None:
        self.ranks = ranks or RankGroup(torch.device("cpu"))
        self.log = log
        self.received: Optional[int] = None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is not None:  # the second one: what it does without a handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        with logs.lines_to(self.log):
            logs.info(f"{signal.Signals(signum).name} received: stopping after this step (send it again to stop at once).")

    def stop_requested(self) -> Optional[int]:
        """The signal that asks every rank to stop now (each rank calls it after each step),
        or ``None``."""
        agreed = self.ranks.max(self.received or 0)
        return agreed or None


class StopAtOnce(_HandledSignals):
    """A context in which SIGTERM and SIGINT stop what runs at once, with :class:`RunStopped`
    (for setup and the batch-size probe, which has no step to finish and minutes to run).

    Args:
        during: what runs, for the message (``"setup"``).
        then: what is kept and what to do, for the message.
    """

    def __init__(self, during: str, then: str) -> None:
        self.during, self.then = during, then
        self.received: Optional[int] = None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        # Raised here, and again between the probe's steps and at the block's end: where the
        # signal lands in a weakref callback (the probe's tensor counter) Python drops it.
        self.received = signum
        faults.ask_to_stop(self._stopped())
        raise self._stopped()

    def _stopped(self) -> RunStopped:
        assert self.received is not None
        return RunStopped(f"{signal.Signals(self.received).name} during {self.during}: {self.then}.", self.received)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        super().__exit__(exc_type, exc, tb)
        faults.ask_to_stop(None)
        if self.received is not None and not isinstance(exc, RunStopped):
            raise self._stopped() from exc
