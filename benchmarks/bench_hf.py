"""Largest-batch finders on a Hugging Face model, side by side under one real memory limit.

Each method runs in a fresh process that imports the same packages, builds a random-init
transformers Llama (4 layers, dim 512, the given vocabulary, sequence 512, AdamW), then sets
RLIMIT_AS to the process's size plus the headroom (as ``prlimit --as`` would):

- ``ours``: :class:`adaptive_batch.hf.AdaptiveBatchTrainer` (one probe, then the effective
  batch of 64 in the fewest micro-batches that fit, uneven where it must be);
- ``trainer_auto``: ``TrainingArguments(auto_find_batch_size=True)`` (Accelerate's
  ``find_executable_batch_size`` around the whole training loop; it keeps the accumulation
  steps, so the effective batch falls with the batch);
- ``accelerate``: ``find_executable_batch_size(starting_batch_size=64)`` around one step (-10%
  per out-of-memory error);
- ``lightning_ours``: :func:`adaptive_batch.lightning.find_batch_size` (``AdaptiveBatchFinder``
  in the place of ``BatchSizeFinder``; no ``build=``, so its trials run in the process);
- ``lightning_power``, ``lightning_binsearch``: Lightning's ``Tuner.scale_batch_size`` (3 steps
  per trial, from 2).

Every process runs with the glibc options :class:`AdaptiveBatchTrainer` sets for its own
training under a limit (``M_MMAP_THRESHOLD`` 256 KiB, ``M_ARENA_MAX`` 1), so the methods and
the truth share one allocator. Each method is judged against the step it then trains: a method
that trains its answer as the whole step (the peers: one micro-batch, no accumulation) against the
largest batch a plain ``Trainer`` trains 10 steps with in a fresh process under the same limit; one
that trains the effective batch in accumulated micro-batches (ours: the first micro-batch's
gradients alive through the next) against the largest micro-batch a plain ``Trainer`` trains 10
steps with at 2 accumulated micro-batches a step. Each truth is found by walking from the first
answer judged by it, and each method's training (its micro-batch and accumulation, as it trains
them) runs 10 steps in a fresh process the same way.

    make bench-hf                                       # the 32K row: docs/benchmarks.md
    python benchmarks/bench_hf.py --vocab 128256 --headroom 6GiB
"""

import argparse
import json
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile
import time

from limits import limit_address_space
from readme_table import write_readme_table

REPO = Path(__file__).resolve().parents[1]
SEQ, EFFECTIVE = 512, 64
LIMITED_AT = [0.0]  # when the limit was set: each method's search is timed from there
METHODS = ["ours", "trainer_auto", "accelerate", "lightning_ours", "lightning_power", "lightning_binsearch"]


# ----------------------------------------------------------------------------- worker side
def _model(vocab: int):
    import accelerate  # noqa: F401  (every worker imports the same packages, so all start the same size)
    import lightning  # noqa: F401
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (256, SEQ))]
    return model, data


def _limit() -> None:
    # every method, and the truth, on the allocator ours trains with
    limit_address_space(int(os.environ["BENCH_HEADROOM"]), recipe_allocator=True)
    LIMITED_AT[0] = time.perf_counter()


def _since_limit() -> float:
    return time.perf_counter() - LIMITED_AT[0]


def _trainer(kind: str, vocab: int, out: str, per_device: int, steps: int):
    from transformers import Trainer, TrainingArguments

    from adaptive_batch.hf import AdaptiveBatchTrainer

    model, data = _model(vocab)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=EFFECTIVE // per_device,
        max_steps=steps, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no",
        auto_find_batch_size=kind == "trainer_auto", optim="adamw_torch",
    )
    _limit()
    if kind == "ours":
        lines = []

        def log(line):
            lines.append(line)
            if line.startswith("adaptive-batch (probed)"):  # the answer, before the step of 64
                lines.append(f"search_s {_since_limit()}")

        return AdaptiveBatchTrainer(model=model, args=args, train_dataset=data, max_memory=None, log=log), lines
    return Trainer(model=model, args=args, train_dataset=data), None


def _truth(vocab: int, out: str, batch: int, accumulation: int) -> dict:
    trainer, _ = _trainer("plain", vocab, out, batch, 10)
    trainer.args.gradient_accumulation_steps = accumulation  # 10 optimizer steps of that many micro-batches
    try:
        trainer.train()
    except RuntimeError as e:
        if "can't allocate memory" not in str(e):
            raise
        return {"trains": False}
    return {"trains": True}


def _trainers(kind: str, vocab: int, out: str) -> dict:
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
        state = trainer.adaptive_batch
        # Trials in fresh processes: the first guess's steps run in one more, counted in a line of its own.
        guess_steps = first_guess_steps(lines)
        return {"found": state["max_micro_batch_size"], "trial_steps": len(trials) + guess_steps,
                "oom_trials": sum("out of memory" in line for line in trials),
                "micro": state["per_device_train_batch_size"], "accumulation": state["gradient_accumulation_steps"],
                "effective": state["effective_batch_size"],
                "search_s": float(next(line for line in lines if line.startswith("search_s")).split()[1])}
    # auto_find_batch_size lowers the per-device batch and keeps the accumulation steps (1 here);
    # its answer is known when the step at it has run, the end of train() here
    return {"found": tries[-1], "trial_steps": len(tries), "oom_trials": len(tries) - 1,
            "micro": tries[-1], "accumulation": trainer.args.gradient_accumulation_steps, "search_s": _since_limit()}


def first_guess_steps(lines) -> int:
    """The real steps of the first guess in a fresh process, as its log line counts them."""
    for line in lines:
        m = re.search(r"the tensor bytes of (\d+) steps at batch", line)
        if m:
            return int(m.group(1))
    return 0


def _plain_step(model, optimizer):
    def step(batch):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _accelerate(vocab: int) -> dict:
    import torch
    from accelerate.utils import find_executable_batch_size

    model, data = _model(vocab)
    step = _plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False))
    sample = {k: v.unsqueeze(0) for k, v in data[0].items()}
    tries = []
    _limit()

    @find_executable_batch_size(starting_batch_size=EFFECTIVE)
    def find(batch_size):
        tries.append(batch_size)
        step({k: v.expand(batch_size, -1).contiguous() for k, v in sample.items()})
        return batch_size

    found = find()
    return {"found": found, "trial_steps": len(tries), "oom_trials": len(tries) - 1, "micro": found,
            "accumulation": 1, "search_s": _since_limit()}


def _lightning(vocab: int, mode: str, out: str) -> dict:
    import lightning as L
    from lightning.pytorch.tuner import Tuner, batch_size_scaling
    import torch

    model, data = _model(vocab)
    counts = {"steps": 0, "oom": 0}
    is_oom = batch_size_scaling.is_oom_error

    def counted_oom(exc):  # the tuner's own test, counted
        oom = is_oom(exc)
        counts["oom"] += oom
        return oom

    batch_size_scaling.is_oom_error = counted_oom

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.batch_size = model, 2

        def training_step(self, batch, _index):
            counts["steps"] += 1
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=False)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    _limit()
    if mode == "ours":  # AdaptiveBatchFinder through its Tuner-style function, with no build=
        from adaptive_batch.lightning import find_batch_size

        lines = []
        found = find_batch_size(trainer, Module(), max_memory=None, log=lines.append)
        trials = [line for line in lines if line.startswith("probe trial")]
        counts["oom"] = sum("out of memory" in line for line in trials)
    else:
        found = int(Tuner(trainer).scale_batch_size(Module(), mode=mode, init_val=2, max_trials=25))
    return {"found": found, "trial_steps": counts["steps"], "oom_trials": counts["oom"], "micro": found,
            "accumulation": 1, "search_s": _since_limit()}


def worker(kind: str, vocab: int, batch: int, accumulation: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        if kind == "truth":
            return _truth(vocab, out, batch, accumulation)
        if kind == "accelerate":
            return _accelerate(vocab)
        if kind.startswith("lightning_"):
            return _lightning(vocab, kind.split("_", 1)[1], out)
        return _trainers(kind, vocab, out)


# ----------------------------------------------------------------------------- driver side
def _spawn(kind: str, vocab: int, headroom: int, batch: int = 0, accumulation: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), BENCH_HEADROOM=str(headroom))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--vocab", str(vocab), "--batch", str(batch),
                           "--accumulation", str(accumulation)],
                          capture_output=True, text=True, env=env, timeout=3600)
    m = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if not m:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(m.group(1)), seconds=time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--headroom", default="2.5GiB")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.vocab, args.batch, args.accumulation)), flush=True)
        return
    from adaptive_batch import parse_memory

    headroom = parse_memory(args.headroom, key="--headroom")
    rows = {}
    for kind in args.methods.split(","):
        rows[kind] = _spawn(kind, args.vocab, headroom)
        print(kind, rows[kind], flush=True)
    trains = {}  # (micro-batch, accumulation) -> whether it trains 10 steps in a fresh process

    def fresh(batch: int, accumulation: int) -> bool:
        # Past the second micro-batch no more gradients are alive: 2 stands for any accumulation.
        key = (batch, min(accumulation, 2))
        if key not in trains:
            trains[key] = batch >= 1 and _spawn("truth", args.vocab, headroom, *key)["trains"]
            print(f"truth {key}: {trains[key]}", flush=True)
        return trains[key]

    def truth(step: int) -> int:
        """The largest micro-batch that trains at ``step`` micro-batches a step, walked from the
        first answer of a method that trains that way."""
        largest = next(row["found"] for row in rows.values() if min(row["accumulation"], 2) == step)
        if fresh(largest, step):
            while fresh(largest + 1, step):
                largest += 1
            return largest
        while largest > 1 and not fresh(largest - 1, step):
            largest -= 1
        return largest - 1

    truths = {step: truth(step) for step in sorted({min(row["accumulation"], 2) for row in rows.values()})}
    first = next(iter(rows))
    said = "; ".join(f"**{t}** {'as the whole step' if step == 1 else 'in accumulated micro-batches'}"
                     for step, t in truths.items())
    lines = [
        f"Random-init transformers Llama (4 layers, dim 512, vocabulary {args.vocab:,}), sequence {SEQ}, AdamW, fp32, "
        f"under {args.headroom} of address space over each process's size (RLIMIT_AS); each method asked for an "
        f"effective batch of {EFFECTIVE}. True maximum micro-batch (the largest that trains 10 steps in a fresh "
        f"process, as the method then trains it): {said}.",
        "",
        "| method | found | trains as (micro-batches x size) | effective batch trained | true max for that step | found/true "
        f"| trains 10 steps (fresh) | trial steps | OOM trials | search s | search s / {first}'s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in rows.items():
        step, micro, accumulation = min(row["accumulation"], 2), row["micro"], row["accumulation"]
        from adaptive_batch.hf.micro_batches import describe_micro_batches

        effective = row.get("effective", micro * accumulation)
        lines.append(f"| {kind} | {row['found']} | {describe_micro_batches(effective, micro)} | {effective} | {truths[step]} | "
                     f"{row['found'] / max(truths[step], 1):.3f} | {'yes' if fresh(micro, accumulation) else 'no'} | "
                     f"{row['trial_steps']} | {row['oom_trials']} | {row['search_s']:.0f} | "
                     f"{row['search_s'] / rows[first]['search_s']:.2f} |")
    lines += ["", f"Made by `python benchmarks/bench_hf.py --vocab {args.vocab} --headroom {args.headroom}` on "
              f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores; search s: from the limit to the answer (ours: "
              "the probe and its consecutive-step check; the peers: until their search returns, the Trainer's after its "
              "step at its answer)."]
    table = "\n".join(lines)
    print(table)
    write_readme_table(f"bench_hf_{args.vocab}", table)


if __name__ == "__main__":
    main()
