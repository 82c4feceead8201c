import os

import pytest
import torch

from adaptive_batch import ConfigError, StepCheckpoints
from adaptive_batch.run.step_checkpoints import RANKS_KEY


def test_saves_atomically_keeps_the_last_k_and_finds_the_newest(tmp_path):
    lines = []
    ckpts = StepCheckpoints(str(tmp_path / "steps"), every_n_steps=2, keep_last=2, log=lines.append)
    assert ckpts.latest() is None and not ckpts.due(0) and not ckpts.due(3) and ckpts.due(4)
    for step in (2, 4, 6, 10):
        ckpts.save(step, {"w": torch.full((3,), float(step)), "step": step})
    assert [s for s, _ in ckpts.saved()] == [6, 10]  # numeric order, not text order
    step, path = ckpts.latest()
    assert step == 10 and StepCheckpoints.load(path)["w"].tolist() == [10.0] * 3
    assert lines[-1] == f"Step 10: checkpoint saved to {path}; removed step_4.pt."
    assert sorted(os.listdir(tmp_path / "steps")) == ["step_10.pt", "step_6.pt"]  # no temporaries


def test_a_failed_write_leaves_the_previous_checkpoints_and_no_partial_file(tmp_path):
    ckpts = StepCheckpoints(str(tmp_path), every_n_steps=1, keep_last=1)
    ckpts.save(1, {"w": torch.ones(2)})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ckpts.save(2, {"w": torch.ones(2), "bad": Unpicklable()})
    assert os.listdir(tmp_path) == ["step_1.pt"]


def test_temporaries_of_an_interrupted_write_are_removed(tmp_path):
    (tmp_path / ".step_4.pt.writing_abc").write_bytes(b"half")
    (tmp_path / "step_3.pt").write_bytes(b"kept")
    lines = []
    StepCheckpoints(str(tmp_path), log=lines.append).remove_partial_writes()
    assert os.listdir(tmp_path) == ["step_3.pt"] and lines[0].startswith("Removed step_4.pt, left half-written in")


@pytest.mark.parametrize("kwargs,message", [
    (dict(every_n_steps=0), "save_every_n_steps=0"),
    (dict(every_n_steps=2.5), "save_every_n_steps=2.5"),
    (dict(keep_last=0), "keep_last_n_checkpoints=0"),
])
def test_bad_settings_name_the_key(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        StepCheckpoints(str(tmp_path), **kwargs)




class Counter:
    """A stateful position object (as a dataloader or an LR scheduler is)."""

    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_the_checkpoint_decides_when_to_save_and_restores_what_it_was_handed(tmp_path):
    ckpts = StepCheckpoints(str(tmp_path), every_n_steps=3, log=lambda line: None)
    position = Counter()
    ckpts.attach(lambda: {"model": {"w": torch.ones(1) * position.n}}, {"data": position, "lr_scheduler": None})
    saved = []
    for step in range(1, 8):
        position.n = step
        saved.append(ckpts.after_step(step))
    assert [p is not None for p in saved] == [False, False, True, False, False, True, False]
    state = ckpts.resume_state(epoch_step=-1)
    assert state["model"]["w"].item() == 6 and state["data"] == {"n": 6} and "lr_scheduler" not in state
    ckpts.restore_position(state)
    assert position.n == 6
    assert ckpts.resume_state(epoch_step=7) is None  # the epoch checkpoint is newer
    # On the epoch checkpoint's own step, the epoch checkpoint wins: the step one would
    # re-enter the finished epoch.
    assert ckpts.resume_state(epoch_step=6) is None
    assert ckpts.resume_state(epoch_step=5)["data"] == {"n": 6}


def test_a_checkpoint_of_another_rank_count_or_an_older_version_is_refused_in_one_line(tmp_path):
    ckpts = StepCheckpoints(str(tmp_path), log=lambda line: None)
    ckpts.save(3, {RANKS_KEY: 2})
    with pytest.raises(ConfigError, match="written by 2 ranks and this run has 1; resume with --nproc_per_node 2, or start a new output_dir"):
        ckpts.resume_state(epoch_step=-1)
    ckpts.save(4, {"rng_state": []})  # written before the checkpoint recorded its ranks
    with pytest.raises(ConfigError, match="written by an older adaptive-batch; delete .* or start a new output_dir"):
        ckpts.resume_state(epoch_step=-1)


def test_a_position_the_checkpoint_lacks_is_refused(tmp_path):
    ckpts = StepCheckpoints(str(tmp_path), every_n_steps=1, log=lambda line: None)
    ckpts.attach(dict, {"lr_scheduler": Counter()})
    with pytest.raises(ConfigError, match="no 'lr_scheduler' state and this run has one"):
        ckpts.restore_position({RANKS_KEY: 1})


@pytest.mark.parametrize("damage", [b"", b"not a checkpoint", None], ids=["empty", "garbage", "truncated"])
def test_an_unreadable_newest_checkpoint_gives_way_to_the_one_before(tmp_path, damage):
    lines = []
    ckpts = StepCheckpoints(str(tmp_path), keep_last=3, log=lines.append)
    for step in (3, 4):
        ckpts.save(step, {RANKS_KEY: 1, "w": torch.full((64,), float(step))})
    newest = tmp_path / "step_4.pt"
    newest.write_bytes(newest.read_bytes()[:200] if damage is None else damage)
    state = ckpts.resume_state(epoch_step=-1)
    assert state["w"][0].item() == 3.0
    assert any("step_4.pt cannot be read" in line and "trying the one before it" in line for line in lines)
    (tmp_path / "step_3.pt").write_bytes(b"")
    assert ckpts.resume_state(epoch_step=-1) is None  # none readable: the epoch checkpoint, if any
