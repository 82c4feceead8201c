"""What features off cost: our recipe with every adaptive key off beside torchtune 0.6.1's own.

Each pair runs `tune run` of the tiny config twice, alternating which goes first: our
`recipes/full_finetune_single_device.py` (no probe, no growth, no LR scaling, no token budget)
and the stock `full_finetune_single_device` torchtune's wheel ships, on the same data, initial
weights and seed. Reported: each run's median step in tokens/s (the first step, which pays
one-time costs, left out), per pair the median over steps of the two runs' ratio at the same
step (the same batch in both), the mean and spread of those, and the largest difference of a
step's loss.

    python benchmarks/bench_overhead.py [--pairs 6] [--steps 16] [--batch-size 8]
"""

import argparse
import os
from pathlib import Path
import statistics
import subprocess
import sys
import tempfile
import time

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from readme_table import write_readme_table  # noqa: E402
from tests.recipes.conftest import read_metric_log  # noqa: E402

CONFIG = "configs/tiny/full_single_device.yaml"
# Every adaptive key at its off value, said outright (the config's growth function is on).
FEATURES_OFF = ["batch_increase_function=null", "use_maximum_batch_size=False", "lr_scaling=none"]


def tune_run(recipe, out, shared, overrides):
    cmd = [str(Path(sys.executable).with_name("tune")), "run", recipe, "--config", CONFIG, f"output_dir={out}",
           f"dataset.data_dir={shared}/data", *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe} failed:\n{proc.stderr[-3000:]}")
    return read_metric_log(out)


def initial_weights(shared, common):
    """Our recipe writes the seeded random initialisation once (a one-step run); both then load it."""
    tune_run("recipes/full_finetune_single_device.py", shared / "init_run", shared,
             [*common, *FEATURES_OFF, "max_steps_per_epoch=1", f"checkpointer.checkpoint_dir={shared}/init"])
    (name,) = [p.name for p in (shared / "init").iterdir() if p.suffix in (".bin", ".pt", ".safetensors")]
    return [f"checkpointer.checkpoint_dir={shared}/init", f"checkpointer.checkpoint_files=[{name}]"]


def tokens_per_second(rows):
    rows = rows[1:]  # the first step pays one-time costs
    # The median step (the stock recipe logs no token count to weigh by): one slow step, a
    # neighbour's burst on a shared machine, moves a run's mean by several percent.
    return statistics.median(r["tokens_per_second_per_gpu"] for r in rows)


def paired_ratio(ours, stock):
    """The median over steps of ours / stock at the same step: both runs train the same batches,
    so a step's tokens cancel and a slow step on a shared machine moves one ratio, not the run's."""
    return statistics.median(
        a["tokens_per_second_per_gpu"] / b["tokens_per_second_per_gpu"] for a, b in zip(ours[1:], stock[1:])
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    common = [f"batch_size={args.batch_size}", "log_peak_memory_stats=False", "epochs=1"]
    ratios, loss_diff, ours_tps, stock_tps = [], 0.0, [], []
    with tempfile.TemporaryDirectory() as d:
        shared = Path(d)
        weights = initial_weights(shared, common)
        run = [*common, *weights, f"max_steps_per_epoch={args.steps}"]
        for pair in range(args.pairs):
            order = ["ours", "stock"] if pair % 2 == 0 else ["stock", "ours"]
            logs = {}
            for who in order:
                recipe = "recipes/full_finetune_single_device.py" if who == "ours" else "full_finetune_single_device"
                logs[who] = tune_run(recipe, shared / f"{who}{pair}", shared, [*run, *(FEATURES_OFF if who == "ours" else [])])
            ours, stock = tokens_per_second(logs["ours"]), tokens_per_second(logs["stock"])
            ours_tps.append(ours)
            stock_tps.append(stock)
            ratios.append(paired_ratio(logs["ours"], logs["stock"]))
            losses = [(a["loss"], b["loss"]) for a, b in zip(logs["ours"], logs["stock"])]
            assert len(losses) == args.steps, (len(logs["ours"]), len(logs["stock"]))
            loss_diff = max([loss_diff, *(abs(a - b) for a, b in losses)])
    lines = [
        f"Tiny config on CPU ({os.cpu_count()} cores), batch {args.batch_size}, {args.steps} steps a run (the first "
        f"left out), {args.pairs} pairs alternating which runs first; torch {torch_version()}, torchtune 0.6.1.",
        "",
        "| pair | ours: median step, tokens/s | stock: median step, tokens/s | ours / stock (median of the steps' ratios) |",
        "|---|---|---|---|",
        *(f"| {i + 1} | {o:.0f} | {s:.0f} | {r:.3f}x |" for i, (o, s, r) in enumerate(zip(ours_tps, stock_tps, ratios))),
        "",
        f"Mean {statistics.fmean(ratios):.3f}x (from {min(ratios):.3f}x to {max(ratios):.3f}x); "
        f"the largest difference of a step's loss: {loss_diff:.1e}.",
        "",
        f"Made by `python benchmarks/bench_overhead.py --pairs {args.pairs} --steps {args.steps} "
        f"--batch-size {args.batch_size}` on {time.strftime('%Y-%m-%d')}.",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        write_readme_table("bench_overhead", table)


def torch_version():
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
