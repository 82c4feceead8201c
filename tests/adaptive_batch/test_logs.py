"""The library's log: standard logging by default, a caller's log= where given, rank 0's lines only."""

import logging

import pytest
import torch

from adaptive_batch.logs import LOGGER, RankZeroFilter, info_to, warning_to
from adaptive_batch.run.options import AdaptiveBatchOptions
from adaptive_batch.run.session import BatchSession, StepRecord


def _session(tmp_path, **kwargs):
    return BatchSession(AdaptiveBatchOptions(), batch_size=4, device=torch.device("cpu"), output_dir=str(tmp_path), **kwargs)


def test_without_log_decisions_and_recoveries_are_records_of_the_adaptive_batch_logger(tmp_path, caplog):
    session = _session(tmp_path)
    session.settle(dataset_size=16)
    with caplog.at_level(logging.INFO, logger="adaptive_batch"):
        session.record_step(StepRecord(4, 4, 40, micro_batch_limit=2, oom_retries=1, micro_batch_sizes=(2, 2)))
    assert [(r.name, r.levelname) for r in caplog.records] == [("adaptive_batch", "WARNING")]
    assert "recovered from out of memory" in caplog.records[0].getMessage()


def test_a_callers_log_takes_the_lines_instead(tmp_path, caplog):
    lines = []
    session = _session(tmp_path, log=lines.append)
    session.settle(dataset_size=16)
    with caplog.at_level(logging.INFO, logger="adaptive_batch"):
        session.record_step(StepRecord(4, 4, 40, micro_batch_limit=2, oom_retries=1, micro_batch_sizes=(2, 2)))
    assert caplog.records == [] and any("recovered from out of memory" in line for line in lines)
    assert info_to(print) is print and info_to(None) == LOGGER.info
    assert warning_to(None, print) is print and warning_to(None) == LOGGER.warning


@pytest.mark.parametrize("rank, level, passes, prefixed", [
    ("0", logging.INFO, True, False),
    ("1", logging.INFO, False, False),  # rank 0 says it
    ("1", logging.WARNING, True, True),  # every rank's trouble, named
])
def test_other_ranks_keep_their_warnings_and_leave_the_decisions_to_rank_zero(monkeypatch, rank, level, passes, prefixed):
    monkeypatch.setenv("RANK", rank)
    record = logging.LogRecord("adaptive_batch", level, __file__, 1, "a line", None, None)
    assert RankZeroFilter().filter(record) is passes
    assert record.getMessage().startswith(f"[rank {rank}] ") is prefixed


def test_unconfigured_the_warnings_reach_stderr_and_the_decisions_wait_for_basic_config():
    # A NullHandler on the library's logger hid every recovery where the application set up nothing.
    import subprocess
    import sys

    code = "from adaptive_batch.logs import LOGGER; LOGGER.warning('recovered'); LOGGER.info('decided')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "recovered" in run.stderr and "decided" not in run.stderr + run.stdout
