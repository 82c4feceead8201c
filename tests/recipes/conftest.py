import contextlib
import io
import logging
import os
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from adaptive_batch import faults

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/full_finetune_single_device.py"
CONFIG = "configs/tiny/full_single_device.yaml"
TUNE = str(Path(sys.executable).with_name("tune"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# The tiny config grows the batch each epoch; tests of a fixed batch turn that off.
FIXED = "batch_increase_function=null"
# The tiny config's Llama at 2 layers and width 64: for what does not depend on the model's size
# (which steps train, what a resume restores), 16 times fewer FLOPs and checkpoint bytes.
SMALL_MODEL = ["model.num_layers=2", "model.embed_dim=64", "model.intermediate_dim=128"]


def launch_command(recipe, config, output_dir, overrides, nproc=None, via_tune=False) -> List[str]:
    """`tune run` of ``recipe``; on several ranks, unless ``via_tune``, torchrun's launch of it as
    `tune run --nproc_per_node` makes it (standalone, the recipe as a module), without the 4 s of
    CPU the launcher spends importing torchtune."""
    recipe_args = ["--config", config, f"output_dir={output_dir}", *overrides]
    if nproc is None or via_tune:
        launch = [] if nproc is None else ["--nproc_per_node", str(nproc)]
        return [TUNE, "run", *launch, recipe, *recipe_args]
    module = str(Path(recipe).with_suffix("")).replace(os.sep, ".")
    return [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), "-m", module, *recipe_args]


def tune_env(extra_path=None, env=None) -> Dict[str, str]:
    merged = dict(os.environ, **(env or {}))
    # The repo root first, so this `recipes` package wins over the one torchtune installs.
    paths = [str(REPO)] + ([str(extra_path)] if extra_path else [])
    merged["PYTHONPATH"] = os.pathsep.join(paths + ([merged["PYTHONPATH"]] if merged.get("PYTHONPATH") else []))
    return merged


# torch 2.13's gloo transport once killed a rank by SIGSEGV mid-run, in its `pt_gloo_runloop` thread
# inside libc's allocator (dmesg; 1 suite run in about 20, no code of ours on that thread). A launch
# that starts afresh (no resume) and loses a rank that way is run once more from an empty
# output_dir, and the test's output says so; any other failure, a second segfault, or one in a
# launch that resumes (whose output_dir is the test's state) fails the test.
RANK_SEGFAULT = "exitcode  : -11"


def _rank_segfaulted(output: str, overrides) -> bool:
    return RANK_SEGFAULT in output and not any(str(o).startswith("resume_from_checkpoint=") for o in overrides)


def _empty(output_dir) -> None:
    import shutil

    for path in Path(output_dir).iterdir():
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    print(f"a rank died by SIGSEGV in gloo's transport; run once more from an empty {output_dir}", file=sys.stderr)


def run_tune(
    output_dir,
    *overrides,
    headroom_bytes=None,
    timeout=600,
    recipe=RECIPE,
    config=CONFIG,
    extra_path=None,
    env=None,
    nproc=None,
    own_process=False,
    via_tune=False,
) -> subprocess.CompletedProcess:
    """`tune run` of a recipe on a tiny config.

    In this process, as torchtune's own recipe tests run it, unless the run needs a process of
    its own: a real address-space limit (``headroom_bytes``) or several ranks (``nproc``
    processes through torchrun, launched as :func:`launch_command` says), or ``own_process`` (a
    kill). ``extra_path`` goes on the path (a user's own modules); ``env`` adds variables. Either
    way the answer is the process's exit code and output.
    """
    cmd = launch_command(recipe, config, output_dir, overrides, nproc=nproc, via_tune=via_tune)
    if headroom_bytes is None and nproc is None and not own_process:
        return run_tune_in_process(cmd[1:], extra_path=extra_path, env=env)
    if headroom_bytes is not None:  # one process: the limit is this one's
        assert nproc is None, "a real address-space limit is set on one process"
        cmd = [sys.executable, str(REPO / "tests/recipes/limited_run.py"), str(headroom_bytes), *cmd[1:]]

    def launch() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=REPO, env=tune_env(extra_path, env), capture_output=True, text=True,
                              timeout=timeout)

    proc = launch()
    if nproc is not None and proc.returncode != 0 and _rank_segfaulted(proc.stderr + proc.stdout, overrides):
        _empty(output_dir)
        proc = launch()
    return proc


def run_tune_in_process(args: List[str], extra_path=None, env=None) -> subprocess.CompletedProcess:
    """torchtune's CLI in this process: the same path as `tune run` without its start-up."""
    from torchtune._cli.tune import main

    return run_in_process(main, ["tune", *args], extra_path=extra_path, env=env)


def run_in_process(main, argv: List[str], extra_path=None, env=None) -> subprocess.CompletedProcess:
    """``main()`` with ``sys.argv = argv`` in this process, from the repository root, answered
    as a process would answer: exit code, stdout, stderr.

    The process state the run may change (argv, path, environment, working directory, the
    user's modules) is put back afterwards.
    """
    saved_argv, saved_path, saved_env, saved_cwd = list(sys.argv), list(sys.path), dict(os.environ), os.getcwd()
    sys.argv = list(argv)
    if extra_path is not None:
        sys.path.insert(0, str(extra_path))
    os.environ.update(env or {})
    os.chdir(REPO)
    faults.reset()  # a fault point counts from the start of each run, as in a process of its own
    try:
        with _captured_output() as (out, err):
            try:
                code = _exit_code(main(), err)
            except SystemExit as e:
                code = _exit_code(e.code, err)
            except Exception:  # what a process would print before exiting with 1
                traceback.print_exc(file=err)
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        if extra_path is not None:
            _forget_modules_under(Path(extra_path))
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def _exit_code(code, err: io.StringIO) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=err)  # SystemExit("error: ...") prints its message and exits with 1
    return 1


@contextlib.contextmanager
def _captured_output() -> Iterator[Tuple[io.StringIO, io.StringIO]]:
    """stdout and stderr, including logging handlers that kept a stream from earlier."""
    out, err = io.StringIO(), io.StringIO()
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    handlers = [
        h for lg in loggers for h in lg.handlers
        if type(h) is logging.StreamHandler
    ]
    streams = [(h, h.stream) for h in handlers]
    for h, _ in streams:
        h.setStream(err)
    # Under pytest torchtune's logger gets no handler of its own (the root has pytest's), so
    # its records reach only the root: show them there, as a process's stderr would.
    root_handler = None if logging.getLogger("torchtune.utils._logging").handlers else logging.StreamHandler(err)
    if root_handler is not None:
        logging.getLogger().addHandler(root_handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        for h, stream in streams:
            h.setStream(stream)
        if root_handler is not None:
            logging.getLogger().removeHandler(root_handler)


def _forget_modules_under(path: Path) -> None:
    """Drops the user's modules imported from ``path``, so another test's copy is imported."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(path.resolve()):
            del sys.modules[name]


def only_whole_files(out) -> None:
    """Asserts that ``out`` holds nothing half-written under a final name, and no temporary or
    staging folder."""
    import torch

    leftovers = [p for p in Path(out).rglob(".*") if p.name != ".adaptive_batch.lock"]
    assert not leftovers, leftovers
    for path in list(Path(out).glob("epoch_*/*.bin")) + list(Path(out).glob("**/*.pt")):
        torch.load(path, weights_only=True)


def read_metric_log(output_dir, logs="logs") -> List[Dict[str, float]]:
    """The `Step N | key:value ...` lines torchtune's DiskLogger writes, one dict a step."""
    (log_file,) = list(Path(output_dir, logs).glob("log_*.txt"))
    rows = []
    for line in log_file.read_text().splitlines():
        m = re.match(r"Step (\d+) \| (.*)", line)
        if m:
            row = {"step": int(m.group(1))}
            row.update({k: float(v) for k, v in (kv.split(":") for kv in m.group(2).split())})
            rows.append(row)
    return rows


@pytest.fixture
def tune():
    return run_tune


@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    """The user's own module, outside the repository."""
    where = tmp_path_factory.mktemp("user_code")
    (where / "my_growth.py").write_text(
        textwrap.dedent(
            """
            import os

            def table(epoch, current_batch_size):
                return {1: 2, 2: 4}.get(epoch, 0)

            def add_three_first(epoch, current_batch_size):
                return 3 if epoch == 0 else 0

            def double_after_first(k, current_batch_size):
                return current_batch_size if k > 0 else 0

            def double_or_stop(epoch, current_batch_size):
                if str(epoch) == os.environ.get("STOP_AT_EPOCH"):
                    raise RuntimeError("preempted")
                return current_batch_size if epoch > 0 else 0
            """
        )
    )
    return where


def run_tune_until_killed(output_dir, *overrides, after, nproc=None, extra_path=None, timeout=300, **kw):
    """Starts `tune run` in a process of its own and kills it (SIGKILL, the whole process group,
    as a preemption would) as soon as the file ``after`` exists."""
    import signal
    import time

    cmd = launch_command(kw.get("recipe", RECIPE), kw.get("config", CONFIG), output_dir, overrides, nproc=nproc)

    def start() -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=REPO, env=tune_env(extra_path), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    proc, retried = start(), False
    deadline = time.monotonic() + timeout
    while not Path(after).exists():
        if proc.poll() is not None:
            output = proc.stdout.read()
            if nproc is not None and not retried and _rank_segfaulted(output, overrides):
                _empty(output_dir)
                proc, retried = start(), True
                continue
            raise AssertionError(f"the run ended before {after} was written:\n{output[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{after} was not written in {timeout} s")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc
