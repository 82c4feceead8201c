import signal

import pytest

from adaptive_batch import faults
from adaptive_batch.errors import ConfigError


def test_parse_names_the_point_the_count_and_the_signal():
    assert faults.parse_fault("after_step") == ("after_step", 1, signal.SIGKILL)
    assert faults.parse_fault("inside_step:3:SIGTERM") == ("inside_step", 3, signal.SIGTERM)


@pytest.mark.parametrize(
    "value, message",
    [
        ("after_stp", "no fault point 'after_stp'; use one of probe_trial, inside_step"),
        ("after_step:0", "'0' is not a positive count"),
        ("after_step:2:SIGFOO", "'SIGFOO' is not a signal"),
    ],
)
def test_a_bad_fault_is_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        faults.parse_fault(value)


def test_the_signal_arrives_the_nth_time_the_point_is_reached(monkeypatch):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        monkeypatch.setenv(faults.ENV, "after_step:3:SIGUSR1")
        faults.reset()
        for _ in range(2):
            faults.fault_point("after_step")
            faults.fault_point("after_epoch")  # another point does not count
        assert received == []
        faults.fault_point("after_step")
        assert received == [signal.SIGUSR1]
        faults.fault_point("after_step")
        assert received == [signal.SIGUSR1]  # once
    finally:
        signal.signal(signal.SIGUSR1, previous)
        faults.reset()


def test_a_misspelt_point_is_an_error_where_it_would_be_reached(monkeypatch):
    monkeypatch.setenv(faults.ENV, "after_stp")
    with pytest.raises(ConfigError, match="no fault point 'after_stp'"):
        faults.fault_point("after_step")
