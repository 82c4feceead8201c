import os

import pytest
import torch

from adaptive_batch import ConfigError, StepCheckpoints


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
    (tmp_path / ".step_writing_abc.pt").write_bytes(b"half")
    (tmp_path / "step_3.pt").write_bytes(b"kept")
    lines = []
    StepCheckpoints(str(tmp_path), log=lines.append).remove_partial_writes()
    assert os.listdir(tmp_path) == ["step_3.pt"] and "half-written" in lines[0]


@pytest.mark.parametrize("kwargs,message", [
    (dict(every_n_steps=0), "save_every_n_steps=0"),
    (dict(every_n_steps=2.5), "save_every_n_steps=2.5"),
    (dict(keep_last=0), "keep_last_n_checkpoints=0"),
])
def test_bad_settings_name_the_key(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        StepCheckpoints(str(tmp_path), **kwargs)


