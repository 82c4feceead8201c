import os

import pytest
import torch
from torchtune.training import FullModelTorchTuneCheckpointer, MODEL_KEY

from adaptive_batch.torchtune import write_random_init_checkpoint


def build():
    return torch.nn.Linear(4, 4)


def test_seeded_init_is_reproducible_and_loads_through_torchtune(tmp_path):
    rng = torch.get_rng_state()
    name = write_random_init_checkpoint(build, str(tmp_path / "a"), seed=7)
    assert torch.equal(torch.get_rng_state(), rng)
    other = write_random_init_checkpoint(build, str(tmp_path / "b"), seed=7)
    a = torch.load(tmp_path / "a" / name)
    b = torch.load(tmp_path / "b" / other)
    assert torch.equal(a["weight"], b["weight"])
    ckpt = FullModelTorchTuneCheckpointer(
        checkpoint_dir=str(tmp_path / "a"), checkpoint_files=[name], model_type="LLAMA3_2",
        output_dir=str(tmp_path / "out"),
    )
    assert torch.equal(ckpt.load_checkpoint()[MODEL_KEY]["weight"], a["weight"])
    assert not [f for f in os.listdir(tmp_path / "a") if f.startswith(".")]


def test_seeds_differ_and_bad_seed(tmp_path):
    a = write_random_init_checkpoint(build, str(tmp_path), seed=1)
    b = write_random_init_checkpoint(build, str(tmp_path), seed=2)
    assert not torch.equal(torch.load(tmp_path / a)["weight"], torch.load(tmp_path / b)["weight"])
    with pytest.raises(ValueError, match="seed=None"):
        write_random_init_checkpoint(build, str(tmp_path), seed=None)
