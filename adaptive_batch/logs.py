"""The library's log: standard ``logging`` under the ``adaptive_batch`` logger, rank 0's lines only.

A decision (the probe's answer, growth, a resume) is an INFO record and a recovery (an
out-of-memory retry, a setting taken over) a WARNING, on ``logging.getLogger("adaptive_batch")``.
It adds no handler: the application decides what is shown (``logging.basicConfig(level=
logging.INFO)`` shows the decisions); where it configured nothing, Python's last-resort handler
still prints the warnings to stderr (a ``NullHandler`` here would hide them). Every line goes
through this one logger, so :class:`RankZeroFilter` keeps data-parallel ranks from repeating rank
0's INFO lines; every rank's warnings pass, each named by its rank. Where a caller passes ``log=``
(any callable taking a line, ``print`` or a recipe's logger), that callable takes the lines instead.
"""

import logging
import os
from typing import Callable, Optional

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


def info_to(log: Optional[Log]) -> Log:
    """Where decisions go: ``log`` where a caller passed one, else the library logger's INFO."""
    return log if log is not None else LOGGER.info


def warning_to(warn: Optional[Log], log: Optional[Log] = None) -> Log:
    """Where recoveries go: ``warn``, else the caller's ``log``, else the library logger's WARNING."""
    if warn is not None:
        return warn
    return log if log is not None else LOGGER.warning
