"""Hard-limit trials in fresh child processes: a crash or an allocation failure there is a trial
that did not fit, and the caller's process goes on untouched."""

from multiprocessing import forkserver
import os

import pytest
import torch

from adaptive_batch import find_max_batch_size
from adaptive_batch.probe.child import ChildOutOfMemoryError, TrialBuildError, _stop_fork_server, child_trial
from adaptive_batch.probe.target import ProbeTarget
from tests.adaptive_batch.probe import crashing_step


def test_a_crash_in_a_trial_is_a_failed_trial_and_the_caller_lives(limited_address_space, monkeypatch):
    """A conv net's probe died of a segfault and of oneDNN's "could not create a primitive" in
    the caller's own process; in children (under an address-space limit, each process's own)
    both are trials that did not fit."""
    from adaptive_batch.memory import device

    monkeypatch.setattr(device, "_mmap_threshold_set", None)  # glibc's defaults, whatever ran here before
    _stop_fork_server(forkserver._forkserver)  # none left by an earlier test: the probe starts its own
    target = crashing_step.build()
    before = [p.detach().clone() for p in target.model.parameters()]
    lines, sizes_here = [], []

    def step_here(batch):
        sizes_here.append(batch.shape[0])
        target.train_step(batch)

    with limited_address_space(2 * 2**30):
        found = find_max_batch_size(step_here, make_batch=target.make_batch, model=target.model,
                                    optimizer=target.optimizer, max_memory=None, max_batch_size=16, log=lines.append,
                                    build=crashing_step.build)
    assert found == crashing_step.PRIMITIVE_ABOVE
    assert any("in a fresh process" in line for line in lines)
    # the caller trains on the answer: on the allocator its children were measured with, said once
    assert sum(line.startswith("CPU allocator: glibc M_MMAP_THRESHOLD") for line in lines) == 1
    assert device.glibc_mmap_threshold_set() is not None
    assert any("out of memory" in line for line in lines if line.startswith("probe trial"))
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters()))  # put back after the check
    # the first guess's steps ran in a fresh process too: here only the answer's check (two guess
    # steps here once left a Trainer's heap 11 MiB larger than a fresh process's)
    assert set(sizes_here) == {found}, sizes_here
    # the trials' fork server ended with them: it held 220-300 MiB of its own through training
    assert forkserver._forkserver._forkserver_pid is None


def test_a_fork_server_running_before_the_trials_stays_and_theirs_ends_though_a_fork_holds_its_pipe(monkeypatch):
    """The server ends at the end of its pipe from the caller, which a process forked from the
    caller holds open too: stopping it once waited for that process. With SIGCHLD ignored the
    kernel reaps the server and the stop's wait fails: its pid, left behind, failed every later
    trial's start."""
    import subprocess
    import time

    from adaptive_batch.probe.child import trial_processes

    server = forkserver._forkserver
    run = child_trial(crashing_step.build, headroom_bytes=2**30, steps=1)
    run(1)  # the caller's own use of the server, before the probe
    pid = server._forkserver_pid
    try:
        with trial_processes():
            run(1)
        assert server._forkserver_pid == pid
        os.kill(pid, 0)  # alive
    finally:
        _stop_fork_server(server)
    holder = None
    try:
        with trial_processes():
            run(1)
            pid = server._forkserver_pid
            # what a process forked from the caller holds: the server's pipe among its descriptors
            holder = subprocess.Popen(["sleep", "60"], pass_fds=[server._forkserver_alive_fd])
            start = time.monotonic()
        assert time.monotonic() - start < 10 and server._forkserver_pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        _stop_fork_server(server)
    with monkeypatch.context() as patch:
        patch.setattr(os, "waitpid", lambda pid, options: (_ for _ in ()).throw(ChildProcessError(10, "No child")))
        with trial_processes():
            run(1)
            pid = server._forkserver_pid
    assert (server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address) == (None, None, None)
    os.waitpid(pid, 0)  # the test's own reap of the server its stop killed
    try:
        run(1)  # the next trial starts a server of its own
        assert server._forkserver_pid not in (None, pid)
    finally:
        _stop_fork_server(server)

def test_without_an_address_space_limit_build_runs_the_trials_here_and_says_so(monkeypatch):
    """Under a cgroup or the machine's RAM, limits every process shares, a child's copy of the
    model would take from the caller's room: the trials stay in the caller's process."""
    from adaptive_batch.memory import device

    monkeypatch.setattr(device, "address_space_limit", lambda: None)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    lines = []
    found = find_max_batch_size(step, make_batch=lambda b: torch.randn(b, 8), model=model, optimizer=optimizer,
                                max_memory=None, max_batch_size=8, log=lines.append, build=crashing_step.build)
    assert found == 8
    assert any("build= is not used: fresh processes are for an address-space limit (RLIMIT_AS)" in line for line in lines)
    assert not any("in a fresh process" in line for line in lines)


def test_a_childs_other_errors_come_back_with_its_traceback_a_failed_build_as_its_own_error():
    with pytest.raises(TrialBuildError, match="could not build what it trains:\nTraceback(.|\n)*the build itself is wrong"):
        child_trial(_wrong_build, headroom_bytes=2**30, steps=1)(1)
    with pytest.raises(RuntimeError, match="failed:\nTraceback(.|\n)*the step itself is wrong") as raised:
        child_trial(_build_with_a_wrong_step, headroom_bytes=2**30, steps=1)(1)
    assert not isinstance(raised.value, TrialBuildError)


def _wrong_build():
    raise ValueError("the build itself is wrong")


def _wrong_step(batch):
    raise ValueError("the step itself is wrong")


def _build_with_a_wrong_step():
    return ProbeTarget(_wrong_step, torch.zeros, torch.nn.Linear(1, 1))


def test_a_python_memory_error_without_a_message_is_named():
    from adaptive_batch.memory.oom import catch_oom

    def fail():
        raise MemoryError()

    assert catch_oom(fail) == (None, "MemoryError")


def test_a_dead_child_is_out_of_memory():
    run = child_trial(crashing_step.build, headroom_bytes=2**30, steps=1)
    with pytest.raises(ChildOutOfMemoryError, match="died"):
        run(crashing_step.SEGFAULT_ABOVE + 1)
    with pytest.raises(ChildOutOfMemoryError, match="could not create a primitive"):
        run(crashing_step.PRIMITIVE_ABOVE + 1)
    assert run(crashing_step.PRIMITIVE_ABOVE) >= 0  # a tiny step adds next to nothing to what the build mapped


def test_a_child_that_hangs_is_stopped_after_its_time_with_one_line():
    import time

    run = child_trial(crashing_step.build_hanging, headroom_bytes=2**30, steps=1, timeout_s=3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^the trial process at batch 2 gave no answer in 3 s and was stopped"):
        run(2)
    assert time.monotonic() - start < 30


@pytest.fixture
def torch_threads():
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


def test_a_child_trains_with_the_callers_threads_and_allocator(torch_threads, monkeypatch):
    """A child started from the fork server had torch's default threads and glibc's defaults,
    whatever the caller trains with; its steps cost what another process's would. It starts
    with torch's compiler imported, which an optimizer's construction imports: 0.75 s of each
    trial went there."""
    from adaptive_batch.memory import device

    monkeypatch.setattr(device, "_mmap_threshold_set", None)  # glibc's defaults, whatever ran here before
    torch_threads(3)
    run = child_trial(crashing_step.build_telling_its_process, headroom_bytes=2**30, steps=1)
    with pytest.raises(RuntimeError, match="threads=3 mmap_threshold=None compiler_imported=True"):
        run(1)
    monkeypatch.setattr(device, "_mmap_threshold_set", 128 * 1024)  # as return_freed_memory_to_os leaves it
    with pytest.raises(RuntimeError, match="threads=3 mmap_threshold=131072 compiler_imported=True"):
        run(1)


UNGUARDED_SCRIPT = """
import resource
from adaptive_batch import find_max_batch_size
from adaptive_batch.memory.device import proc_status_bytes
from tests.adaptive_batch.probe import crashing_step

target = crashing_step.build()
resource.setrlimit(resource.RLIMIT_AS, (proc_status_bytes("VmSize") + 2**31, resource.RLIM_INFINITY))
find_max_batch_size(target.train_step, make_batch=target.make_batch, model=target.model, max_memory=None,
                    optimizer=target.optimizer, max_batch_size=8, build=crashing_step.build)
"""


@pytest.mark.slow
def test_an_unguarded_script_is_told_to_guard_itself_not_that_batch_1_does_not_fit(tmp_path):
    """Each trial process re-ran the user's script as the main module, failed before its trial,
    and was counted out of memory: "batch size 1 does not fit" for a model that fits."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "script.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = dict(__import__("os").environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "does not fit" not in run.stderr
    assert run.stderr.rstrip().splitlines()[-1].endswith('under `if __name__ == "__main__":`.')


DEEP_TMPDIR_SCRIPT = """
import os, sys
from adaptive_batch.probe.child import child_trial
from tests.adaptive_batch.probe import crashing_step

if __name__ == "__main__":
    assert len(os.environ["TMPDIR"]) > 107  # AF_UNIX's longest path
    print("RESULT", child_trial(crashing_step.build, headroom_bytes=2**31, steps=1)(1) >= 0)
"""


@pytest.mark.slow
def test_a_trial_process_starts_under_a_tmpdir_too_deep_for_a_socket(tmp_path):
    """The fork server's socket goes under TMPDIR; past 107 bytes it cannot bind ("AF_UNIX path
    too long"), which failed a recipe's whole probe under a deep pytest TMPDIR."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    script = tmp_path / "script.py"
    script.write_text(DEEP_TMPDIR_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), TMPDIR=str(deep))
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "RESULT True" in run.stdout, run.stderr[-2000:]
