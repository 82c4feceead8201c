"""`benchmarks/bench_growth.py`: one schedule's real run reads back as a curve, and the table
reports every schedule with the noise-scale trajectory."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_growth  # noqa: E402


@pytest.mark.slow
def test_noise_scale_growth_run_reads_back(tmp_path):
    name = "noise-scale growth"
    overrides = bench_growth.schedules(samples=8, epochs=2, interval=4)[name]
    r = bench_growth.run("configs/tiny/full_single_device.yaml", name, overrides, seed=0, samples=8, epochs=2,
                         device="cpu", out_root=str(tmp_path))
    assert r["samples"] == 16 and r["batches"][0] == 4 and r["seconds"] > 0
    assert any(c[4] is not None for c in r["curve"])  # B_noise measured on split steps


def test_table_has_a_row_per_schedule_and_the_noise_trajectory():
    def result(loss, noise):
        curve = [(s, s / 10, loss, 4, noise if s > 2 else None) for s in range(1, 9)]
        return {"curve": curve, "final_loss": loss, "steps": 8, "seconds": 0.8, "samples": 8, "batches": [4] * 8,
                "tokens_per_second": 1000.0}

    names = bench_growth.schedules(samples=32, epochs=2, interval=16)
    results = {name: [result(2.0, 5.0), result(2.2, 6.0)] for name in names}

    class Args:
        samples, epochs, seeds, interval = 32, 2, 2, 16

    text = bench_growth.table(results, "configs/tiny/full_single_device.yaml", Args, "CPU")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "schedule" not in line]
    assert [r.split("|")[1].strip() for r in rows] == list(names)
    assert "| 2.100 ± 0.141 |" in rows[0] and "| 1.00x |" in rows[0]
    assert "| - / 5.0 / 5.0 / 5.0 |" in rows[-1]  # none measured by a quarter
    assert rows[0].endswith("| 1000 | 4 → 4 | - | 0.1 | 1.00x |")  # flat curves: at their target from the first step
    assert "The best fixed batch: fixed small" in text


def test_time_to_the_best_fixed_batchs_loss():
    def result(losses, batch):
        curve = [(i * batch, float(i), loss, batch, None) for i, loss in enumerate(losses, 1)]
        return {"curve": curve}

    results = {"fixed 4": [result([3.0, 2.0, 1.5, 1.2], 4)], "fixed 8": [result([3.0, 2.5, 2.2, 2.0], 8)],
               "growth": [result([3.0, 0.5, 0.5, 0.5], 4)], "stuck": [result([3.0, 3.0, 3.0, 3.0], 4)]}
    best, target, reach = bench_growth.time_to_target(results)
    assert best == "fixed 4" and target == pytest.approx(bench_growth.smoothed(results["fixed 4"][0]["curve"])[-1])
    assert reach["growth"] < reach["fixed 4"] == 4.0 and reach["stuck"] == float("inf")
