"""Named points where a test or the fault benchmark kills the run, so that no test of a crash
depends on timing.

``ADAPTIVE_BATCH_FAULT=<point>[:<n>[:<signal>]]`` sends ``signal`` (``SIGKILL`` unless named) to
this process the ``n``-th time (1 unless given) it reaches ``point``. ``SIGKILL`` is what a
preempted job or the OOM killer does: nothing in the process runs after it, so what is left on
disk is what a real crash leaves. ``SIGTERM`` or ``SIGINT`` test the run's own stop. Unset (as in
every ordinary run) a point costs one dictionary lookup.

The points (:data:`POINTS`), in the order a run reaches them:
    ``probe_trial``: after a trial step of the batch-size probe.
    ``inside_step``: after a step's forward and backward, before its optimizer step.
    ``after_step``: after a step and its log line, before a step checkpoint is due.
    ``file_written``: a file (the probe report, a cache entry, ...) written to its temporary
    name and flushed, not yet renamed.
    ``step_checkpoint_written``: the same for a step checkpoint.
    ``epoch_staged``: an epoch checkpoint's files written aside, not yet marked complete.
    ``epoch_committing``: an epoch checkpoint marked complete, its weights moved into place, its
    recipe state not yet.
    ``after_epoch``: an epoch checkpoint in place, before the next epoch starts.
"""

import os
import signal
from typing import Dict, Optional, Tuple

from adaptive_batch.errors import ConfigError

ENV = "ADAPTIVE_BATCH_FAULT"
POINTS = (
    "probe_trial", "inside_step", "after_step", "file_written", "step_checkpoint_written", "epoch_staged",
    "epoch_committing", "after_epoch",
)
_reached: Dict[str, int] = {}


def parse_fault(value: str) -> Tuple[str, int, signal.Signals]:
    """``<point>[:<n>[:<signal>]]`` as ``(point, n, signal)``.

    Raises:
        ConfigError: for an unknown point or signal, or an ``n`` that is not a positive int.
    """
    point, _, rest = value.partition(":")
    count, _, name = rest.partition(":")
    if point not in POINTS:
        raise ConfigError(f"{ENV}={value!r}: no fault point {point!r}; use one of {', '.join(POINTS)}.")
    if count and not (count.isdigit() and int(count) > 0):
        raise ConfigError(f"{ENV}={value!r}: {count!r} is not a positive count; write {point}:<n>, e.g. {point}:2.")
    try:
        sig = signal.Signals[name or "SIGKILL"]
    except KeyError:
        raise ConfigError(f"{ENV}={value!r}: {name!r} is not a signal; use SIGKILL, SIGTERM or SIGINT.") from None
    return point, int(count or 1), sig


def fault_point(point: str) -> None:
    """Sends the fault's signal to this process when ``ADAPTIVE_BATCH_FAULT`` names ``point``
    and this is the time it counts to.

    Raises:
        ConfigError: when ``ADAPTIVE_BATCH_FAULT`` is set to something :func:`parse_fault` refuses.
    """
    value: Optional[str] = os.environ.get(ENV)
    if not value:
        return
    name, count, sig = parse_fault(value)  # a misspelt point is an error, not a kill that never comes
    if name != point:
        return
    _reached[point] = _reached.get(point, 0) + 1
    if _reached[point] == count:
        os.kill(os.getpid(), sig)


_stop_asked: Optional[BaseException] = None


def ask_to_stop(error: Optional[BaseException]) -> None:
    """Has :func:`stop_point` raise ``error`` (``None``: no longer). A signal handler's exception
    is lost where the signal lands in a weakref callback or a ``__del__``, which Python cannot
    raise from: a SIGTERM during the probe was dropped there, and the run trained to its end."""
    global _stop_asked
    _stop_asked = error


def stop_point() -> None:
    """Raises the stop asked for with :func:`ask_to_stop`, if any (between a probe's steps)."""
    if _stop_asked is not None:
        raise _stop_asked


def reset() -> None:
    """Forgets how often each point was reached (a new run in the same process counts anew)."""
    _reached.clear()
