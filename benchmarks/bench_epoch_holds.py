"""Does the batch the recipe finds train a whole epoch under a limit set from outside?

For each config and headroom: ``tune run`` of the single-device recipe under ``RLIMIT_AS``
set to the process's size plus the headroom (``tests/recipes/limited_run.py``, as ``prlimit
--as`` would), with ``max_memory: null`` (the probe reads the limit), ``retry_on_oom: False``
(an out-of-memory step ends the run instead of being split) and no growth, for one epoch. Then
a fresh process under the same limit trains found + 1 for ``--over-steps`` steps.
The answer holds when the epoch ends with every step at the found batch and found + 1 fails.
The epoch ends with its checkpoint (LoRA's: the adapters and the merged weights), under the
same limit. Rows run with the default samples replace their own in the docs table.

    python benchmarks/bench_epoch_holds.py                          # the table in docs/probe.md
    python benchmarks/bench_epoch_holds.py --rows lora-152K:1.5          # one row, updated in the table
"""

import argparse
import math
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile
import time

from readme_table import write_readme_table

from adaptive_batch.probe.report import read_probe_report

REPO = Path(__file__).resolve().parents[1]
FULL, LORA = "recipes/full_finetune_single_device.py", "recipes/lora_finetune_single_device.py"
# name: (recipe, config, its vocabulary, overrides). The 152K model reads 64-token sequences so
# that a headroom of a few GiB holds several samples' logits beside its tied embedding.
CONFIGS = {
    "tiny": (FULL, "configs/tiny/full_single_device.yaml", "259", []),
    "152K": (FULL, "configs/tiny/qwen2_5_vocab152k_full_single_device.yaml", "152K", ["tokenizer.max_seq_len=64"]),
    "lora-tiny": (LORA, "configs/tiny/lora_single_device.yaml", "259", []),
    "lora-152K": (LORA, "configs/tiny/qwen2_5_vocab152k_lora_single_device.yaml", "152K", ["tokenizer.max_seq_len=64"]),
}
ROWS = "tiny:0.5,tiny:1.0,tiny:2.0,152K:1.1,152K:1.5,152K:2.0,lora-tiny:1.0,lora-152K:1.5"
HEADER = [
    "| recipe | vocab | headroom | found | trials / OOM | probe + epoch s | epoch steps at found | found + 1 (fresh process) | holds |",
    "|---|---|---|---|---|---|---|---|---|",
]
SAMPLES = 512


def _tune(headroom_gib: float, output_dir: Path, recipe: str, config: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "tests/recipes/limited_run.py", str(int(headroom_gib * 2**30)),
           "run", recipe, "--config", config, f"output_dir={output_dir}", "retry_on_oom=False",
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
    recipe, config, vocab, extra = CONFIGS[name]
    kind = "LoRA" if recipe == LORA else "full"
    data = [f"dataset.split=train[:{samples}]", *extra]
    start = time.perf_counter()
    probed = _tune(headroom, work / "probed", recipe, config, "use_maximum_batch_size=True", "max_memory=null", *data)
    seconds = time.perf_counter() - start
    report_path = work / "probed" / "batch_probe.json"
    if not report_path.exists():
        return f"| {kind} | {vocab} | {headroom} GiB | - | - | - | - | - | no probe: {_last_line(probed)} |"
    report = read_probe_report(str(report_path))
    found = report.batch_size
    trials = report.trials
    ooms = sum(not t.fits for t in trials)
    steps = _steps(work / "probed")
    epoch = math.ceil(samples / found)
    # every step at the found batch but the epoch's last, which holds what is left
    whole = probed.returncode == 0 and len(steps) == epoch and all(b == found for b in steps[:-1])
    over = _tune(headroom, work / "over", recipe, config, f"batch_size={found + 1}", *data, f"max_steps_per_epoch={over_steps}")
    over_trained = len(_steps(work / "over"))
    over_fails = over.returncode != 0 and "can't allocate memory" in over.stderr
    holds = "yes" if whole and over_fails else ("no" if not whole else "undershoot")
    return (f"| {kind} | {vocab} | {headroom} GiB | {found} | {len(trials)} / {ooms} | {seconds:.0f} | "
            f"{len(steps)} of {epoch} | {'fails at step ' + str(over_trained + 1) if over_fails else 'trains'} | {holds} |")


def _merged(rows: list) -> str:
    """The docs table with ``rows`` in place of the rows of the same recipe, vocabulary and
    headroom, the others kept (a row per config and headroom, in ``ROWS`` order)."""
    text = (REPO / "docs" / "probe.md").read_text()
    start, end = "<!-- epoch-holds-table:start -->", "<!-- epoch-holds-table:end -->"
    old = text.split(start, 1)[1].split(end, 1)[0] if start in text else ""
    key = lambda line: tuple(c.strip() for c in line.strip("|").split("|")[:3])  # noqa: E731
    table = {key(line): line for line in old.splitlines() if line.startswith("| ") and line.count("|") == 10}
    table.pop(key(HEADER[0]), None)
    table.update({key(line): line for line in rows})
    order = []
    for spec in ROWS.split(","):
        name, headroom = spec.split(":")
        recipe, _, vocab, _ = CONFIGS[name]
        order.append(("LoRA" if recipe == LORA else "full", vocab, f"{float(headroom)} GiB"))
    ranked = sorted(table, key=lambda k: order.index(k) if k in order else len(order))
    return "\n".join(HEADER + [table[k] for k in ranked])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=ROWS, help=f"config:headroom_GiB pairs, comma-separated (configs: {', '.join(CONFIGS)})")
    parser.add_argument("--samples", type=int, default=SAMPLES, help="the epoch: the dataset's first N samples")
    parser.add_argument("--over-steps", type=int, default=10, help="steps found + 1 is given in a fresh process")
    args = parser.parse_args()
    rows = []
    for spec in args.rows.split(","):
        name, headroom = spec.split(":")
        with tempfile.TemporaryDirectory() as work:
            rows.append(row(name, float(headroom), args.samples, args.over_steps, Path(work)))
        print(rows[-1], flush=True)
    print("\n".join(HEADER + rows))
    if args.samples == SAMPLES and args.over_steps == 10:
        write_readme_table("epoch-holds-table", _merged(rows))


if __name__ == "__main__":
    main()
