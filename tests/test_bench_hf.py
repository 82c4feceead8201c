"""`benchmarks/bench_hf.py`: our row counts the first guess's real steps from the line the probe
logs (a reworded line once left them out of the count without a word)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_hf  # noqa: E402

from adaptive_batch.probe.children import FirstGuess  # noqa: E402


def test_the_first_guess_steps_are_counted_from_the_probes_own_line():
    line = f"probe: {FirstGuess(6, (1, 1, 2, 3)).describe()}; the line in address space is measured at 5 and 6."
    assert bench_hf.first_guess_steps(["probe trial 1 (estimate): ...", line]) == 4
    assert bench_hf.first_guess_steps([f"probe: {FirstGuess(None, ()).describe()}; ..."]) == 0
