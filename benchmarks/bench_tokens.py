"""Fixed batch size against token-budget batches at the same memory peak, side by side.

Each row is a real `tune run` of the tiny config on CPU (CPython's help-topic paragraphs, very
uneven lengths). A fixed batch of B samples is padded to its longest sample, so its worst case
is B x max_seq_len tokens; `max_tokens = B x max_seq_len` has the same worst case, so both have
the same memory peak, and the budget's batches carry more real tokens.

    python benchmarks/bench_tokens.py [--batch-size 8] [--steps 20]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from readme_table import write_readme_table  # noqa: E402
from tests.recipes.conftest import read_metric_log  # noqa: E402

SEQ_LEN = 256  # the tiny config's tokenizer.max_seq_len


def run(name, overrides, steps, out_root):
    out = Path(out_root) / "".join(c if c.isalnum() else "_" for c in name)
    cmd = [
        str(Path(sys.executable).with_name("tune")), "run", "recipes/full_finetune_single_device.py",
        "--config", "configs/tiny/full_single_device.yaml", f"output_dir={out}",
        # a fixed batch: these rows compare batching, not growth
        f"max_steps_per_epoch={steps}", "batch_increase_function=null", *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = read_metric_log(out)[1:]  # the first step pays one-time costs
    real = sum(r["real_tokens"] for r in rows)
    padded = sum(r["padded_tokens"] for r in rows)
    seconds = sum(r["real_tokens"] / r["tokens_per_second_per_gpu"] for r in rows)
    return {
        "name": name,
        "samples_per_step": sum(r["batch_size"] for r in rows) / len(rows),
        "max_padded": int(max(r["padded_tokens"] for r in rows)),
        "padding": 1 - real / padded,
        "real_tps": real / seconds,
        "peak_rss": max(r["peak_memory_rss"] for r in rows),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    budget = args.batch_size * SEQ_LEN
    configs = [
        (f"fixed batch_size={args.batch_size}", [f"batch_size={args.batch_size}"]),
        (f"max_tokens={budget}, dataloader order", [f"max_tokens={budget}", "sequence_picking_order=dataloader"]),
        (f"max_tokens={budget}, seqlen order", [f"max_tokens={budget}", "sequence_picking_order=seqlen"]),
    ]
    with tempfile.TemporaryDirectory() as d:
        rows = [run(name, o, args.steps, d) for name, o in configs]
    base = rows[0]["real_tps"]
    lines = [
        f"Tiny config on CPU ({os.cpu_count()} cores), {args.steps} steps each (the first left out), "
        f"the same worst case of {budget} padded tokens per step.",
        "",
        "| batching | samples/step | max padded tokens/step | padding | real tokens/s | vs fixed | peak RSS GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['samples_per_step']:.1f} | {r['max_padded']} | {r['padding']:.1%} "
            f"| {r['real_tps']:.0f} | {r['real_tps'] / base:.2f}x | {r['peak_rss']:.2f} |"
        )
    lines += ["", f"Made by `python benchmarks/bench_tokens.py --batch-size {args.batch_size} "
              f"--steps {args.steps}` on {time.strftime('%Y-%m-%d')}."]
    table = "\n".join(lines)
    print(table)
    if not args.no_readme:
        write_readme_table("bench_tokens", table)


if __name__ == "__main__":
    main()
