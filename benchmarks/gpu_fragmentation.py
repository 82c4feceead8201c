"""Why does the tiny model's answer fail in a fresh process when the probe's check passed it?

One fresh process per variant, each held to the same limit, at the same batch (``gpu_check``'s
tiny row): the answer's consecutive-step check run cold (no search before it), plain training
steps, training steps after each warm-up of ``gpu_check.WARM`` (one made before any large
activation: a step at batch 1, cuBLAS's workspaces alone, the optimizer state alone), and plain
training with cuBLAS's workspaces at size 0. Prints one JSON line per variant.

    python benchmarks/gpu_fragmentation.py --batch 87 --limit 2GiB --steps 20
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# cuBLAS's and cuBLASLt's workspace sizes, read by torch when it makes them: 0 makes none.
NO_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def cold_check(batch: int, limit: int, device_name: str) -> dict:
    import torch

    from gpu_check import build, load_config, make_batch_fn

    from adaptive_batch.logs import lines_to
    from adaptive_batch.probe.target import ProbeTarget
    from adaptive_batch.probe.verify import runs_consecutive_steps

    device = torch.device(device_name)
    cfg = load_config("tiny")
    model, optimizer, step = build(cfg, device)
    target = ProbeTarget(step, make_batch_fn(cfg, model, device), model, optimizer, device)
    lines = []
    with lines_to(lines.append, lines.append):
        ok = runs_consecutive_steps(batch, target, budget_bytes=limit if device.type == "cuda" else None)
    return {"passes": ok, "lines": lines}


def variants(batch: int, limit: str, limit_bytes: int, steps: int, device: str) -> dict:
    """name -> (command, extra environment)."""
    base = [sys.executable, "gpu_check.py", "--train", "tiny", "--batch", str(batch), "--steps", str(steps),
            "--limit-bytes", str(limit_bytes), "--device", device]
    runs = {"cold check": ([sys.executable, __file__, "--batch", str(batch), "--limit", limit, "--device", device,
                            "--cold-check"], {}),
            "plain": (base, {}), "no cuBLAS workspace": (base, NO_WORKSPACE)}
    from gpu_check import WARM

    runs.update({f"warm: {kind}": (base + ["--warm", kind], {}) for kind in WARM})
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--limit", default="2GiB")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for a dry run (nothing held)")
    parser.add_argument("--cold-check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from adaptive_batch.memory.device import parse_memory

    limit = int(parse_memory(args.limit))
    if args.cold_check:
        print(json.dumps(cold_check(args.batch, limit, args.device)))
        return 0
    for name, (cmd, extra) in variants(args.batch, args.limit, limit, args.steps, args.device).items():
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", **extra)
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE, timeout=300)
        out = [line for line in run.stdout.splitlines() if line.startswith("{")]
        result = json.loads(out[-1]) if out else {"exit": run.returncode, "stderr": run.stderr[-500:]}
        result.pop("per_step", None) if name == "cold check" else None
        print(json.dumps({"variant": name, "batch": args.batch, "limit": args.limit, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
