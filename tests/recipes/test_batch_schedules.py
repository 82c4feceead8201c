"""Batch schedules through the real `tune run` on CPU: growth every N steps, samples or tokens;
a fixed global batch with probed micro-batches; step checkpoints and exact mid-epoch resume."""

import json
import math
from pathlib import Path

import pytest

from tests.recipes.conftest import FIXED, SMALL_MODEL, read_metric_log, run_tune, run_tune_until_killed

LR = 1e-3  # the tiny config's optimizer.lr
COSINE = [
    "lr_scheduler._component_=torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "lr_scheduler.num_warmup_steps=1",
]


@pytest.mark.parametrize("interval,progress", [
    ("3 steps", "step"), ("5 samples", "samples_seen"), ("1500 tokens", "tokens_seen"),
], ids=["steps", "samples", "tokens"])
def test_growth_every_n_steps_samples_or_tokens_clamped_with_the_lr_following(tmp_path, schedules, interval, progress):
    every = int(interval.split()[0])
    proc = run_tune(
        tmp_path, *SMALL_MODEL, "batch_increase_function=my_growth.double_after_first", f"batch_increase_interval={interval}",
        "batch_size=2", "max_batch_size=6", "max_steps_per_epoch=15", "lr_scaling=linear", extra_path=schedules,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metric_log(tmp_path)
    before = 0  # the progress before each step decides its batch: boundaries k * every reached
    for r in rows:
        k = int(before) // every
        last = r is rows[-1]  # the epoch's leftover samples may make a smaller last batch
        assert r["batch_size"] == min(2 * 2**k, 6) or (last and r["batch_size"] < min(2 * 2**k, 6)), (r, before)
        assert r["growth_interval"] == k
        assert r["lr"] == pytest.approx(LR * r["batch_size"] / 2, rel=1e-6)
        before = r["step"] if progress == "step" else r[progress]
    sizes = [int(r["batch_size"]) for r in rows]
    assert sizes[0] == 2 and 4 in sizes and sizes.count(6) >= 2  # grew, and held at the bound
    assert rows[-1]["samples_seen"] == 30  # 15 steps of 2: the epoch keeps its samples
    assert "batch_size 4 -> 6 (clamped from 8 to 6, the largest micro-batch)." in proc.stderr
    assert "Interval 1 (" in proc.stderr and "Epoch 1" not in proc.stderr


def test_fixed_global_batch_with_the_probed_micro_batch_equals_accumulation_set_by_hand(tmp_path):
    common = [*SMALL_MODEL, FIXED, "max_steps_per_epoch=2", "lr_scaling=linear"]
    auto = run_tune(
        tmp_path / "auto", *common, "global_batch_size=12", "use_maximum_batch_size=True", "max_memory=24MiB",
        "batch_size_rounding=power_of_two",
    )
    assert auto.returncode == 0, auto.stderr[-3000:]
    report = json.loads((tmp_path / "auto" / "batch_probe.json").read_text())
    plan = report["global_batch"]
    assert plan["global_batch_size"] == 12 and plan["micro_batch_size"] <= report["batch_size"] < 12
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == 12 and plan["even"]
    rows = read_metric_log(tmp_path / "auto")
    assert len(rows) == 2
    for r in rows:  # the global batch and the LR never change; the accumulation follows the probe
        assert r["batch_size"] == 12 and r["lr"] == pytest.approx(LR, rel=1e-9)
        assert r["micro_batch_size"] == plan["micro_batch_size"]
        assert r["grad_accum_steps"] == plan["gradient_accumulation_steps"]
    by_hand = run_tune(
        tmp_path / "hand", *common, f"batch_size={plan['micro_batch_size']}",
        f"gradient_accumulation_steps={plan['gradient_accumulation_steps']}",
    )
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    hand = read_metric_log(tmp_path / "hand")
    for key in ("batch_size", "micro_batch_size", "grad_accum_steps", "samples_seen", "real_tokens", "lr", "loss"):
        assert [r[key] for r in rows] == [r[key] for r in hand], key


def _resume_and_compare(tmp_path, common, *, kill_after, nproc=None, extra_path=None, **kw):
    """The uninterrupted run, a run killed once ``kill_after`` exists, and its resumption: the
    resumed run's steps equal the uninterrupted run's. Returns the step it resumed after."""
    whole = run_tune(tmp_path / "whole", *common, nproc=nproc, extra_path=extra_path, **kw)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "killed"
    run_tune_until_killed(out, *common, after=out / "step_checkpoints" / kill_after, nproc=nproc, extra_path=extra_path, **kw)
    # The kill may land inside a save (a temporary left, or a third file not yet pruned): the
    # finished checkpoints are whole either way, and the resumed run tidies up.
    assert list(Path(out, "step_checkpoints").glob("step_*.pt"))
    resumed = run_tune(
        out, *common, "resume_from_checkpoint=True", f"metric_logger.log_dir={out}/logs_resumed",
        nproc=nproc, extra_path=extra_path, **kw,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from the step checkpoint" in resumed.stderr
    assert len(list(Path(out, "step_checkpoints").glob("step_*.pt"))) == 2  # keep_last_n_checkpoints=2
    assert not list(Path(out, "step_checkpoints").glob(".*"))  # no temporary left
    expected, got = read_metric_log(tmp_path / "whole"), read_metric_log(out, "logs_resumed")
    start = int(got[0]["step"]) - 1
    assert start >= int(kill_after.split("_")[1].split(".")[0]) and got[-1]["step"] == expected[-1]["step"]
    keys = ["step", "batch_size", "micro_batch_size", "grad_accum_steps", "samples_seen", "tokens_seen", "lr", "loss"]
    for key in keys + (["gradient_noise_scale"] if "gradient_noise_scale" in expected[0] else []):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected[start:]], rel=1e-9), key
    return start


# Growth by steps killed and resumed: tests/recipes/test_kill_sweep.py (the "steps" mode).
@pytest.mark.slow
def test_killed_mid_epoch_and_resumed_equals_the_uninterrupted_run_with_token_batches(tmp_path):
    common = [*SMALL_MODEL, FIXED, "max_tokens=768", "epochs=2", "max_steps_per_epoch=4", "save_every_n_steps=1",
              "keep_last_n_checkpoints=2", *COSINE]
    _resume_and_compare(tmp_path, common, kill_after="step_5.pt")


def test_resume_with_nothing_saved_is_one_line(tmp_path):
    # torchtune's checkpointer answered a TypeError from a path join.
    proc = run_tune(tmp_path, FIXED, "resume_from_checkpoint=True", "max_steps_per_epoch=1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"error: resume_from_checkpoint=True: {tmp_path} holds no checkpoint to resume" in proc.stderr
    assert "set resume_from_checkpoint=False to start the run" in proc.stderr and "Model is initialized" not in proc.stderr


@pytest.mark.parametrize("overrides,micro_batches", [
    (["gradient_accumulation_steps=2"], 2),  # two micro-batches' gradients to compare
    (["noise_scale_estimator=norm_layers"], 1),  # each sample's norm-layer gradients, on one micro-batch
], ids=["accumulated_micro_batches", "norm_layers_one_micro_batch"])
def test_noise_scale_is_logged_every_step(tmp_path, overrides, micro_batches):
    proc = run_tune(tmp_path, *SMALL_MODEL, FIXED, "batch_size=4", "measure_noise_scale=True", "max_steps_per_epoch=6", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metric_log(tmp_path)
    assert len(rows) == 6 and all(r["grad_accum_steps"] == micro_batches for r in rows)
    # early in training the gradient dwarfs its noise: a critical batch of a few samples
    assert all(0 < r["gradient_noise_scale"] < 100 for r in rows)


def test_lora_stopped_mid_epoch_resumes_from_its_adapter_step_checkpoint(tmp_path, schedules):
    common = [
        *SMALL_MODEL, "batch_increase_function=my_growth.double_or_stop", "batch_increase_interval=2 steps", "batch_size=2",
        "max_batch_size=4", "max_steps_per_epoch=8", "save_every_n_steps=1", *COSINE,
    ]
    kw = dict(recipe="recipes/lora_finetune_single_device.py", config="configs/tiny/lora_single_device.yaml",
              extra_path=schedules)
    whole = run_tune(tmp_path / "whole", *common, **kw)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "stopped"
    stopped = run_tune(out, *common, env={"STOP_AT_EPOCH": "2"}, **kw)
    # the function fails at boundary 2, after step 4: the last checkpoint is step 3's, mid-epoch
    assert stopped.returncode != 0 and "at interval=2, current_batch_size=4 raised RuntimeError: preempted" in stopped.stderr
    assert sorted(p.name for p in (out / "step_checkpoints").iterdir()) == ["step_2.pt", "step_3.pt"]
    resumed = run_tune(out, *common, "resume_from_checkpoint=True", f"metric_logger.log_dir={out}/logs_resumed", **kw)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = read_metric_log(tmp_path / "whole"), read_metric_log(out, "logs_resumed")
    assert got[0]["step"] == 4 and len(got) == len(expected) - 3
    for key in ("batch_size", "samples_seen", "tokens_seen", "lr", "loss"):
        assert [r[key] for r in got] == [r[key] for r in expected[3:]], key


def test_a_step_checkpoint_of_another_rank_count_is_one_line_before_the_model_is_built(tmp_path):
    from adaptive_batch import StepCheckpoints
    from adaptive_batch.rng import rng_state
    from adaptive_batch.run.state import RNG_KEY
    from adaptive_batch.run.step_checkpoints import RANKS_KEY

    StepCheckpoints(str(tmp_path / "step_checkpoints")).save(3, {RNG_KEY: [rng_state(), rng_state()], RANKS_KEY: 2})
    proc = run_tune(tmp_path, FIXED, "resume_from_checkpoint=True")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "error: resume_from_checkpoint=True: the step checkpoint" in proc.stderr
    assert "was written by 2 ranks and this run has 1; resume with --nproc_per_node 2, or start a new output_dir." in proc.stderr
    assert "Model is initialized" not in proc.stderr


def test_noise_scale_growth_follows_the_logged_noise_scale_on_split_steps(tmp_path):
    """One micro-batch a step on one device: split in two to measure, and at each boundary the
    batch moves toward the logged B_noise, at most doubling, never past the bound."""
    proc = run_tune(
        tmp_path, *SMALL_MODEL, "batch_increase_function={_component_: adaptive_batch.noise_scale_growth, max_factor: 2}",
        "batch_increase_interval=2 steps", "measure_noise_scale=True", "noise_scale_split_step=True",
        "batch_size=2", "max_batch_size=12", "max_steps_per_epoch=14",
        "lr_scaling=sqrt", "weight_decay_scaling=timescale", "optimizer.weight_decay=0.01",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metric_log(tmp_path)
    assert all(r["grad_accum_steps"] == 2 for r in rows if r["batch_size"] > 1)  # split, never more
    expected = 2
    for before, r in zip(rows, rows[1:]):
        noise = before.get("gradient_noise_scale")  # absent while the |G|^2 average is not above 0
        if int(before["step"]) % 2 == 0 and noise is not None:  # a boundary: it decides the next batch
            expected = max(int(before["batch_size"]), min(int(noise), 2 * int(before["batch_size"]), 12))
        last = r is rows[-1]
        assert r["batch_size"] == expected or (last and r["batch_size"] < expected), (before, r)
        # sqrt LR, and a weight decay keeping B / (lr x wd) at the configured 2 / (1e-3 x 0.01)
        assert r["lr"] == pytest.approx(LR * math.sqrt(r["batch_size"] / 2), rel=1e-6)
        assert r["batch_size"] / (r["lr"] * r["weight_decay"]) == pytest.approx(2 / (LR * 0.01), rel=1e-6)
    assert max(r["batch_size"] for r in rows) > 2  # it grew
