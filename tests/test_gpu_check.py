"""`make gpu-check`'s script: it must say "no CUDA device" and exit 0 here, and its code path
must keep working (run on the CPU, where it cannot hold a card to a memory fraction)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks/gpu_check.py"


def test_without_cuda_it_says_so_and_exits_cleanly():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "no CUDA device" in run.stdout


@pytest.mark.slow
def test_the_same_checks_run_on_the_cpu():
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--small-only", "--steps", "1", "--small-memory", "256MiB",
           "--config", str(REPO / "configs/tiny/full_single_device.yaml")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = [line for line in run.stdout.splitlines() if line.startswith("| full_single_device")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "259" and int(cells[5]) >= 2 and cells[9] == "yes"
