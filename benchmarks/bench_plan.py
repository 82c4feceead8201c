"""The planner (fake tensors, nothing allocated) against the probe (real steps), side by side.

For the tiny configs at several memory budgets, `adaptive-batch plan` predicts the largest batch
and `adaptive-batch probe` measures it with real training steps on this CPU. The real-size
configs can only be planned here (no weights, no GPU): their rows give the plan's time and answer.

    python benchmarks/bench_plan.py [--budgets 256MiB 512MiB 1GiB] [--no-real-size]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from readme_table import write_readme_table

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("adaptive-batch"))
TINY = ["configs/tiny/full_single_device.yaml", "configs/tiny/lora_single_device.yaml"]
# Real vocabularies (Qwen2.5's 151,936 and Llama 3.2's 128,256 tokens): batch 1 alone needs
# about 1 GiB with full finetuning.
LARGE_VOCABULARY = {
    "configs/tiny/qwen2_5_vocab152k_full_single_device.yaml": ["1.5GiB", "2.5GiB", "4GiB"],
    "configs/tiny/qwen2_5_vocab152k_lora_single_device.yaml": ["1GiB", "2GiB", "3GiB"],
    "configs/tiny/llama3_2_vocab128k_full_single_device.yaml": ["1.5GiB", "2.5GiB", "4GiB"],
    # deeper: 8 layers, planned from 2 and 3 (layer extrapolation) against the probe's real steps
    "configs/tiny/llama3_2_vocab32k_8layers_full_single_device.yaml": ["512MiB", "1GiB", "2GiB"],
}
REAL = [
    "configs/llama3_2/1B_full_single_device.yaml",
    "configs/llama3_2/1B_lora_single_device.yaml",
    "configs/qwen2_5/0.5B_full_single_device.yaml",
]


def cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    proc = subprocess.run([CLI, *args], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"adaptive-batch {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc, time.perf_counter() - start


def plan(config, memory):
    proc, seconds = cli("plan", "--config", config, "--device-memory", memory, "--json")
    return json.loads(proc.stdout), seconds


def probe(config, memory, out):
    _, seconds = cli(
        "probe", "--config", config, f"output_dir={out}", f"max_memory={memory}", "--no-cache",
        "batch_increase_function=null",
    )
    from adaptive_batch.probe.report import read_probe_report

    return read_probe_report(str(Path(out) / "batch_probe.json")), seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=["256MiB", "512MiB", "1GiB"])
    parser.add_argument("--no-real-size", action="store_true")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    lines = [
        f"CPU ({os.cpu_count()} cores). Seconds are the whole command (start-up included); "
        "peak error is the plan's predicted peak against the probe's measured peak at the probed batch.",
        "",
        "| config | memory | planned batch | probed batch | peak error at probed batch | plan s | probe s |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as d:
        runs = [(config, budgets) for config in TINY for budgets in [args.budgets]] + list(LARGE_VOCABULARY.items())
        for config, budgets in runs:
            for i, memory in enumerate(budgets):
                planned, plan_s = plan(config, memory)
                report, probe_s = probe(config, memory, f"{d}/{Path(config).stem}_{i}")
                found = report.max_batch_size
                measured = next(t.peak_bytes for t in report.trials if t.batch_size == found and t.fits)
                # the plan's own fake step at that batch where it ran one, else its table's line
                steps = {r["batch_size"]: r["peak_bytes"] for r in planned["rows"] + planned["measured"]}
                line = planned["estimate"]
                predicted = steps.get(found, line["fixed_bytes"] + line["bytes_per_sample"] * found)
                lines.append(
                    f"| `{config}` | {memory} | {planned['max_batch_size']} | {found} "
                    f"| {(predicted - measured) / measured:+.2%} | {plan_s:.1f} | {probe_s:.1f} |"
                )
                print(lines[-1], flush=True)
    if not args.no_real_size:
        for config in REAL:
            planned, plan_s = plan(config, "80GiB")
            lines.append(
                f"| `{config}` (seq {planned['seq_len']}) | 80GiB | {planned['max_batch_size']} | needs the GPU "
                f"| | {plan_s:.1f} | |"
            )
            print(lines[-1], flush=True)
    lines += ["", f"Made by `python benchmarks/bench_plan.py` on {time.strftime('%Y-%m-%d')}."]
    table = "\n".join(lines)
    print(table)
    if not args.no_readme:
        write_readme_table("bench_plan", table)


if __name__ == "__main__":
    main()
