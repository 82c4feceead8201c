import os

import pytest
import torch
from torchtune.training import MODEL_KEY, FullModelTorchTuneCheckpointer

from adaptive_batch.torchtune import write_random_init_checkpoint


def build():
    return torch.nn.Linear(4, 4)


def test_seeded_init_is_reproducible_and_loads_through_torchtune(tmp_path):
    rng = torch.get_rng_state()
    name = write_random_init_checkpoint(build, str(tmp_path / "a"), seed=7, model_config={})
    assert torch.equal(torch.get_rng_state(), rng)
    other = write_random_init_checkpoint(build, str(tmp_path / "b"), seed=7, model_config={})
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
    a = write_random_init_checkpoint(build, str(tmp_path), seed=1, model_config={})
    b = write_random_init_checkpoint(build, str(tmp_path), seed=2, model_config={})
    assert not torch.equal(torch.load(tmp_path / a)["weight"], torch.load(tmp_path / b)["weight"])
    with pytest.raises(ValueError, match="seed=None"):
        write_random_init_checkpoint(build, str(tmp_path), seed=None, model_config={})


def test_epoch_checkpoint_step_reads_the_recipe_state_and_survives_a_cut_file(tmp_path):
    from adaptive_batch.data.samplers import BATCH_STATE_KEY
    from adaptive_batch.torchtune import epoch_checkpoint_step

    assert epoch_checkpoint_step(str(tmp_path)) == -1  # no epoch checkpoint yet
    state_dir = tmp_path / "recipe_state"
    state_dir.mkdir()
    torch.save({BATCH_STATE_KEY: {"global_step": 12}}, state_dir / "recipe_state.pt")
    assert epoch_checkpoint_step(str(tmp_path)) == 12
    whole = (state_dir / "recipe_state.pt").read_bytes()
    (state_dir / "recipe_state.pt").write_bytes(whole[: len(whole) // 2])  # a crash mid-write
    warnings = []
    assert epoch_checkpoint_step(str(tmp_path), warn=warnings.append) == -1
    assert "cannot be read" in warnings[0]
