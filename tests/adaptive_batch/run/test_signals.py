import os
import signal
import subprocess
import sys

import pytest

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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop it recovers from
def test_a_stop_that_lands_in_a_weakref_callback_is_raised_between_the_probes_steps_or_at_the_end():
    """The probe's tensor counter frees its entries in weakref callbacks, where Python drops an
    exception: a SIGTERM during the probe was lost there, and the run trained to its end."""
    import weakref

    from adaptive_batch import faults
    from adaptive_batch.errors import RunStopped
    from adaptive_batch.run.signals import StopAtOnce

    class Holder:
        pass

    def signalled_in_a_callback():
        holder = Holder()
        # the handler runs inside the callback's loop, which is where its exception is dropped
        ref = weakref.ref(holder, lambda r: (os.kill(os.getpid(), signal.SIGTERM), [i for i in range(1000)]))
        del holder
        return ref

    for between_steps in (True, False):
        went_on = []
        with pytest.raises(RunStopped, match="SIGTERM during the probe: nothing was saved"):
            with StopAtOnce("the probe", "nothing was saved"):
                signalled_in_a_callback()
                went_on.append(True)
                if between_steps:
                    faults.stop_point()
                    went_on.append(False)
        assert went_on == [True]
    faults.stop_point()  # a block that ended asks for nothing more
