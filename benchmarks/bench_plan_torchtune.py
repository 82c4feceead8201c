"""`adaptive-batch plan` on every fine-tuning config torchtune 0.6.1's wheel ships.

Each config is planned as shipped (copied from the installed wheel, as `tune cp` does, with
nothing overridden) in a fresh process, at 80 GiB a device: single-device configs on one,
distributed ones on 8 ranks (`--world-size 8`, one rank's share under FSDP2). The table gives
the wall time of the whole command (imports included), the planning time it reports, the
largest batch (per rank), the memory each more sample costs, and what the plan assumed.

    python benchmarks/bench_plan_torchtune.py            # writes the README table
    python benchmarks/bench_plan_torchtune.py --only llama3_2   # a subset, printed only

Left out: configs of other recipes (knowledge distillation, DPO, PPO, QAT, vision, evaluation,
generation, quantization) and models above 72B.
"""

import argparse
import json
from pathlib import Path
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from readme_table import write_readme_table

REPO = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"(qat|KD|dpo|ppo|vision|evaluation|generation|quantization|405B|eleuther|dev/|_to_)", re.IGNORECASE)
KEEP = re.compile(r"(full|lora)")


def wheel_configs() -> List[Path]:
    import torchtune

    root = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "configs"
    return sorted(p for p in root.rglob("*.yaml") if KEEP.search(p.name) and not SKIP.search(str(p.relative_to(root))))


def plan_one(path: Path, root: Path, timeout: int) -> dict:
    # The recipe a config is for is named in its header ("..._distributed" or "..._single_device").
    distributed = "_distributed" in path.read_text()
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / path.name
        shutil.copy(path, config)
        cmd = [sys.executable, "-m", "adaptive_batch.torchtune.cli", "plan", "--config", str(config), "--device-memory", "80GiB", "--json"]
        if distributed:
            cmd += ["--world-size", "8"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"config": str(path.relative_to(root)), "ranks": 8 if distributed else 1, "error": f"over {timeout}s"}
        wall = time.perf_counter() - t0
    row = {"config": str(path.relative_to(root)), "ranks": 8 if distributed else 1, "wall": wall}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        row["error"] = (lines[-1] if lines else f"exit {proc.returncode}")[:160]
        return row
    plan = json.loads(proc.stdout[proc.stdout.index("{"):])
    # What one more sample costs near the answer: the two largest fake steps (at batch 1-2
    # a flat part such as the optimizer step can hide it).
    (b1, p1), (b2, p2) = sorted((r["batch_size"], r["peak_bytes"]) for r in plan["measured"])[-2:]
    row.update(
        seconds=plan["seconds"],
        batch=plan["max_batch_size"],
        seq_len=plan["seq_len"],
        per_sample=(p2 - p1) / (b2 - b1) / 2**30,
        assumptions=plan["assumptions"],
    )
    return row


def short(note: str) -> str:
    """The assumption, in a few words for the table."""
    if note.startswith("tokenizer.max_seq_len is null"):
        return "seq 2048"
    if "not importable here" in note:
        return note.split(" is not importable")[0].replace("optimizer ", "").split(".")[-1] + " by state size"
    if note.startswith("NF4 base weights"):
        return "NF4 weights"
    if "extrapolated" in note:
        return "layers x" + note.split(" decoder")[0]
    if note.startswith("optimizer in backward"):
        return "optim in bwd"
    if note.startswith("enable_activation_offloading"):
        return "offloading not modelled"
    if note.startswith("one rank's share"):
        return "FSDP2 share"
    return note[:40]


def table(rows: List[dict]) -> str:
    lines = [
        "| config | ranks | wall s | plan s | largest batch at 80 GiB | GiB per sample | assumed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['ranks']} | {r.get('wall', 0):.0f} | - | error: {r['error']} | - | - |")
            continue
        notes = ", ".join(short(n) for n in r["assumptions"])
        lines.append(
            f"| {r['config']} | {r['ranks']} | {r['wall']:.0f} | {r['seconds']:.1f} | {r['batch']} "
            f"| {r['per_sample']:.2f} | {notes} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="plan only configs whose path contains this")
    parser.add_argument("--timeout", type=int, default=300)
    args = parser.parse_args(argv)
    import torchtune

    root = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "configs"
    configs = [p for p in wheel_configs() if not args.only or args.only in str(p)]
    rows = []
    for path in configs:
        rows.append(plan_one(path, root, args.timeout))
        r = rows[-1]
        print(f"{r['config']}: {r.get('error') or r['batch']} ({r.get('wall', 0):.0f}s)", file=sys.stderr, flush=True)
    ok = [r for r in rows if "error" not in r]
    summary = (
        f"{len(ok)} of {len(rows)} configs planned; slowest {max((r['wall'] for r in ok), default=0):.0f} s wall "
        f"(imports included), {max((r['seconds'] for r in ok), default=0):.0f} s planning. Made by "
        f"`python benchmarks/bench_plan_torchtune.py` on {time.strftime('%Y-%m-%d')}, torchtune "
        f"{torchtune.__version__}, a 2-core machine; seq 2048 where the config leaves it open."
    )
    text = f"{table(rows)}\n\n{summary}"
    print(text)
    if not args.only:
        write_readme_table("bench_plan_torchtune", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
