"""Kills and stops at every named fault point, across step-checkpoint settings, growth modes
and signals: the resumed run trains exactly the steps the uninterrupted run trains.

A SIGKILL is what the disk holds at the fault point: the run here is in-process (its
``finally`` blocks would still run after a real exception), so the output folder is copied at
the point, the run abandoned, and the copy (in another folder: a moved run) resumed. A SIGTERM
is real: the run's own handler stops it. The cases are chosen so that every point, checkpoint
setting, growth mode and signal appears, and most pairs of them.
"""

import os
from pathlib import Path
import shutil
import signal

import pytest

from adaptive_batch.faults import ENV
from tests.recipes.conftest import FIXED, SMALL_MODEL, only_whole_files, read_metric_log, run_tune

KEYS = ["step", "batch_size", "micro_batch_size", "samples_seen", "tokens_seen", "lr", "loss"]
# rows of 64 tokens on a 2-layer model 64 wide: the steps are what is checked, not their size
SHORT = ["tokenizer.max_seq_len=64", *SMALL_MODEL]
COSINE = [
    "lr_scheduler._component_=torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "lr_scheduler.num_warmup_steps=1",
]
# Each mode trains 2 epochs; "epoch_end" checkpoints on the last step of epoch 0.
MODES = {
    # growth by epoch: 3 steps of 4 samples, then 2 of 8 (the last one short)
    "epoch": [*SHORT, "epochs=2", "max_steps_per_epoch=3", "max_batch_size=8", "lr_scaling=linear"],
    # the same, with the probe bounding the growth: it finds 8 or more, and leaves the model,
    # optimizer, RNG and data as they were, so the run trains what "epoch" trains
    "probe": [*SHORT, "epochs=2", "max_steps_per_epoch=3", "max_batch_size=8", "lr_scaling=linear",
              "use_maximum_batch_size=True"],
    # the batch doubles every 2 steps, up to 8, under a cosine LR schedule counted in samples, with
    # attention dropout: a resumed run draws its masks where the uninterrupted one did
    "steps": [*SHORT, "epochs=2", "max_steps_per_epoch=3", "max_batch_size=8", "batch_increase_interval=2 steps",
              *COSINE, "model.attn_dropout=0.3"],
    # token budgets of 256 padded tokens, shortest first, under a cosine LR schedule in steps
    "tokens": [*SHORT, "epochs=2", "max_steps_per_epoch=3", FIXED, "max_tokens=256", "sequence_picking_order=seqlen",
               *COSINE],
}
CHECKPOINTS = {"every": "save_every_n_steps=1", "epoch_end": "save_every_n_steps=3", "off": "save_every_n_steps=null"}
KILL, TERM = "SIGKILL", "SIGTERM"
CASES = [
    ("probe_trial:2", KILL, "probe", "every"),
    ("probe_trial:1", TERM, "probe", "off"),
    ("inside_step:2", KILL, "steps", "epoch_end"),
    ("inside_step:2", TERM, "tokens", "every"),
    ("after_step:4", KILL, "epoch", "epoch_end"),  # after the first step of epoch 1
    ("after_step:2", TERM, "steps", "off"),
    ("file_written:2", KILL, "tokens", "every"),
    ("step_checkpoint_written:2", KILL, "tokens", "epoch_end"),
    ("step_checkpoint_written:1", TERM, "epoch", "every"),
    ("epoch_staged:1", KILL, "steps", "every"),
    ("epoch_staged:1", TERM, "tokens", "off"),
    ("epoch_committing:1", KILL, "epoch", "off"),
    ("after_epoch:1", KILL, "tokens", "off"),
    ("after_epoch:1", TERM, "steps", "epoch_end"),
    ("after_step:1", KILL, "steps", "every"),
    ("after_step:5", KILL, "tokens", "epoch_end"),
    ("inside_step:5", KILL, "epoch", "every"),
    ("epoch_committing:1", TERM, "tokens", "every"),
    ("after_epoch:1", KILL, "epoch", "every"),
    ("after_step:5", TERM, "steps", "epoch_end"),  # the run's last step: stopped before epoch 1 is saved
    ("file_written:1", TERM, "probe", "epoch_end"),
]


class _Killed(BaseException):
    """The process ending at a SIGKILL: nothing after it counts."""


@pytest.fixture(scope="module")
def wholes(tmp_path_factory):
    """Each mode's uninterrupted run (its output_dir and metric log), on demand."""
    done = {}

    def whole(mode):
        if mode not in done:
            out = tmp_path_factory.mktemp(f"whole_{mode}")
            run = run_tune(out, *MODES[mode], "resume_from_checkpoint=auto")
            assert run.returncode == 0, run.stderr[-3000:]
            done[mode] = out, read_metric_log(out)
        return done[mode]

    return whole


def _killed_at(tmp_path, monkeypatch, args, fault):
    """The run killed at ``fault``: the copy of its output folder at that moment."""
    out, copy = tmp_path / "run", tmp_path / "moved"

    def kill(pid, sig):
        assert sig == signal.SIGKILL
        shutil.copytree(out, copy, symlinks=True)
        raise _Killed

    with monkeypatch.context() as patch:
        patch.setattr(os, "kill", kill)
        with pytest.raises(_Killed):
            run_tune(out, *args, env={ENV: f"{fault}:SIGKILL"})
    return copy


@pytest.mark.parametrize("fault, sig, mode, checkpoints", CASES, ids=["-".join(c) for c in CASES])
def test_a_run_killed_or_stopped_anywhere_resumes_to_the_uninterrupted_runs_steps(
    tmp_path, monkeypatch, wholes, fault, sig, mode, checkpoints
):
    _, whole = wholes("epoch" if mode == "probe" else mode)
    args = [*MODES[mode], CHECKPOINTS[checkpoints]]
    if sig == KILL:
        out = _killed_at(tmp_path, monkeypatch, args, fault)
    else:
        out = tmp_path / "run"
        stopped = run_tune(out, *args, env={ENV: f"{fault}:SIGTERM"})
        assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
        assert "stopped: SIGTERM" in stopped.stderr and "Traceback" not in stopped.stderr
    resumed = run_tune(out, *args, "resume_from_checkpoint=auto", f"metric_logger.log_dir={out}/logs_resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = read_metric_log(out, "logs_resumed")
    before = read_metric_log(out) if list(Path(out, "logs").glob("log_*.txt")) else []
    # The steps before the first resumed one are the interrupted run's (none when it was
    # stopped after its last step: the resume only saves the last epoch).
    first = int(got[0]["step"]) if got else len(before) + 1
    trained = before[:first - 1] + got
    for key in KEYS:
        assert [r[key] for r in trained] == [r[key] for r in whole], key
    assert (out / "run_finished.json").exists()
    only_whole_files(out)


@pytest.mark.parametrize("mode", ["steps"])
def test_a_finished_run_resumed_anywhere_trains_and_writes_nothing(tmp_path, wholes, mode):
    out, _ = wholes(mode)
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    again = run_tune(moved, *MODES[mode], "resume_from_checkpoint=auto")
    assert again.returncode == 0 and "nothing to train or save" in again.stderr, again.stderr[-3000:]
    assert not (moved / "logs_again").exists() and sorted(p.name for p in moved.iterdir()) == sorted(
        p.name for p in out.iterdir()
    )
