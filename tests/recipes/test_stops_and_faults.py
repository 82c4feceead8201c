"""A run that stops (a signal, a full disk, a kill inside an epoch save) keeps only whole
files and resumes to the uninterrupted run's steps; a second run on a busy output_dir is
refused."""

import errno
import os
from pathlib import Path
import re
import shutil

import pytest
import torch

from adaptive_batch.faults import ENV
from adaptive_batch.files import OutputDirLock
from tests.recipes.conftest import SMALL_MODEL, only_whole_files, read_metric_log, run_tune

# Epoch 0: 4 steps of 4 samples; epoch 1: 2 steps of 8 (the batch doubles); step checkpoints
# after steps 3 and 6.
COMMON = [*SMALL_MODEL, "epochs=2", "max_steps_per_epoch=4", "max_batch_size=8", "save_every_n_steps=3"]
KEYS = ["step", "batch_size", "micro_batch_size", "samples_seen", "tokens_seen", "lr", "loss"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """The uninterrupted run, started with resume_from_checkpoint=auto on an empty output_dir:
    its output_dir and its metric log."""
    out = tmp_path_factory.mktemp("whole")
    run = run_tune(out, *COMMON, "resume_from_checkpoint=auto")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resume_from_checkpoint=auto: nothing saved yet; starting the run." in run.stderr
    assert f"Epoch 0 checkpoint in place in {out}: epoch_0/model-00001-of-00001.bin, recipe_state/recipe_state.pt." in run.stderr
    return out, read_metric_log(out)


@pytest.fixture(scope="module")
def whole(whole_run):
    return whole_run[1]


def _resume_equals_whole(out, whole, first_step):
    resumed = run_tune(out, *COMMON, "resume_from_checkpoint=auto", f"metric_logger.log_dir={out}/logs_resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume_from_checkpoint=auto: resuming." in resumed.stderr
    got = read_metric_log(out, "logs_resumed")
    assert got[0]["step"] == first_step and got[-1]["step"] == whole[-1]["step"]
    for key in KEYS:
        assert [r[key] for r in got] == [r[key] for r in whole[first_step - 1:]], key
    return resumed


def test_sigterm_stops_after_the_step_saves_it_and_auto_resumes_exactly(tmp_path, whole):
    stopped = run_tune(tmp_path, *COMMON, env={ENV: "after_step:2:SIGTERM"})
    assert stopped.returncode == 128 + 15, stopped.stderr[-3000:]
    saved = tmp_path / "step_checkpoints" / "step_2.pt"
    assert (f"stopped: SIGTERM after step 2: saved {saved}; resume with the same command and "
            "resume_from_checkpoint=True (or auto).") in stopped.stderr
    assert "SIGTERM received: stopping after this step" in stopped.stderr
    assert [r["step"] for r in read_metric_log(tmp_path)] == [1, 2]
    only_whole_files(tmp_path)
    _resume_equals_whole(tmp_path, whole, first_step=3)


TORCH_SAVE = torch.save
TORCH_DISK_FULL = "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: file write failed"


def _full_disk_at(match, nth):
    """torch.save that fills the disk the ``nth`` time it writes a file whose name contains
    ``match``: part of the bytes, then the error torch or Python raises."""
    seen = []

    def save(obj, f, *args, **kwargs):
        name = str(f) if isinstance(f, (str, Path)) else os.readlink(f"/proc/self/fd/{f.fileno()}")
        if match in name:
            seen.append(name)
            if len(seen) == nth:
                if isinstance(f, (str, Path)):  # torch's C++ writer, as torchtune calls it
                    Path(f).write_bytes(b"PK\x03\x04 cut")
                    raise RuntimeError(TORCH_DISK_FULL)
                f.write(b"PK\x03\x04 cut")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return TORCH_SAVE(obj, f, *args, **kwargs)

    return save


@pytest.mark.parametrize(
    "where, match, nth, kept, first_step",
    [
        ("the epoch checkpoint", "epoch_0", 1, ["step_checkpoints/step_3.pt"], 4),
        ("a step checkpoint", "step_checkpoints/.step_", 2, ["epoch_0", "step_checkpoints/step_3.pt"], 5),
    ],
)
def test_a_full_disk_keeps_the_whole_checkpoints_says_so_and_resumes_exactly(
    tmp_path, whole, monkeypatch, where, match, nth, kept, first_step
):
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", _full_disk_at(match, nth))
        failed = run_tune(tmp_path, *COMMON)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    (line,) = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert re.search(r"could not be written \(out of disk space, [\d.]+ \w+ free there\); nothing was written", line)
    assert line.endswith(f"Kept: {', '.join(str(tmp_path / k) for k in kept)}; free space and resume with "
                         "resume_from_checkpoint=True."), line
    only_whole_files(tmp_path)
    assert not (tmp_path / "epoch_0").exists() or "epoch_0" in kept
    _resume_equals_whole(tmp_path, whole, first_step=first_step)


@pytest.mark.slow
def test_killed_while_moving_an_epoch_checkpoint_into_place_resumes_exactly(tmp_path, whole):
    # SIGKILL with epoch 0's weights in place and its recipe state not yet: the next start
    # finishes the move, so the weights and the recipe state are of the same epoch.
    killed = run_tune(tmp_path, *COMMON, "save_every_n_steps=null", env={ENV: "epoch_committing"}, own_process=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (tmp_path / "epoch_0").is_dir() and (tmp_path / ".epoch_checkpoint_writing" / "COMPLETE").exists()
    resumed = _resume_equals_whole(tmp_path, whole, first_step=5)
    assert "Finished saving the epoch checkpoint an interrupted run had written" in resumed.stderr
    assert "Resuming from the epoch checkpoint: weights ['epoch_0/model-00001-of-00001.bin']" in resumed.stderr


def test_an_output_dir_in_use_is_refused_naming_the_process(tmp_path):
    lock = OutputDirLock(str(tmp_path)).acquire()
    try:
        refused = run_tune(tmp_path, *COMMON)
    finally:
        lock.release()
    assert refused.returncode == 1 and "Model is initialized" not in refused.stderr
    assert (f"error: output_dir={tmp_path} is in use by a live run (pid {os.getpid()} on ") in refused.stderr
    assert "wait for it to end, or give this run another output_dir." in refused.stderr


def _files(out):
    """Every file under ``out`` (the lock aside) with its size and modification time."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in Path(out).rglob("*") if p.is_file() and p.name != ".adaptive_batch.lock"
    }


def test_a_finished_run_resumed_trains_nothing_and_rewrites_nothing(whole_run):
    out, _ = whole_run
    before = _files(out)
    again = run_tune(out, *COMMON, "resume_from_checkpoint=auto", f"metric_logger.log_dir={out}/logs_again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"The run in {out} finished its 2 epochs ({out}/epoch_1 holds its final weights): nothing to train "
            "or save.") in again.stderr
    assert "Model is initialized" not in again.stderr and _files(out) == before
    # More epochs than it finished cannot go on from a final checkpoint: one line, nothing written.
    more = run_tune(out, *COMMON, "epochs=3", "resume_from_checkpoint=True")
    assert more.returncode == 1 and "Traceback" not in more.stderr, more.stderr[-3000:]
    assert f"error: epochs=3: the run in {out} finished at 2 epochs" in more.stderr and _files(out) == before


# A step checkpoint on an epoch's last step, killed in the next epoch: test_kill_sweep.py (after_step:4).


def test_sigterm_during_the_probe_stops_at_once_in_one_line(tmp_path):
    stopped = run_tune(tmp_path, *COMMON, "use_maximum_batch_size=True", env={ENV: "probe_trial:1:SIGTERM"})
    assert stopped.returncode == 128 + 15 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert ("stopped: SIGTERM during setup (the batch-size probe included): nothing was trained or saved; run the "
            "same command again.") in stopped.stderr
    assert not (tmp_path / "batch_probe.json").exists() and not (tmp_path / "epoch_0").exists()
    only_whole_files(tmp_path)


def test_a_run_moved_to_another_folder_resumes_and_one_with_other_data_there_is_refused(tmp_path, whole):
    stopped = run_tune(tmp_path / "first", *COMMON, env={ENV: "after_step:2:SIGTERM"})
    assert stopped.returncode == 128 + 15, stopped.stderr[-3000:]
    shutil.copytree(tmp_path / "first", tmp_path / "changed")
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "first", moved)
    _resume_equals_whole(moved, whole, first_step=3)  # data_dir=${output_dir}/data moved with it
    (data,) = (tmp_path / "changed" / "data").glob("*.jsonl")
    data.write_text(data.read_text().replace("a", "b"))  # regenerated data of the same size
    refused = run_tune(tmp_path / "changed", *COMMON, "resume_from_checkpoint=True")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "error: resume_from_checkpoint=True: dataset was " in refused.stderr
    assert "it changes what is trained: put it back to resume, or start a new output_dir." in refused.stderr


def test_an_unreadable_epoch_state_with_no_newer_step_checkpoint_is_refused_not_started_afresh(tmp_path):
    args = [*COMMON, "save_every_n_steps=null"]
    stopped = run_tune(tmp_path, *args, env={ENV: "after_epoch:1:SIGTERM"})
    assert stopped.returncode == 128 + 15, stopped.stderr[-3000:]
    (tmp_path / "recipe_state" / "recipe_state.pt").write_bytes(b"cut short")
    before = _files(tmp_path)
    resumed = run_tune(tmp_path, *args, "resume_from_checkpoint=auto")
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert (f"error: resume_from_checkpoint: the epoch recipe state {tmp_path}/recipe_state/recipe_state.pt cannot be "
            "read (") in resumed.stderr
    assert "Model is initialized" not in resumed.stderr and _files(tmp_path) == before  # epoch_0 kept as it was
