"""The library's log: standard ``logging`` under the ``adaptive_batch`` logger, rank 0's lines only.

A decision (the probe's answer, growth, a resume) is an INFO record and a recovery (an
out-of-memory retry, a setting taken over) a WARNING, on ``logging.getLogger("adaptive_batch")``.
It adds no handler: the application decides what is shown (``logging.basicConfig(level=
logging.INFO)`` shows the decisions); where it configured nothing, Python's last-resort handler
still prints the warnings to stderr (a ``NullHandler`` here would hide them). Every line goes
through this one logger, so :class:`RankZeroFilter` keeps data-parallel ranks from repeating rank
0's INFO lines; every rank's warnings pass, each named by its rank.

The library's code says a line with :func:`info` or :func:`warning`, and nothing passes a
callable down to it. Where a user passes ``log=`` (any callable taking a line, ``print`` or a
recipe's logger) or ``warn=`` to a public entry point, the entry point runs its work inside
:func:`lines_to`, and those callables take the lines instead, for as long as it runs (in this
thread, or task: a context variable)::

    with lines_to(print):             # INFO and WARNING lines to print
        probe_batch_size(options, target)
"""

from contextlib import contextmanager
import contextvars
import logging
import os
from typing import Callable, Iterator, Optional, Tuple

LOGGER = logging.getLogger("adaptive_batch")

Log = Callable[[str], None]


def process_rank() -> int:
    """This process's data-parallel rank: ``torch.distributed``'s once initialized, else the
    ``RANK`` torchrun sets, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankZeroFilter(logging.Filter):
    """Passes rank 0's records, and the warnings and errors of other ranks prefixed by their rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = process_rank()
        if rank == 0:
            return True
        if record.levelno < logging.WARNING:
            return False
        if getattr(record, "rank", None) is None:  # every handler sees the record named once
            record.rank = rank
            record.msg, record.args = f"[rank {rank}] {record.getMessage()}", ()
        return True


LOGGER.addFilter(RankZeroFilter())


# Where lines go while a caller's log= or warn= is in force: (INFO's, WARNING's), ``None`` for the
# logger's own (called here, so that a record still names the module and line that said it).
_SINK: contextvars.ContextVar[Optional[Tuple[Optional[Log], Optional[Log]]]] = contextvars.ContextVar(
    "adaptive_batch_sink", default=None
)


@contextmanager
def lines_to(log: Optional[Log] = None, warn: Optional[Log] = None) -> Iterator[None]:
    """Sends the lines said inside the block to a caller's callables.

    INFO lines go to ``log`` (the logger's INFO when ``None``), warnings to ``warn``, else
    ``log``, else the logger's WARNING. With neither given the sink in force stays: a public
    entry point called from inside another keeps the outer caller's callables. The previous
    sink is back on exit. A thread started inside the block does not inherit it (unless it
    runs in a copy of this context).

    Args:
        log: takes the INFO lines (and the warnings, without ``warn``).
        warn: takes the warnings.
    """
    if log is None and warn is None:
        yield
        return
    token = _SINK.set((log, warn if warn is not None else log))
    try:
        yield
    finally:
        _SINK.reset(token)


@contextmanager
def quiet() -> Iterator[None]:
    """Drops the lines said inside the block: work run only for its answer (the planner's search
    over fake steps, a first guess from two steps), whose trials are no decision to report."""
    with lines_to(_drop, _drop):
        yield


def _drop(line: str) -> None:
    pass


def info(msg: str) -> None:
    """Says a decision: to the ``log`` of the :func:`lines_to` in force, else the logger's INFO."""
    sink = _SINK.get()
    if sink is None or sink[0] is None:
        LOGGER.info(msg, stacklevel=2)
    else:
        sink[0](msg)


def warning(msg: str) -> None:
    """Says a recovery: to the ``warn`` (or ``log``) of the :func:`lines_to` in force, else the
    logger's WARNING."""
    sink = _SINK.get()
    if sink is None or sink[1] is None:
        LOGGER.warning(msg, stacklevel=2)
    else:
        sink[1](msg)
