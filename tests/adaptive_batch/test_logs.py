"""The library's log: standard logging by default, a caller's log= where given (the sink of
``lines_to``), rank 0's lines only."""

import contextvars
import logging
import threading

import pytest
import torch

from adaptive_batch import logs
from adaptive_batch.logs import RankZeroFilter, lines_to
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


def _said():
    logs.info("decided")
    logs.warning("recovered")


def test_without_a_sink_lines_are_records_of_the_adaptive_batch_logger_naming_where_they_were_said(caplog):
    with caplog.at_level(logging.INFO, logger="adaptive_batch"):
        _said()
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("adaptive_batch", "INFO", "decided"), ("adaptive_batch", "WARNING", "recovered"),
    ]
    assert {(r.module, r.funcName) for r in caplog.records} == {("test_logs", "_said")}


def test_warnings_go_to_warn_else_log_else_the_loggers_warnings(caplog):
    infos, warns = [], []
    with lines_to(infos.append, warns.append):
        _said()
    assert (infos, warns) == (["decided"], ["recovered"])
    both = []
    with lines_to(both.append):
        _said()
    assert both == ["decided", "recovered"]
    warns = []
    with caplog.at_level(logging.INFO, logger="adaptive_batch"), lines_to(warn=warns.append):
        _said()
    assert warns == ["recovered"] and [(r.levelname, r.getMessage()) for r in caplog.records] == [("INFO", "decided")]


def test_an_inner_lines_to_without_callables_keeps_the_outer_sink_and_one_with_them_overrides_it_until_it_ends(caplog):
    outer, inner = [], []
    with caplog.at_level(logging.INFO, logger="adaptive_batch"):
        with lines_to(outer.append):
            with lines_to():  # a public entry point called without log= inside another
                logs.info("kept")
            with lines_to(inner.append):
                logs.info("overridden")
                logs.warning("overridden warning")
            logs.info("restored")
        logs.info("to the logger")
    assert outer == ["kept", "restored"] and inner == ["overridden", "overridden warning"]
    assert [r.getMessage() for r in caplog.records] == ["to the logger"]


def test_the_sink_is_reset_when_the_block_raises():
    lines = []
    with pytest.raises(RuntimeError), lines_to(lines.append):
        raise RuntimeError("inside")
    with lines_to(warn=lines.append):
        logs.info("not for the list")
    assert lines == []


def test_quiet_drops_every_line(caplog):
    lines = []
    with caplog.at_level(logging.INFO, logger="adaptive_batch"), lines_to(lines.append):
        with logs.quiet():
            _said()
        logs.info("after")
    assert lines == ["after"] and caplog.records == []


def test_a_thread_started_inside_lines_to_does_not_inherit_the_sink(caplog):
    lines = []
    with caplog.at_level(logging.INFO, logger="adaptive_batch"), lines_to(lines.append):
        thread = threading.Thread(target=logs.info, args=("from a thread",))
        thread.start()
        thread.join()
        copied = threading.Thread(target=contextvars.copy_context().run, args=(logs.info, "from a copied context"))
        copied.start()
        copied.join()
    assert [r.getMessage() for r in caplog.records] == ["from a thread"]
    assert lines == ["from a copied context"]


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
