"""Hugging Face's Trainer beside ours, under one real process memory limit.

Each method runs in a fresh process: a random-init transformers Llama (4 layers, dim 512, the
given vocabulary, sequence 512, AdamW), then RLIMIT_AS set to the process's size plus the
headroom (as ``prlimit --as`` would), then ``Trainer.train()`` for one optimizer step of an
effective batch of 64:

- ``trainer_auto``: ``TrainingArguments(auto_find_batch_size=True)`` (Accelerate's
  ``find_executable_batch_size``: the whole step again at 90% after each out-of-memory error);
- ``ours``: :class:`adaptive_batch.hf.AdaptiveBatchTrainer` (one probe, then 64 in the fewest
  equal micro-batches that fit).

The true maximum is the largest micro-batch whose training steps run in a fresh process under
the same limit, found by walking from ours. ``trains`` is whether each method's batch then
trains 10 steps in a fresh process.

    python benchmarks/bench_hf.py                     # the 32K row: docs/benchmarks.md
    python benchmarks/bench_hf.py --vocab 128256 --headroom 4GiB
"""

import argparse
import json
import os
from pathlib import Path
import re
import resource
import subprocess
import sys
import tempfile
import time

from readme_table import write_readme_table

REPO = Path(__file__).resolve().parents[1]
SEQ, EFFECTIVE = 512, 64


def _trainer(kind: str, vocab: int, out: str, per_device: int, steps: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from adaptive_batch.hf import AdaptiveBatchTrainer
    from adaptive_batch.memory.device import proc_status_bytes

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (256, SEQ))]
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=EFFECTIVE // per_device,
        max_steps=steps, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no",
        auto_find_batch_size=kind == "trainer_auto", optim="adamw_torch",
    )
    limit = proc_status_bytes("VmSize") + int(os.environ["BENCH_HEADROOM"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    if kind == "ours":
        lines = []
        return AdaptiveBatchTrainer(model=model, args=args, train_dataset=data, max_memory=None, log=lines.append), lines
    return Trainer(model=model, args=args, train_dataset=data), None


def worker(kind: str, vocab: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        if kind == "truth":  # ``batch`` per micro-batch, plain Trainer, 10 optimizer steps of one micro-batch
            trainer, _ = _trainer("plain", vocab, out, batch, 10)
            trainer.args.gradient_accumulation_steps = 1
            try:
                trainer.train()
            except RuntimeError as e:
                if "can't allocate memory" not in str(e):
                    raise
                return {"trains": False}
            return {"trains": True}
        trainer, lines = _trainer(kind, vocab, out, EFFECTIVE, 1)
        tries = []
        if kind == "trainer_auto":
            inner = trainer._inner_training_loop

            def counted(batch_size, *args, **kwargs):  # find_executable_batch_size passes it first
                tries.append(batch_size)
                return inner(batch_size, *args, **kwargs)

            trainer._inner_training_loop = counted
        trainer.train()
        if kind == "ours":
            trials = [line for line in lines if line.startswith("probe trial")]
            return {"found": trainer.adaptive_batch["max_micro_batch_size"], "trial_steps": len(trials),
                    "oom_trials": sum("out of memory" in line for line in trials), "effective": EFFECTIVE}
        # auto_find_batch_size lowers the per-device batch and keeps the accumulation steps (1 here)
        return {"found": tries[-1], "trial_steps": len(tries), "oom_trials": len(tries) - 1,
                "effective": tries[-1] * trainer.args.gradient_accumulation_steps}


def _spawn(kind: str, vocab: int, headroom: int, batch: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), BENCH_HEADROOM=str(headroom))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--vocab", str(vocab), "--batch", str(batch)],
                          capture_output=True, text=True, env=env, timeout=3600)
    m = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if not m:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(m.group(1)), seconds=time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--headroom", default="2.5GiB")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.vocab, args.batch)), flush=True)
        return
    from adaptive_batch import parse_memory

    headroom = parse_memory(args.headroom, key="--headroom")
    rows = {kind: _spawn(kind, args.vocab, headroom) for kind in ("ours", "trainer_auto")}
    for kind, row in rows.items():
        print(kind, row, flush=True)
    truth = rows["ours"]["found"]
    if _spawn("truth", args.vocab, headroom, truth)["trains"]:
        while _spawn("truth", args.vocab, headroom, truth + 1)["trains"]:
            truth += 1
    else:
        while truth > 1 and not _spawn("truth", args.vocab, headroom, truth - 1)["trains"]:
            truth -= 1
        truth -= 1
    lines = [
        f"Random-init transformers Llama (4 layers, dim 512, vocabulary {args.vocab:,}), sequence {SEQ}, AdamW, an "
        f"effective batch of {EFFECTIVE}, under {args.headroom} of address space over each process's size; "
        f"true maximum micro-batch **{truth}** (fresh processes, 10 steps).",
        "",
        "| method | found | found/true | trial steps | OOM trials | effective batch trained | seconds | seconds vs ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in rows.items():
        lines.append(f"| {kind} | {row['found']} | {row['found'] / truth:.3f} | {row['trial_steps']} | {row['oom_trials']} "
                     f"| {row['effective']} | {row['seconds']:.0f} | {row['seconds'] / rows['ours']['seconds']:.2f} |")
    lines += ["", f"Made by `python benchmarks/bench_hf.py --vocab {args.vocab} --headroom {args.headroom}` on "
              f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores; seconds include the process start and "
              "one optimizer step of the effective batch."]
    table = "\n".join(lines)
    print(table)
    write_readme_table(f"bench_hf_{args.vocab}", table)


if __name__ == "__main__":
    main()
