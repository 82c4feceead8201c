"""Hard-limit trials in fresh child processes, so a crash or a scarred heap stays there.

Under a hard CPU limit (an outside ``RLIMIT_AS``) a trial that fails to allocate cannot be undone
in-process: glibc moves the thread to another arena for good, and oneDNN can segfault, which
nothing catches. A conv net probed in its own process answered 44 where a fresh process trains
59, after 8 out-of-memory trials. So, as NeMo's OOMptimizer does, each trial here is a child
process, forked from a clean server process (a fork of the caller would hang in GNU OpenMP's
pool), that builds the training parts from the
caller's picklable ``build()``, holds itself to the parent's headroom of address space, and runs
the consecutive steps training will run. Its answer is the address space the steps added (the
limit's own unit), or an out-of-memory failure, a crash included. The parent's model, optimizer
and heap are never touched.
"""

from contextlib import contextmanager
from dataclasses import dataclass
import multiprocessing
from multiprocessing import forkserver
from multiprocessing import process as mp_process
from multiprocessing import util as mp_util
import os
import resource
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, Optional, Tuple

import torch

import adaptive_batch.logs as logs
from adaptive_batch.memory.device import glibc_mmap_threshold_set, proc_status_bytes, return_freed_memory_to_os
from adaptive_batch.memory.oom import first_line, is_oom_error
from adaptive_batch.probe.target import ProbeTarget  # what build() returns; importable from here as before


class ChildOutOfMemoryError(MemoryError):
    """A child trial ran out of memory, or died (a segfault counts: it is what a failed
    allocation in some native paths does). A ``MemoryError``, so the one out-of-memory predicate
    (:func:`~adaptive_batch.memory.oom.is_oom_error`) knows it."""


class TrialProcessNotStartedError(RuntimeError):
    """A trial process ended before its trial ran: the caller's main module, which every trial
    process imports, could not be imported there (an unguarded script runs itself again)."""


class TrialBuildError(RuntimeError):
    """``build()`` raised in a trial process, before any step: what the caller trains could not
    be made again there (the error's traceback is in the message)."""


@dataclass(frozen=True)
class _ParentProcess:
    """What makes a child's steps cost what the caller's own would: its threads and allocator."""

    threads: int
    mmap_threshold: Optional[int]  # glibc's, when the caller set the recipes' allocator

    @classmethod
    def here(cls) -> "_ParentProcess":
        return cls(threads=torch.get_num_threads(), mmap_threshold=glibc_mmap_threshold_set())

    def apply(self) -> None:
        torch.set_num_threads(self.threads)
        if self.mmap_threshold is not None:
            return_freed_memory_to_os(self.mmap_threshold)


@dataclass(frozen=True)
class TrainingSteps:
    """A child's job: training's first ``steps`` consecutive steps at ``batch_size``, each batch
    made under the limit as the caller's loop makes it. Its answer: the address space they added."""

    batch_size: int
    steps: int

    def __call__(self, target: ProbeTarget, start: int, build_peak: int) -> int:
        for _ in range(self.steps):
            target.train_step(target.make_batch(self.batch_size))
        peak = proc_status_bytes("VmPeak")
        # A peak no higher than the build's says nothing of the steps: what is mapped now does.
        return (peak if peak > build_peak else proc_status_bytes("VmSize")) - start


def _child_main(
    build: Callable[[], ProbeTarget], job: Callable[[ProbeTarget, int, int], Any], headroom_bytes: int,
    parent: _ParentProcess, conn: Any,
) -> None:
    """The child: take the parent's threads and allocator, build, hold to the headroom, run the
    ``job`` (it has the ``batch_size`` it runs up to), send its answer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        conn.send(("started", None))  # the main module imported: from here a death is the trial's
        parent.apply()
        try:
            target = build()
        except Exception as exc:  # noqa: BLE001 - said to the parent as what it is: no trial ran
            if is_oom_error(exc):  # the model does not fit beside nothing: batch 1 does not either
                raise
            conn.send(("build_error", traceback.format_exc()))
            return
        start, build_peak = proc_status_bytes("VmSize"), proc_status_bytes("VmPeak")
        limit = start + headroom_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        conn.send(("ok", job(target, start, build_peak)))
    except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the parent
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # reporting the failure allocates
        # The search runs batch 1 first, so above it a smaller batch of the same step has run.
        kind = "oom" if is_oom_error(exc, after_a_smaller_step=job.batch_size > 1) else "error"
        conn.send((kind, first_line(exc) if kind == "oom" else traceback.format_exc()))
    finally:
        conn.close()


def _receive(conn: Any, timeout_s: Optional[float]) -> Tuple[bool, Optional[Tuple[str, Any]], bool]:
    """Whether the child started its trial, its outcome (``None``: it died), and whether it
    gave no answer within ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    started = False
    while True:
        if not conn.poll(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return started, None, True
        try:
            message = conn.recv()
        except EOFError:
            return started, None, False
        if message[0] != "started":
            return True, message, False
        started = True


def child_trial(
    build: Callable[[], ProbeTarget], *, headroom_bytes: int, steps: int, timeout_s: Optional[float] = None
) -> Callable[[int], int]:
    """A search trial that runs in a fresh process per batch size.

    Args:
        build: a picklable function (defined at a module's top level) returning the
            :class:`ProbeTarget`; it runs in each child. Its ``preload`` attribute, when it has
            one, names modules to import once in the server the children are forked from.
        headroom_bytes: the address space each child may add after building, the parent's own.
        steps: consecutive steps a child runs (training's first steps, where a heap settles).
        timeout_s: seconds a child may take to answer; past them it is a hang, stopped (``None``:
            no limit).

    Returns:
        ``run(batch_size) -> bytes``: the address space the steps added. The child runs with
        this process's thread count and glibc settings, as of the call to ``run``.

    Raises:
        ChildOutOfMemoryError: (from ``run``) when the child ran out of memory or died.
        RuntimeError: (from ``run``) any other error of the child, with its traceback; a child
            that gave no answer in ``timeout_s``.
        TrialProcessNotStartedError: (from ``run``) a child that exited before its trial ran (an
            unguarded script re-run as the main module).
        TrialBuildError: (from ``run``) ``build()`` raised in the child.
    """
    return lambda batch_size: run_in_child(build, TrainingSteps(batch_size, steps), headroom_bytes=headroom_bytes,
                                           timeout_s=timeout_s)


@contextmanager
def trial_processes() -> Iterator[None]:
    """Stops the fork server the block's trial processes started, when the block ends: left to
    multiprocessing, it lived as long as the caller, holding 220-300 MiB of its own beside the
    training that followed (torch and the build's modules imported). A server that was running
    before the block is the caller's, and stays (one another thread starts during the block is
    taken for the trials')."""
    server = forkserver._forkserver
    running_before = getattr(server, "_forkserver_pid", None) is not None
    try:
        yield
    finally:
        if not running_before:
            _stop_fork_server(server)


def _stop_fork_server(server: Any) -> None:
    """Ends ``server`` (multiprocessing's fork server) and forgets it, so the next trial starts a
    new one. SIGTERM first: the server stops at the end of its pipe from this process, which a
    process forked from here meanwhile would hold open, and ``_stop`` (what multiprocessing's own
    tests call) then waits for it and removes its socket. Where that wait fails (the server reaped
    elsewhere), the server is forgotten all the same."""
    pid = getattr(server, "_forkserver_pid", None)
    stop = getattr(server, "_stop", None)
    if pid is None or stop is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # gone already: _stop reaps it and removes its socket
    try:
        stop()
    except OSError as e:  # reaped elsewhere (SIGCHLD ignored), its socket removed
        _forget(server)
        logs.LOGGER.debug(f"probe: the trials' fork server (pid {pid}) ended; its cleanup failed: {e}")


def _forget(server: Any) -> None:
    """What ``_stop`` does after its wait, where the wait failed: without it the next trial's
    start asked after the old server's pid and failed."""
    with server._lock:
        for close, name in ((os.close, "_forkserver_alive_fd"), (os.unlink, "_forkserver_address")):
            value = getattr(server, name, None)
            if isinstance(value, (int, str)):
                try:
                    close(value)
                except OSError:
                    pass  # closed or removed already
            setattr(server, name, None)
        server._forkserver_pid = None


def run_in_child(
    build: Callable[[], ProbeTarget], job: Callable[[ProbeTarget, int, int], Any], *, headroom_bytes: int,
    timeout_s: Optional[float] = None,
) -> Any:
    """Runs ``job(target, start, build_peak)`` on ``build()``'s target in a fresh process held to
    ``headroom_bytes`` of address space past its build, and returns its answer (picklable). The
    job has the ``batch_size`` it runs up to (its lines name it; an out-of-memory error above
    batch 1 follows a smaller step). The rest as :func:`child_trial`, which runs
    :class:`TrainingSteps`.
    """
    context = multiprocessing.get_context("forkserver")
    # The server imports torch once and has run no parallel region, so its forks start clean
    # (a fork of a process whose OpenMP pool ran hangs) and a trial costs its build, not an import:
    # torch's optimizers import its compiler when the first is built (0.75 s a trial on CPU).
    # A build may name more (a recipe's torchtune): the first trial's list holds for the server's life.
    context.set_forkserver_preload(["torch", "torch._dynamo", __name__, *getattr(build, "preload", ())])
    keep_socket_paths_short()
    parent, child = context.Pipe(duplex=False)
    process = context.Process(
        target=_child_main, args=(build, job, headroom_bytes, _ParentProcess.here(), child), daemon=True
    )
    process.start()
    child.close()
    started, outcome, timed_out = False, None, False
    try:
        started, outcome, timed_out = _receive(parent, timeout_s)
    finally:  # also when the wait is interrupted: no child outlives its trial
        if process.is_alive() and outcome is None:
            process.kill()
        process.join()
        parent.close()
    return _answer(job.batch_size, started, outcome, timed_out, timeout_s, process.exitcode)


# The longest path an AF_UNIX socket takes (sun_path, 108 bytes with its terminating zero).
AF_UNIX_PATH_MAX = 107
_LISTENER = "/listener-xxxxxxxx"  # the fork server's socket in multiprocessing's folder


def keep_socket_paths_short(base: str = "/tmp") -> None:
    """Puts multiprocessing's folder, where the fork server's socket goes, under ``base`` when
    the one under ``TMPDIR`` would make the socket's path too long to bind ("AF_UNIX path too
    long": a cluster job's scratch TMPDIR, a test's deep temporary folder). Python 3.11's
    multiprocessing does not; a folder made here is removed at exit, as its own is."""
    config = getattr(mp_process.current_process(), "_config", None)  # where multiprocessing keeps its folder
    if not isinstance(config, dict):  # another Python's multiprocessing: left as it is
        return
    current = config.get("tempdir") or os.path.join(tempfile.gettempdir(), "pymp-xxxxxxxx")
    if len(os.fsencode(current + _LISTENER)) <= AF_UNIX_PATH_MAX or not os.access(base, os.W_OK):
        return
    short = tempfile.mkdtemp(prefix="pymp-", dir=base)
    mp_util.Finalize(None, shutil.rmtree, args=[short, True], exitpriority=-100)
    config["tempdir"] = short


def _answer(
    batch_size: int, started: bool, outcome: Optional[tuple], timed_out: bool, timeout_s: Optional[float],
    exitcode: Optional[int],
) -> Any:
    """What a trial process said, as :func:`child_trial`'s ``run`` returns or raises it."""
    if timed_out:
        raise RuntimeError(
            f"the trial process at batch {batch_size} gave no answer in {timeout_s:g} s and was stopped: a step "
            "that hangs (a deadlock, a collective with no peer) in build's target; run it once at that batch by hand."
        )
    if not started:  # it ended while importing the main module, as an unguarded script does
        raise TrialProcessNotStartedError(
            f"the trial process at batch {batch_size} exited with code {exitcode} before its trial ran "
            "(its traceback is above). Trial processes import the main module, as multiprocessing does: in a "
            "script, call find_max_batch_size(build=...) under `if __name__ == \"__main__\":`."
        )
    if outcome is None:  # a segfault, an abort, exit(1) from a thread that could not start, the OOM killer
        raise ChildOutOfMemoryError(f"the trial process at batch {batch_size} died (exit code {exitcode})")
    kind, value = outcome
    if kind == "ok":
        return value
    if kind == "oom":
        raise ChildOutOfMemoryError(value)
    if kind == "build_error":
        raise TrialBuildError(f"the trial process at batch {batch_size} could not build what it trains:\n{value}")
    raise RuntimeError(f"the trial process at batch {batch_size} failed:\n{value}")
