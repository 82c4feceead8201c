"""The zoo on a card: does the answer hold on models the recipes do not have, against real CUDA OOMs?

For each model (a conv net with BatchNorm, a BERT encoder, a 128K-vocabulary Llama, and the
Hugging Face Trainer in bf16 with 2 accumulated micro-batches and a padding collator, whose probe
runs through the Trainer's own ``training_step`` and autocast) and a ``max_memory``:

1. the card is held to ``max_memory`` (``torch.cuda.set_per_process_memory_fraction``), as a card
   of that size, and the probe answers (``find_max_batch_size`` with no margin, or
   ``AdaptiveBatchTrainer`` with its default one);
2. a fresh process with training's allocator settings, held to the budget (``max_memory`` less the
   margin), trains the answer for ``--steps`` steps (the Trainer: a plain ``Trainer`` at that
   micro-batch, 2 accumulated, every sample at the longest length);
3. another fresh process, held the same way, must run out of memory at the answer + 1 within 10.

    python benchmarks/gpu_zoo.py --out outputs/gpu_zoo      # on a machine with a card
    python benchmarks/gpu_zoo.py --device cpu --models convnet --steps 2   # the code path, no limits

Each row goes to ``--out/<model>_<max_memory>.json`` as it completes (per-step allocated and
reserved bytes of the fresh runs included); the table is printed last.
"""

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from bench_zoo import TRAINER_MODELS, _trainer_parts
from gpu_check import card_or_none, hold_card_to

MODELS = ("convnet", "bert", "llama128k", "hf-llama8k")
TRAINER = "hf-llama8k"
TRAINER_SAMPLES = 1024  # enough rows for a micro-batch of any size a small card holds
COLUMNS = ["model", "max_memory", "budget", "found", "trial steps", "OOM trials", "probe s", "trains (steps)",
           "found+1 fresh", "alloc peak", "reserved peak"]


def _to(batch: Any, device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return batch.to(device)


def zoo_target(name: str, device):
    """The zoo model's :class:`ProbeTarget` on ``device`` (built on the CPU, moved before any step)."""
    from zoo_models import BUILDERS

    from adaptive_batch.probe.target import ProbeTarget

    cpu = BUILDERS[name]()
    cpu.model.to(device)  # in place: the optimizer's parameters move with it, its state is not made yet
    return ProbeTarget(cpu.train_step, lambda n: _to(cpu.make_batch(n), device), cpu.model, cpu.optimizer, device)


def trainer(cls, device, per_device: int, steps: int, max_length: int, **kwargs):
    """The Trainer row's Trainer: bf16 autocast on a card (fp32 on the CPU), 2 accumulated micro-batches."""
    training = {"use_cpu": device.type == "cpu", "bf16": device.type == "cuda"}
    return _trainer_parts(TRAINER, max_length, cls, per_device=per_device, steps=steps, samples=TRAINER_SAMPLES,
                          training=training, **kwargs)


def probe(name: str, device, max_memory: str, lines: List[str]) -> "tuple[int, float]":
    """The answer in this process, held to ``max_memory``, and the margin it was found under."""
    from adaptive_batch import find_max_batch_size

    if name == TRAINER:
        from adaptive_batch.hf import AdaptiveBatchTrainer

        job = trainer(AdaptiveBatchTrainer, device, per_device=TRAINER_SAMPLES // 8, steps=1, max_length=0,
                      max_memory=max_memory, probe_eval=False, log=lines.append)
        job.train()  # the probe, then one step of the Trainer's own at the answer
        from adaptive_batch.memory.budget import default_safety_margin

        return job.adaptive_batch["max_micro_batch_size"], default_safety_margin(device.type)
    target = zoo_target(name, device)
    found = find_max_batch_size(target.train_step, make_batch=target.make_batch, model=target.model,
                                optimizer=target.optimizer, max_memory=max_memory, safety_margin=0.0,
                                device=device, max_batch_size=1 << 16, log=lines.append)
    return found, 0.0


def train(name: str, batch_size: int, steps: int, limit_bytes: Optional[int], device_name: str) -> Dict[str, Any]:
    """``steps`` steps at ``batch_size`` in this process, held to ``limit_bytes``."""
    import torch

    from adaptive_batch import is_oom_error

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    per_step: List[List[int]] = []
    error = message = None
    if name == TRAINER:
        from transformers import Trainer, TrainerCallback

        class Record(TrainerCallback):
            def on_step_end(self, *args, **kwargs):
                if cuda:
                    per_step.append([torch.cuda.max_memory_allocated(device), torch.cuda.memory_reserved(device)])

        job = trainer(Trainer, device, per_device=batch_size, steps=steps, max_length=TRAINER_MODELS[TRAINER][-1],
                      callbacks=[Record()])
        hold_card_to(device, limit_bytes)
        run = job.train
    else:
        target = zoo_target(name, device)
        hold_card_to(device, limit_bytes)

        def run():
            for _ in range(steps):
                target.train_step(target.make_batch(batch_size))
                if cuda:
                    torch.cuda.synchronize(device)
                    per_step.append([torch.cuda.max_memory_allocated(device), torch.cuda.memory_reserved(device)])
    try:
        run()
    except Exception as e:  # noqa: BLE001 - reported
        error = "OOM" if is_oom_error(e) else f"{type(e).__name__}: {e}"
        message = str(e)[:600]
    return {"batch_size": batch_size, "steps_run": len(per_step) if cuda else (steps if error is None else 0),
            "error": error, "error_message": message, "per_step": per_step,
            "allocated_peak": torch.cuda.max_memory_allocated(device) if cuda else None,
            "reserved_peak": torch.cuda.max_memory_reserved(device) if cuda else None}


def train_fresh(name: str, batch_size: int, steps: int, limit_bytes: int, device: str) -> Dict[str, Any]:
    """:func:`train` in a fresh process with training's allocator settings."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    cmd = [sys.executable, __file__, "--train", name, str(batch_size), str(steps), str(limit_bytes), device]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(__file__))
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        return {"batch_size": batch_size, "steps_run": 0, "error": f"exit {run.returncode}: {run.stderr[-300:]}"}
    return json.loads(lines[-1])


def check(name: str, device, max_memory: str, steps: int) -> Dict[str, Any]:
    """One row: the probe held to ``max_memory``, then the answer and the answer + 1 in fresh processes."""
    from adaptive_batch.memory.device import parse_memory
    from adaptive_batch.memory.oom import release_memory

    limit = int(parse_memory(max_memory))
    hold_card_to(device, limit)
    lines: List[str] = []
    t0 = time.perf_counter()
    found, margin = probe(name, device, max_memory, lines)
    seconds = time.perf_counter() - t0
    release_memory(device)
    hold_card_to(device, 1 << 62)
    budget = int(limit * (1 - margin))
    trials = [line for line in lines if line.startswith("probe trial")]
    row = {"model": name, "max_memory": max_memory, "budget_bytes": budget, "found": found, "probe_seconds": seconds,
           "trial_steps": len(trials), "oom_trials": sum("out of memory" in t for t in trials), "lines": lines}
    if device.type == "cuda":
        row["trained"] = train_fresh(name, found, steps, budget, str(device))
        row["over"] = train_fresh(name, found + 1, 10, budget, str(device))
    else:
        row["trained"] = train(name, found, steps, None, str(device))
    return row


def cells(row: Dict[str, Any]) -> List[str]:
    from adaptive_batch.memory.device import format_bytes

    trained, over = row["trained"], row.get("over")
    return [
        row["model"], row["max_memory"], format_bytes(row["budget_bytes"]), str(row["found"]), str(row["trial_steps"]),
        str(row["oom_trials"]), f"{row['probe_seconds']:.1f}",
        f"{'yes' if trained['error'] is None else 'no: ' + trained['error'][:40]} ({trained['steps_run']})",
        "n/a (no CUDA)" if over is None else (f"OOMs (step {over['steps_run'] + 1})" if over["error"] == "OOM"
                                               else f"no: {over['error'] or 'ran'} ({over['steps_run']})"),
        format_bytes(trained.get("allocated_peak")), format_bytes(trained.get("reserved_peak")),
    ]


def markdown(rows: List[Dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cells(row)) + " |" for row in rows])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--max-memory", default="2GiB", help="comma-separated budgets, each a card of that size")
    parser.add_argument("--steps", type=int, default=50, help="training steps at the answer in a fresh process")
    parser.add_argument("--out", default="outputs/gpu_zoo", help="where each row's JSON goes")
    parser.add_argument("--train", nargs=5, help=argparse.SUPPRESS)  # name batch steps limit device
    args = parser.parse_args(argv)
    if args.train:
        name, batch, steps, limit, device = args.train
        print(json.dumps(train(name, int(batch), int(steps), int(limit), device)))
        return 0
    import torch

    device = card_or_none(args.device, "gpu-zoo")
    if device is None:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        for max_memory in args.max_memory.split(","):
            t0 = time.perf_counter()
            try:
                row = check(name, device, max_memory, args.steps)
            except Exception as e:  # noqa: BLE001 - one model's failure must not cost the others' rows
                print(f"{name} max_memory={max_memory}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            rows.append(row)
            (out / f"{name}_{max_memory}.json").write_text(json.dumps(row, indent=1))
            print(f"{name} {max_memory}: {time.perf_counter() - t0:.1f}s | {' | '.join(cells(row))}",
                  file=sys.stderr, flush=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(f"On {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}:\n\n{markdown(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
