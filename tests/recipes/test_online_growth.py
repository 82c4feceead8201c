"""Online batch growth in the single-device recipe, through the real `tune run` on CPU."""

import json
import math

import pytest

from tests.recipes.conftest import FIXED, SMALL_MODEL, read_metric_log, run_tune

LR = 1e-3  # the tiny config's optimizer.lr
COSINE = [
    "lr_scheduler._component_=torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "lr_scheduler.num_warmup_steps=1",
]


def cosine(step, total, warmup=1):
    """torchtune's get_cosine_schedule_with_warmup multiplier, written out."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def epochs_of(rows, samples_per_epoch):
    """Groups metric rows by epoch from samples_seen."""
    out = {}
    for r in rows:
        out.setdefault(int((r["samples_seen"] - 1) // samples_per_epoch), []).append(int(r["batch_size"]))
    return out


def test_user_function_grows_each_epoch_with_linear_lr_on_a_sample_counted_cosine(tmp_path, schedules):
    proc = run_tune(
        tmp_path, *SMALL_MODEL, "batch_increase_function=my_growth.table", "batch_size=2", "max_batch_size=16", "epochs=3",
        "max_steps_per_epoch=4", "lr_scaling=linear", *COSINE, extra_path=schedules,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metric_log(tmp_path)
    # an epoch is 4 steps x 2 samples; growth shrinks the steps, not the samples
    assert epochs_of(rows, 8) == {0: [2, 2, 2, 2], 1: [4, 4], 2: [8]}
    assert [r["step"] for r in rows] == list(range(1, 8)) and rows[-1]["samples_seen"] == 24
    assert "Epoch 1: batch_size 2 -> 4." in proc.stderr and "Epoch 2: batch_size 4 -> 8." in proc.stderr
    seen = 0
    total = 3 * 8 / 2  # the schedule's steps at the starting batch
    for r in rows:
        assert r["grad_accum_steps"] == 1 and r["micro_batch_size"] == r["batch_size"]
        assert r["lr"] == pytest.approx(LR * cosine(seen / 2, total) * r["batch_size"] / 2, rel=1e-6)
        seen += r["batch_size"]
    assert cosine(seen / 2, total) == pytest.approx(0.0, abs=1e-12)  # the schedule ends with the data
    assert not (tmp_path / "batch_probe.json").exists()  # max_batch_size bounds growth: no probe


def test_without_a_bound_the_probe_runs_and_growth_is_clamped_to_it(tmp_path):
    proc = run_tune(
        tmp_path, *SMALL_MODEL, "batch_size=2", "max_memory=20MiB", "epochs=3", "max_steps_per_epoch=4", "lr_scaling=sqrt",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "probing for the largest batch that fits, as the bound of the growth" in proc.stderr
    bound = json.loads((tmp_path / "batch_probe.json").read_text())["batch_size"]
    assert 2 <= bound < 8, "max_memory should leave a bound between the start and 8"
    rows = read_metric_log(tmp_path)
    by_epoch = epochs_of(rows, 8)
    expected = [2, min(4, bound), min(2 * min(4, bound), bound)]  # the config's doubling, clamped
    assert [sizes[0] for sizes in by_epoch.values()] == expected
    assert all(sum(sizes) == 8 for sizes in by_epoch.values())
    assert f"clamped from {2 * expected[1]} to {bound}, the largest micro-batch" in proc.stderr
    for r in rows:
        assert r["lr"] == pytest.approx(LR * math.sqrt(r["batch_size"] / 2), rel=1e-6)


def test_growth_past_the_memory_maximum_by_accumulation_matches_one_big_batch(tmp_path, schedules):
    # clip_grad_norm far above the norm: nothing is clipped, and each step logs its gradient norm
    big = run_tune(tmp_path / "big", *SMALL_MODEL, FIXED, "batch_size=6", "max_steps_per_epoch=3", "clip_grad_norm=1000.0")
    assert big.returncode == 0, big.stderr[-3000:]
    acc = run_tune(
        tmp_path / "acc", *SMALL_MODEL, "batch_increase_function=my_growth.add_three_first", "batch_size=3", "max_batch_size=3",
        "grow_with_accumulation=True", "max_steps_per_epoch=6", "clip_grad_norm=1000.0", extra_path=schedules,
    )
    assert acc.returncode == 0, acc.stderr[-3000:]
    big_rows, acc_rows = read_metric_log(tmp_path / "big"), read_metric_log(tmp_path / "acc")
    assert [r["batch_size"] for r in acc_rows] == [6, 6, 6]  # an epoch of 6 steps x 3 samples, at 6 a step
    assert all(r["micro_batch_size"] == 3 and r["grad_accum_steps"] == 2 for r in acc_rows)
    assert all(r["grad_accum_steps"] == 1 for r in big_rows)
    # The same samples and the same per-token normalisation give the same gradient; only the
    # order of float sums differs. Adam turns those 1e-7 differences into ~1e-5 in later losses.
    assert [r["real_tokens"] for r in acc_rows] == [r["real_tokens"] for r in big_rows]
    assert acc_rows[0]["loss"] == pytest.approx(big_rows[0]["loss"], rel=1e-5)
    assert acc_rows[0]["grad_norm"] == pytest.approx(big_rows[0]["grad_norm"], rel=1e-5)
    for a, b in zip(acc_rows, big_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


@pytest.mark.parametrize("recipe,config", [
    ("recipes/full_finetune_single_device.py", "configs/tiny/full_single_device.yaml"),
    ("recipes/lora_finetune_single_device.py", "configs/tiny/lora_single_device.yaml"),
], ids=["full", "lora"])
def test_stopped_and_resumed_run_matches_the_uninterrupted_one(tmp_path, schedules, recipe, config):
    common = [
        *SMALL_MODEL, "batch_increase_function=my_growth.double_or_stop", "batch_size=2", "max_batch_size=3",
        "grow_with_accumulation=True", "epochs=3", "max_steps_per_epoch=3", "lr_scaling=linear", *COSINE,
    ]
    kw = dict(recipe=recipe, config=config, extra_path=schedules)
    whole = run_tune(tmp_path / "whole", *common, **kw)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "stopped"
    stopped = run_tune(out, *common, env={"STOP_AT_EPOCH": "2"}, **kw)
    # the function's error ends the run cleanly after epoch 1's checkpoint, naming where
    assert stopped.returncode != 0
    assert "error: batch_increase_function my_growth.double_or_stop at epoch=2, current_batch_size=4 raised RuntimeError: preempted" in stopped.stderr
    resume_file = "epoch_1/adapter_model.pt" if "lora" in recipe else "epoch_1/model-00001-of-00001.bin"
    assert (out / resume_file).exists()
    files = [] if "lora" in recipe else ["checkpointer.checkpoint_files=[epoch_1/model-00001-of-00001.bin]"]
    resumed = run_tune(
        out, *common, "resume_from_checkpoint=True", *files, f"metric_logger.log_dir={out}/logs_resumed", **kw
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = read_metric_log(tmp_path / "whole")
    got = read_metric_log(out) + read_metric_log(out, "logs_resumed")
    # epochs of 3 x 2 samples: 2s; 4 and the last 2; 8 clamped to an epoch's 6 (2 micro-batches of 3)
    assert [r["batch_size"] for r in expected] == [2, 2, 2, 4, 2, 6]
    assert [r["grad_accum_steps"] for r in expected] == [1, 1, 1, 2, 1, 2]
    for key in ("step", "batch_size", "micro_batch_size", "grad_accum_steps", "samples_seen", "lr"):
        assert [r[key] for r in got] == [r[key] for r in expected], key
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-6)
