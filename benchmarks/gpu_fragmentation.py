"""Why does the tiny model's answer fail in a fresh process when the probe's check passed it?

One fresh process per variant, each held to the same limit, at the same batch (``gpu_check``'s
tiny row): the answer's consecutive-step check run cold in a fresh process (no search before
it), plain training steps, and training steps after one step at batch 1 (the optimizer state
made before any large activation). Prints one JSON line per variant.

    python benchmarks/gpu_fragmentation.py --batch 87 --limit 2GiB --steps 20
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def cold_check(batch: int, limit: int, device_name: str = "cuda:0") -> dict:
    import torch

    from gpu_check import build, load_config, make_batch_fn

    from adaptive_batch.probe.target import ProbeTarget
    from adaptive_batch.probe.verify import runs_consecutive_steps

    device = torch.device(device_name)
    cfg = load_config("tiny")
    model, optimizer, step = build(cfg, device)
    target = ProbeTarget(step, make_batch_fn(cfg, model, device), model, optimizer, device)
    lines = []
    ok = runs_consecutive_steps(batch, target, budget_bytes=limit, log=lines.append)
    return {"variant": "cold check", "passes": ok, "lines": lines}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--limit", default="2GiB")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cold-check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from adaptive_batch.memory.device import parse_memory

    limit = int(parse_memory(args.limit))
    if args.cold_check:
        print(json.dumps(cold_check(args.batch, limit)))
        return 0
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    base = [sys.executable, "gpu_check.py", "--train", "tiny", "--batch", str(args.batch), "--steps", str(args.steps),
            "--limit-bytes", str(limit), "--device", "cuda:0"]
    runs = {"cold check": [sys.executable, __file__, "--batch", str(args.batch), "--limit", args.limit, "--cold-check"],
            "plain": base, "warm state": base + ["--warm-state"]}
    for name, cmd in runs.items():
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE, timeout=300)
        out = [line for line in run.stdout.splitlines() if line.startswith("{")]
        result = json.loads(out[-1]) if out else {"exit": run.returncode, "stderr": run.stderr[-500:]}
        result.pop("per_step", None) if name == "cold check" else None
        print(json.dumps({"variant": name, "batch": args.batch, "limit": args.limit, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
