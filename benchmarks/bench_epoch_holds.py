"""Does the batch the recipe finds train a whole epoch under a limit set from outside?

For each config and headroom: ``tune run`` of the full single-device recipe under ``RLIMIT_AS``
set to the process's size plus the headroom (``tests/recipes/limited_run.py``, as ``prlimit
--as`` would), with ``max_memory: null`` (the probe reads the limit), ``retry_on_oom: False``
(an out-of-memory step ends the run instead of being split) and no growth, for one epoch. Then
a fresh process under the same limit trains found + 1 for ``--over-steps`` steps.
The answer holds when the epoch ends with every step at the found batch and found + 1 fails.

    python benchmarks/bench_epoch_holds.py                          # the table in docs/probe.md
    python benchmarks/bench_epoch_holds.py --rows tiny:1.0 --samples 256
"""

import argparse
import json
import math
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile
import time

from readme_table import write_readme_table

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/full_finetune_single_device.py"
# name: (config, its vocabulary, overrides). The 152K model reads 64-token sequences so that a
# headroom of a few GiB holds several samples' logits beside its tied embedding's AdamW state.
CONFIGS = {
    "tiny": ("configs/tiny/full_single_device.yaml", "259", []),
    "152K": ("configs/tiny/qwen2_5_vocab152k_full_single_device.yaml", "152K", ["tokenizer.max_seq_len=64"]),
}
ROWS = "tiny:0.5,tiny:1.0,tiny:2.0,152K:1.1,152K:1.5,152K:2.0"
SAMPLES = 512


def _tune(headroom_gib: float, output_dir: Path, config: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "tests/recipes/limited_run.py", str(int(headroom_gib * 2**30)),
           "run", RECIPE, "--config", config, f"output_dir={output_dir}", "retry_on_oom=False",
           "batch_increase_function=null", "epochs=1", "max_steps_per_epoch=null", "probe_cache=False", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))


def _steps(output_dir: Path) -> list:
    """The batch size of each step the metric log recorded."""
    logs = list((output_dir / "logs").glob("log_*.txt")) if (output_dir / "logs").exists() else []
    text = logs[0].read_text() if logs else ""
    return [float(m.group(1)) for m in re.finditer(r"Step \d+ \|.* batch_size:(\S+)", text)]


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "can't allocate" in line]
    return lines[-1][:120] if lines else ""


def row(name: str, headroom: float, samples: int, over_steps: int, work: Path) -> str:
    config, vocab, extra = CONFIGS[name]
    data = [f"dataset.split=train[:{samples}]", *extra]
    start = time.perf_counter()
    probed = _tune(headroom, work / "probed", config, "use_maximum_batch_size=True", "max_memory=null", *data)
    seconds = time.perf_counter() - start
    report_path = work / "probed" / "batch_probe.json"
    if not report_path.exists():
        return f"| {vocab} | {headroom} GiB | - | - | - | - | - | - | no probe: {_last_line(probed)} |"
    report = json.loads(report_path.read_text())
    found = report["batch_size"]
    trials = report.get("trials", [])
    ooms = sum(not t["fits"] for t in trials)
    steps = _steps(work / "probed")
    epoch = math.ceil(samples / found)
    # every step at the found batch but the epoch's last, which holds what is left
    whole = probed.returncode == 0 and len(steps) == epoch and all(b == found for b in steps[:-1])
    over = _tune(headroom, work / "over", config, f"batch_size={found + 1}", *data, f"max_steps_per_epoch={over_steps}")
    over_trained = len(_steps(work / "over"))
    over_fails = over.returncode != 0 and "can't allocate memory" in over.stderr
    holds = "yes" if whole and over_fails else ("no" if not whole else "undershoot")
    return (f"| {vocab} | {headroom} GiB | {found} | {len(trials)} / {ooms} | {seconds:.0f} | "
            f"{len(steps)} of {epoch} | {'fails at step ' + str(over_trained + 1) if over_fails else 'trains'} | {holds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=ROWS, help="config:headroom_GiB pairs, comma-separated (configs: tiny, 152K)")
    parser.add_argument("--samples", type=int, default=SAMPLES, help="the epoch: the dataset's first N samples")
    parser.add_argument("--over-steps", type=int, default=10, help="steps found + 1 is given in a fresh process")
    args = parser.parse_args()
    lines = [
        "| vocab | headroom | found | trials / OOM | probe + epoch s | epoch steps at found | found + 1 (fresh process) | holds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for spec in args.rows.split(","):
        name, headroom = spec.split(":")
        with tempfile.TemporaryDirectory() as work:
            lines.append(row(name, float(headroom), args.samples, args.over_steps, Path(work)))
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.rows == ROWS and args.samples == SAMPLES and args.over_steps == 10:
        write_readme_table("epoch-holds-table", table)


if __name__ == "__main__":
    main()
