"""The run state: the controller's state, the run's shape and a fingerprint, as one object."""

import random

import pytest
import torch

from adaptive_batch import (
    AdaptiveBatchController,
    AdaptiveBatchOptions,
    ConfigError,
    RunState,
)
from adaptive_batch.probe.report import ProbeReport
from adaptive_batch.run.state import RUN_STATE_KEY, fingerprint

CPU = torch.device("cpu")


def run_state(tmp_path, **settings):
    controller = AdaptiveBatchController(AdaptiveBatchOptions(), batch_size=4, input_key="tokens", device=CPU, output_dir=str(tmp_path),
                                         max_seq_len=32, log=lambda line: None)
    controller.settle(dataset_size=100)
    return RunState(controller.session, settings={"batch_size": 4, "model": {"num_layers": 2}, **settings})


def test_the_state_holds_the_batch_state_the_shape_and_the_fingerprint(tmp_path):
    state = run_state(tmp_path).state_dict()
    recorded = state[RUN_STATE_KEY]
    assert recorded["world_size"] == 1 and recorded["dataset_size"] == 100 and recorded["seq_len"] == 32
    assert recorded["fingerprint"] == {"batch_size": "4", "model": '{"num_layers": 2}'}
    assert "adaptive_batch_state" in state


def test_a_resumed_run_knows_which_trained_settings_changed(tmp_path):
    saved = run_state(tmp_path).state_dict()
    same = run_state(tmp_path)
    same.load_state_dict(saved)
    assert same.changed_settings() == []
    other = run_state(tmp_path, batch_size=8, max_tokens=1024)
    other.load_state_dict(saved)
    assert other.changed_settings() == ["batch_size", "max_tokens"]
    unrecorded = run_state(tmp_path)
    unrecorded.load_state_dict({k: v for k, v in saved.items() if k != RUN_STATE_KEY})
    assert unrecorded.changed_settings() == []  # an older checkpoint recorded none


def test_a_setting_newer_than_the_checkpoint_counts_as_changed_only_off_its_default(tmp_path):
    # A checkpoint written before noise_scale_estimator existed trained as its default does.
    saved = run_state(tmp_path).state_dict()
    for unset_or_default in (None, "micro_batches"):
        resumed = run_state(tmp_path, noise_scale_estimator=unset_or_default)
        resumed.load_state_dict(saved)
        assert resumed.changed_settings() == []
    other = run_state(tmp_path, noise_scale_estimator="norm_layers")
    other.load_state_dict(saved)
    assert other.changed_settings() == ["noise_scale_estimator"]


def test_a_growth_function_bound_to_other_values_is_a_changed_setting(tmp_path):
    """linear_ramp(8) resumed as linear_ramp(56) was taken: both had one name."""
    from adaptive_batch import linear_ramp
    from adaptive_batch.schedule.growth import function_name

    def settings(fn):
        return AdaptiveBatchOptions.from_flat({"batch_increase_function": fn}).trained_values()

    saved = run_state(tmp_path, **settings(linear_ramp(8))).state_dict()
    other = run_state(tmp_path, **settings(linear_ramp(56)))
    other.load_state_dict(saved)
    assert other.changed_settings() == ["batch_increase_function"]
    same = run_state(tmp_path, **settings(linear_ramp(8)))
    same.load_state_dict(saved)
    assert same.changed_settings() == []
    older = run_state(tmp_path, batch_increase_function=function_name(linear_ramp(8))).state_dict()
    resumed = run_state(tmp_path, **settings(linear_ramp(8)))
    resumed.load_state_dict(older)  # a checkpoint that recorded the name alone
    assert resumed.changed_settings() == []


def test_fingerprints_are_canonical():
    assert fingerprint({"b": {"y": 1, "x": [1, 2]}, "a": None}) == {"a": "null", "b": '{"x": [1, 2], "y": 1}'}


def test_every_ranks_generators_round_trip(tmp_path):
    state = run_state(tmp_path)
    torch.manual_seed(5)
    random.seed(5)
    saved = state.rng.state_dict()
    expected = (torch.rand(3), random.random())
    torch.manual_seed(6)
    random.seed(6)
    state.rng.load_state_dict(saved)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_a_resume_that_would_train_something_else_is_refused_in_one_line(tmp_path):
    saved = run_state(tmp_path, max_memory="512MiB").state_dict()
    same = run_state(tmp_path, max_memory="512MiB")
    same.load_state_dict(saved)
    same.check_resume()
    other = run_state(tmp_path, max_memory="256MiB", max_tokens=1024)
    other.load_state_dict(saved)
    with pytest.raises(ConfigError, match=(
        r'max_memory was "512MiB" in the run that wrote the checkpoint and is "256MiB" now \(and max_tokens\); '
        r"it changes what is trained: put it back to resume, or start a new output_dir"
    )):
        other.check_resume()
    ranks = run_state(tmp_path, max_memory="512MiB")
    ranks.load_state_dict({**saved, RUN_STATE_KEY: {**saved[RUN_STATE_KEY], "world_size": 2}})
    with pytest.raises(ConfigError, match="written by 2 ranks and this run has 1; resume with --nproc_per_node 2, or start a new output_dir"):
        ranks.check_resume()
    older = run_state(tmp_path, max_memory="256MiB")
    older.load_state_dict({k: v for k, v in saved.items() if k != RUN_STATE_KEY})
    older.check_resume()  # recorded nothing to compare with


def _global_batch_run(tmp_path, max_memory, found, **settings):
    options = AdaptiveBatchOptions.from_flat(
        {"use_maximum_batch_size": True, "global_batch_size": 12, "max_memory": max_memory}
    )
    controller = AdaptiveBatchController(options, batch_size=4, input_key="tokens", device=CPU, output_dir=str(tmp_path),
                                         max_seq_len=32, log=lambda line: None)
    probes = []

    def probe(options, **kwargs):
        probes.append(options.max_memory)
        return ProbeReport(max_batch_size=found, batch_size=found, budget_bytes=2**30)

    state = RunState(controller.session, settings={"global_batch_size": 12, "max_memory": max_memory, **settings})
    return controller, state, probe, probes


def test_a_changed_budget_with_a_global_batch_probes_the_micro_batch_again(tmp_path):
    first, state, probe, _ = _global_batch_run(tmp_path, "256MiB", found=6)
    first.settle(dataset_size=100, probe=probe)
    assert first.batch.max_micro_batch_size == 6
    first.batch.global_step, first.batch.samples_seen = 3, 36
    saved = state.state_dict()
    resumed, resumed_state, probe, probes = _global_batch_run(tmp_path, "128MiB", found=3)
    resumed_state.load_state_dict(saved)
    resumed_state.check_resume()  # taken: the budget sets the micro-batch alone
    resumed.settle(dataset_size=100, probe=probe)
    assert probes == ["128MiB"] and resumed.batch.max_micro_batch_size == 3
    assert resumed.batch.batch_size == 12 and (resumed.batch.global_step, resumed.batch.samples_seen) == (3, 36)


def test_a_changed_budget_without_a_global_batch_is_refused(tmp_path):
    saved = run_state(tmp_path, max_memory="256MiB").state_dict()
    resumed = run_state(tmp_path, max_memory="128MiB")
    resumed.load_state_dict(saved)
    with pytest.raises(ConfigError, match=r'max_memory was "256MiB" .* is "128MiB" now; it changes what is trained '
                                          r"\(the batch probed under it; with a global_batch_size it may change"):
        resumed.check_resume()


def test_local_data_is_fingerprinted_by_what_it_holds_not_where_it_lives(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name / "data").mkdir(parents=True)
        (tmp_path / name / "data" / "train.jsonl").write_text('{"text": "hello"}\n')
        (tmp_path / name / "data" / ".train.jsonl.writing_x").write_text("half")  # a temporary: not data
    def settings(name):
        return {"dataset": {"data_dir": str(tmp_path / name / "data"), "split": "train", "source": "json"}}

    moved = fingerprint(settings("a"))
    assert moved == fingerprint(settings("b")) and "sha256:" in moved["dataset"] and '"source": "json"' in moved["dataset"]
    (tmp_path / "b" / "data" / "train.jsonl").write_text('{"text": "other"}\n')  # regenerated: same size
    assert fingerprint(settings("b")) != moved
    # a path that does not exist (a hub dataset's name) stays as written
    assert fingerprint({"dataset": {"source": "allenai/c4"}}) == {"dataset": '{"source": "allenai/c4"}'}


def test_a_large_datasets_digest_reads_a_bounded_amount(tmp_path, monkeypatch):
    import adaptive_batch.files as files

    monkeypatch.setattr(files, "_DIGEST_READ_BYTES", 3 << 20)  # 3 MiB stands in for 1 GiB
    for i in range(4):
        (tmp_path / f"shard_{i}.bin").write_bytes(bytes(2 << 20))
    before = files.content_digest(str(tmp_path))
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: (opened.append(path), real_open(path, *a, **k))[1])
    assert files.content_digest(str(tmp_path)) == before
    assert len(opened) == 2  # shard 0 whole (2 MiB), shard 1 sampled (1 MiB), shards 2-3 by name and size alone
    monkeypatch.undo()
    with open(tmp_path / "shard_1.bin", "r+b") as f:  # a change where a sample falls
        f.write(b"x")
    changed = files.content_digest(str(tmp_path))
    assert changed != before and changed.endswith(f"({8 << 20} bytes)")


def test_the_controller_stands_for_its_session_and_anything_else_is_refused_when_built(tmp_path):
    # A controller was taken and failed at the first checkpoint (no dataset_size): now it is its session.
    controller = AdaptiveBatchController(AdaptiveBatchOptions(), batch_size=4, input_key="tokens", device=CPU,
                                         output_dir=str(tmp_path), max_seq_len=32, log=lambda line: None)
    controller.settle(dataset_size=100)
    state = RunState(controller, settings={"batch_size": 4})
    assert state.session is controller.session and state.state_dict()[RUN_STATE_KEY]["dataset_size"] == 100
    with pytest.raises(TypeError, match="RunState takes a BatchSession or its controller, not dict"):
        RunState({}, settings={})



def test_activation_checkpointing_changed_on_resume_is_taken_as_a_budget_is(tmp_path):
    """Resumed with checkpointing off, the saved answer trained at 2.4 times the budget: with a
    global batch the micro-batch is probed again; without one the resume is refused."""
    first, state, probe, _ = _global_batch_run(tmp_path, "256MiB", found=6, enable_activation_checkpointing=True)
    first.settle(dataset_size=100, probe=probe)
    saved = state.state_dict()
    resumed, resumed_state, probe, probes = _global_batch_run(tmp_path, "256MiB", found=2,
                                                              enable_activation_checkpointing=False)
    resumed_state.load_state_dict(saved)
    resumed_state.check_resume()
    resumed.settle(dataset_size=100, probe=probe)
    assert probes == ["256MiB"] and resumed.batch.max_micro_batch_size == 2
    saved = run_state(tmp_path, enable_activation_checkpointing=True).state_dict()
    alone = run_state(tmp_path, enable_activation_checkpointing=False)
    alone.load_state_dict(saved)
    with pytest.raises(ConfigError, match=r"enable_activation_checkpointing was true .* is false now; it changes what "
                                          r"is trained \(the batch probed under it"):
        alone.check_resume()


def test_a_checkpoint_from_before_what_fits_was_recorded_resumes(tmp_path):
    """Its config set enable_activation_checkpointing, which that version did not record: the
    resume was refused as 'unset ... is true now'."""
    saved = run_state(tmp_path).state_dict()
    resumed = run_state(tmp_path, enable_activation_checkpointing=True)
    resumed.load_state_dict(saved)
    assert resumed.changed_settings() == []
