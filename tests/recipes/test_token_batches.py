"""Token-budget batches and LR scaling in the single-device recipe, through the real `tune run`."""

import json

import pytest

from tests.recipes.conftest import FIXED, SMALL_MODEL, read_metric_log, run_tune

LR = 1e-3  # the tiny config's optimizer.lr, set for batch_size=4


def test_batches_packed_to_the_budget_with_linear_lr(tmp_path):
    proc = run_tune(
        tmp_path, *SMALL_MODEL, FIXED, "max_tokens=2048", "sequence_picking_order=seqlen", "lr_scaling=linear",
        "max_steps_per_epoch=4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metric_log(tmp_path)
    assert len(rows) == 4
    for r in rows:
        assert r["padded_tokens"] <= 2048
        assert r["padding_fraction"] == pytest.approx(1 - r["real_tokens"] / r["padded_tokens"])
        assert r["padding_fraction"] < 0.10
        assert r["lr"] == pytest.approx(LR * r["batch_size"] / 4)
    assert len({r["batch_size"] for r in rows}) > 1  # the sample count varies with lengths
    assert list((tmp_path / "seqlen_cache").glob("seqlen_*.json"))
    assert "sample lengths computed" in proc.stderr


def test_probe_finds_max_tokens_and_sqrt_scaling_follows_the_found_batch(tmp_path):
    proc = run_tune(
        tmp_path, *SMALL_MODEL, FIXED, "use_maximum_batch_size=True", "max_memory=32MiB", "max_tokens=4096",
        "lr_scaling=sqrt", "max_steps_per_epoch=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "batch_probe.json").read_text())
    assert report["max_tokens"] == report["batch_size"] * report["seq_len"]
    for r in read_metric_log(tmp_path):
        assert r["padded_tokens"] <= report["max_tokens"]
        assert r["lr"] == pytest.approx(LR * (r["batch_size"] / 4) ** 0.5)
    # From the probe cache (stored before max_tokens was known), the same budget follows.
    again = run_tune(
        tmp_path / "again", *SMALL_MODEL, FIXED, "use_maximum_batch_size=True", "max_memory=32MiB", "max_tokens=4096",
        "lr_scaling=sqrt", "max_steps_per_epoch=2", f"probe_cache_dir={tmp_path}/probe_cache",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "probe cache hit" in again.stderr
    cached = json.loads((tmp_path / "again" / "batch_probe.json").read_text())
    assert cached["max_tokens"] == report["max_tokens"] == report["batch_size"] * report["seq_len"]
    assert f"training with max_tokens={report['max_tokens']}" in again.stderr


BAD = [
    (["max_tokens=0"], "max_tokens=0 must be a positive integer"),
    (["max_tokens=2048", "sequence_picking_order=longest"], "sequence_picking_order='longest'"),
    (["max_tokens=2048", "min_batch_size=8", "max_batch_size=4"], "min_batch_size=8 is larger than max_batch_size=4"),
    (["max_tokens=2048", "dataset.packed=True"], "max_tokens=2048 with dataset.packed=True"),
    (["lr_scaling=linear", "lr_scaling_unit=tokens"], "lr_scaling_unit=tokens needs lr_scaling_reference"),
    (["max_tokens=2048", "gradient_accumulation_steps=2"], "gradient_accumulation_steps=2 with max_tokens=2048"),
    (["max_tokens=2048", "batch_increase_function=adaptive_batch.double_every_epoch"], "with max_tokens=2048: token-budget"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_token_settings_fail_before_the_model_is_built(tmp_path, overrides, message):
    proc = run_tune(tmp_path / "out", FIXED, *overrides)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "init").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["max_tokens=10"], "max_tokens=10 is smaller than the shortest sample"),
        (["max_tokens=100", "long_sample_policy=error"], "samples are longer (up to 255 tokens)"),
        (["max_tokens=300", "min_batch_size=2"], "cannot hold min_batch_size=2"),
    ],
)
def test_budget_that_does_not_suit_the_data_fails_before_training(tmp_path, overrides, message):
    proc = run_tune(tmp_path, FIXED, *overrides)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    assert read_metric_log(tmp_path) == []  # no training step ran
