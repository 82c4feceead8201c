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
    from adaptive_batch.run.progress import BATCH_STATE_KEY
    from adaptive_batch.torchtune import epoch_checkpoint_step

    assert epoch_checkpoint_step(str(tmp_path)) == -1  # no epoch checkpoint yet
    state_dir = tmp_path / "recipe_state"
    state_dir.mkdir()
    torch.save({BATCH_STATE_KEY: {"global_step": 12}}, state_dir / "recipe_state.pt")
    assert epoch_checkpoint_step(str(tmp_path)) == 12
    whole = (state_dir / "recipe_state.pt").read_bytes()
    (state_dir / "recipe_state.pt").write_bytes(whole[: len(whole) // 2])  # a crash mid-write
    from adaptive_batch.torchtune import UnreadableEpochState

    with pytest.raises(UnreadableEpochState, match=r"recipe_state.pt cannot be read \(\w+Error: .*no step checkpoint is newer"):
        epoch_checkpoint_step(str(tmp_path))


def test_another_model_in_the_same_directory_gets_its_own_random_init(tmp_path):
    small = write_random_init_checkpoint(build, str(tmp_path), seed=7, model_config={"embed_dim": 4})
    wide = write_random_init_checkpoint(
        lambda: torch.nn.Linear(8, 8), str(tmp_path), seed=7, model_config={"embed_dim": 8}
    )
    assert small != wide
    assert torch.load(tmp_path / wide)["weight"].shape == (8, 8)


def _checkpointer(tmp_path, **kw):
    name = write_random_init_checkpoint(build, str(tmp_path / "init"), seed=7, model_config={})
    return FullModelTorchTuneCheckpointer(
        checkpoint_dir=str(tmp_path / "init"), checkpoint_files=[name], model_type="LLAMA3_2",
        output_dir=str(tmp_path / "out"), **kw,
    )


def _epoch_state(epochs_run):
    from torchtune.training import EPOCHS_KEY

    return {MODEL_KEY: {"weight": torch.full((4, 4), float(epochs_run))}, EPOCHS_KEY: epochs_run}


def test_an_epoch_checkpoint_appears_whole_and_a_failed_one_leaves_the_one_before(tmp_path, monkeypatch):
    from adaptive_batch.errors import CheckpointWriteError
    from adaptive_batch.torchtune import epoch_weight_files, save_epoch_checkpoint

    checkpointer = _checkpointer(tmp_path)
    out = tmp_path / "out"
    files = save_epoch_checkpoint(checkpointer, _epoch_state(1), epoch=0, intermediate_checkpoint=True)
    assert files == ["epoch_0/model-00001-of-00001.bin", "recipe_state/recipe_state.pt"]
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "recipe_state"]
    assert epoch_weight_files(str(out), None, ["random_init.pt"]) == ["epoch_0/model-00001-of-00001.bin"]

    def full_disk(obj, path, *args, **kwargs):
        open(path, "wb").write(b"cut")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"epoch_1 could not be written \(out of disk space"):
        save_epoch_checkpoint(checkpointer, _epoch_state(2), epoch=1, intermediate_checkpoint=True)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "recipe_state"]
    assert torch.load(out / "recipe_state" / "recipe_state.pt", weights_only=True)["epochs_run"] == 1
    assert str(checkpointer._output_dir) == str(out)  # pointed back after the failure


def test_the_next_start_finishes_a_completed_epoch_save_or_removes_an_unfinished_one(tmp_path, monkeypatch):
    from adaptive_batch.faults import ENV
    from adaptive_batch.torchtune import epoch_weight_files, recover_epoch_checkpoint, save_epoch_checkpoint
    from adaptive_batch.torchtune.checkpoint import STAGING_DIRNAME

    checkpointer = _checkpointer(tmp_path)
    out = tmp_path / "out"
    save_epoch_checkpoint(checkpointer, _epoch_state(1), epoch=0, intermediate_checkpoint=True)
    # Interrupted after epoch 1's weights were moved into place, before its recipe state.
    killed = []
    monkeypatch.setenv(ENV, "epoch_committing:1:SIGUSR1")
    monkeypatch.setattr("os.kill", lambda pid, sig: (killed.append(sig), _raise_kill()))
    with pytest.raises(KeyboardInterrupt):
        save_epoch_checkpoint(checkpointer, _epoch_state(2), epoch=1, intermediate_checkpoint=True)
    monkeypatch.undo()
    assert (out / "epoch_1").is_dir() and (out / STAGING_DIRNAME / "recipe_state").is_dir()
    logs = []
    recover_epoch_checkpoint(str(out), log=logs.append)
    assert "Finished saving the epoch checkpoint" in logs[0] and not (out / STAGING_DIRNAME).exists()
    assert epoch_weight_files(str(out), None, None) == ["epoch_1/model-00001-of-00001.bin"]
    # A staging directory never marked complete is removed; the checkpoints stay as they were.
    (out / STAGING_DIRNAME / "epoch_2").mkdir(parents=True)
    (out / STAGING_DIRNAME / "epoch_2" / "model-00001-of-00001.bin").write_bytes(b"cut")
    recover_epoch_checkpoint(str(out), log=logs.append)
    assert "Removed an epoch checkpoint an interrupted run left half-written" in logs[1]
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "epoch_1", "recipe_state"]


def _raise_kill():
    raise KeyboardInterrupt  # stands in for the process ending there


def test_checkpoint_files_of_another_epoch_than_the_recipe_state_are_refused(tmp_path):
    from adaptive_batch.torchtune import epoch_weight_files, save_epoch_checkpoint

    checkpointer = _checkpointer(tmp_path)
    for epoch in range(2):
        save_epoch_checkpoint(checkpointer, _epoch_state(epoch + 1), epoch=epoch, intermediate_checkpoint=True)
    with pytest.raises(ValueError, match=r"checkpoint_files=\['epoch_0/model-00001-of-00001.bin'\] are not the "
                                         r"weights of epoch_1"):
        epoch_weight_files(str(tmp_path / "out"), None, ["epoch_0/model-00001-of-00001.bin"])


def test_the_last_epochs_checkpoint_marks_the_run_finished_and_a_new_run_forgets_it(tmp_path):
    from adaptive_batch.errors import ConfigError
    from adaptive_batch.torchtune import finished_run, forget_finished_run, save_epoch_checkpoint

    checkpointer = _checkpointer(tmp_path)
    out = str(tmp_path / "out")
    save_epoch_checkpoint(checkpointer, _epoch_state(1), epoch=0, intermediate_checkpoint=True)
    assert finished_run(out, epochs=2) is None  # an intermediate epoch finishes nothing
    files = save_epoch_checkpoint(checkpointer, {MODEL_KEY: _epoch_state(2)[MODEL_KEY]}, epoch=1, intermediate_checkpoint=False)
    assert files[-1] == "run_finished.json"  # moved into place after the weights
    assert finished_run(out, epochs=2).startswith(f"The run in {out} finished its 2 epochs ({out}/epoch_1 holds")
    assert finished_run(out, epochs=1) is not None
    with pytest.raises(ConfigError, match=r"epochs=5: the run in .* finished at 2 epochs.*Set epochs=2"):
        finished_run(out, epochs=5)
    (tmp_path / "out" / "run_finished.json").write_text("{")
    with pytest.raises(ConfigError, match=r"run_finished.json cannot be read \(JSONDecodeError"):
        finished_run(out, epochs=2)
    forget_finished_run(out)
    assert finished_run(out, epochs=2) is None


class _ThreadRank:
    """One of two ranks as threads: ``decide_on_main`` runs on rank 0, and every rank leaves it
    together, as the broadcast of ``RankGroup.decide_on_main`` makes them."""

    def __init__(self, rank, barrier):
        self.is_main, self._barrier = rank == 0, barrier

    def decide_on_main(self, decide, errors=()):
        result = decide() if self.is_main else None
        self._barrier.wait(timeout=30)
        return result


def test_no_rank_writes_under_the_output_dir_before_the_main_rank_claimed_it(tmp_path):
    """Two ranks of one run: rank 1 writes the dataset file under output_dir while rank 0 removes
    what an interrupted run left half-written there. Rank 0 took rank 1's temporary for such a
    leftover and removed it mid-write (a two-rank fixture failed with FileNotFoundError on its
    rename); every rank now waits for the claim before its own writes."""
    import threading

    from adaptive_batch.files import atomic_write
    from adaptive_batch.run.step_checkpoints import StepCheckpoints
    from adaptive_batch.torchtune import claim_output_dir

    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    (out / "data" / ".left.jsonl.writing_x").write_text("half")  # an interrupted run's
    barrier, claimed, errors = threading.Barrier(2), threading.Event(), []

    def rank(index):
        try:
            claim_output_dir(str(out), str(out), StepCheckpoints(str(out / "step_checkpoints")),
                             _ThreadRank(index, barrier), log=lambda line: None)
            if index == 0:
                claimed.set()
                return

            def write(f):  # the main rank's claim, were it still running, would happen now
                claimed.wait(timeout=30)
                f.write("rows\n")

            atomic_write(str(out / "data" / "rows.jsonl"), write, text=True)
        except BaseException as e:  # noqa: BLE001 - the thread's failure is the test's
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(i,)) for i in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(os.listdir(out / "data")) == ["rows.jsonl"]  # the leftover gone, rank 1's file whole
