import errno
import os
import subprocess
import sys

import pytest

from adaptive_batch.errors import CheckpointWriteError
from adaptive_batch.files import LOCK_FILENAME, OutputDirLock, atomic_write


def test_a_write_is_whole_under_its_name_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "report.json"
    assert atomic_write(str(path), lambda f: f.write("{}\n"), text=True) == str(path)
    assert path.read_text() == "{}\n" and os.listdir(path.parent) == ["report.json"]


def test_a_full_disk_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "step_4.pt"
    path.write_bytes(b"old")

    def fill(f):
        f.write(b"half of it")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(CheckpointWriteError, match=r"step_4.pt could not be written \(out of disk space, .* free there\)"):
        atomic_write(str(path), fill)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["step_4.pt"]


FULL_TMPFS = """
import os, sys, torch
from adaptive_batch.errors import CheckpointWriteError
from adaptive_batch.files import atomic_write
os.system("mount -t tmpfs -o size=1m tmpfs " + sys.argv[1])
path = os.path.join(sys.argv[1], "step_1.pt")
open(path, "wb").write(b"old")
try:
    atomic_write(path, lambda f: torch.save({"w": torch.zeros(2**20)}, f))  # 4 MiB on a 1 MiB disk
except CheckpointWriteError as e:
    print(e)
print(sorted(os.listdir(sys.argv[1])), open(path, "rb").read())
"""


def test_torchs_own_words_for_a_full_disk_are_recognised_on_a_real_one(tmp_path):
    # torch's writer says "unexpected pos 704 vs 598" for a short write; the errno of a small
    # write of our own says what it was. A real tmpfs of 1 MiB, mounted in a user namespace.
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("user namespaces (unshare -rm) are off here: no unprivileged tmpfs to fill")
    run = subprocess.run(["unshare", "-rm", sys.executable, "-c", FULL_TMPFS, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"{tmp_path}/step_1.pt could not be written (out of disk space, "), run.stdout
    assert lines[1] == "['step_1.pt'] b'old'"  # the old file, and no temporary or probe left


def test_an_error_of_the_writer_itself_is_not_called_a_disk_error(tmp_path):
    with pytest.raises(TypeError):
        atomic_write(str(tmp_path / "x"), lambda f: f.write("text into a binary file"))
    assert os.listdir(tmp_path) == []


def test_a_held_output_dir_is_refused_naming_the_holder_and_free_again_after_release(tmp_path):
    first = OutputDirLock(str(tmp_path)).acquire()
    with pytest.raises(ValueError, match=rf"output_dir={tmp_path} is in use by a live run \(pid {os.getpid()} on "):
        OutputDirLock(str(tmp_path)).acquire()
    first.release()
    first.release()  # twice is harmless
    OutputDirLock(str(tmp_path)).acquire().release()


def test_a_killed_holder_leaves_nothing_to_clean_up(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from adaptive_batch.files import OutputDirLock; "
         f"lock = OutputDirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(ValueError, match=f"pid {holder.pid} on "):
        OutputDirLock(str(tmp_path)).acquire()
    holder.kill()
    holder.wait()
    assert (tmp_path / LOCK_FILENAME).exists()  # the file stays; the kernel dropped the lock
    OutputDirLock(str(tmp_path)).acquire().release()


def test_the_temporaries_a_kill_left_are_removed_and_nothing_else(tmp_path):
    from adaptive_batch.files import remove_partial_writes

    (tmp_path / "init").mkdir()
    for name in [".batch_probe.json.writing_x1", "batch_probe.json", LOCK_FILENAME, ".hidden_of_the_user",
                 "init/.random_init_seed1.pt.writing_y2", "init/random_init_seed0.pt"]:
        (tmp_path / name).write_text("x")
    logs = []
    remove_partial_writes(str(tmp_path), log=logs.append)
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILENAME, ".hidden_of_the_user", "batch_probe.json", "init"]
    assert os.listdir(tmp_path / "init") == ["random_init_seed0.pt"]  # in a folder below too (a kill in the init's write)
    assert logs == [f"Removed batch_probe.json, left half-written in {tmp_path} by an interrupted run.",
                    f"Removed random_init_seed1.pt, left half-written in {tmp_path}/init by an interrupted run."]
