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

    for name in [".batch_probe.json.writing_x1", "batch_probe.json", LOCK_FILENAME, ".hidden_of_the_user"]:
        (tmp_path / name).write_text("x")
    logs = []
    remove_partial_writes(str(tmp_path), log=logs.append)
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILENAME, ".hidden_of_the_user", "batch_probe.json"]
    assert logs == [f"Removed batch_probe.json, left half-written in {tmp_path} by an interrupted run."]
