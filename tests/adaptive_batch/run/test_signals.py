import os
import signal
import subprocess
import sys

from adaptive_batch.run.signals import StopSignals


def test_the_first_signal_asks_to_stop_and_the_handlers_are_put_back():
    before = signal.getsignal(signal.SIGTERM)
    logged = []
    with StopSignals(log=logged.append) as signals:
        assert signals.stop_requested() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.stop_requested() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    assert logged == ["SIGTERM received: stopping after this step (send it again to stop at once)."]


def test_a_second_signal_ends_the_process_at_once():
    code = (
        "import os, signal; from adaptive_batch.run.signals import StopSignals\n"
        "with StopSignals(log=print):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('still running')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGINT and "still running" not in run.stdout
    assert "SIGINT received" in run.stdout


def test_a_signal_during_setup_stops_it_at_once_in_one_line_and_the_handlers_are_put_back():
    import pytest

    from adaptive_batch.errors import RunStopped
    from adaptive_batch.run.signals import StopAtOnce

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped, match=r"^SIGTERM during the probe: nothing was saved\.$") as stopped:
        with StopAtOnce("the probe", "nothing was saved"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**7):  # the probe's minutes of work: never finished
                pass
            raise AssertionError("the signal did not stop the work")
    assert stopped.value.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
