"""Does the answer hold on models the recipes do not have? The zoo, under a soft and a hard budget.

Each row probes in several fresh processes (the answer must not depend on the process), and is
judged against a truth measured by tools that are not ours:

- soft (``max_memory``): torch's ``MemTracker`` on the same step (for the Trainer, on its own
  accumulated loop at the worst-case length): the largest batch whose tracked peak is within the
  budget less the 1% margin (``benchmarks/truth.py``).
- hard (an outside ``RLIMIT_AS`` of the process's size plus a headroom, as ``prlimit --as``):
  the largest batch that trains ``--steps`` steps in each of 2 fresh processes under the same
  limit, on the glibc settings the probe leaves its caller with, the answer + 1 failing there.

    python benchmarks/bench_zoo.py                   # the table in docs/probe.md (about 30 minutes)
    python benchmarks/bench_zoo.py --rows 0,1 --processes 2
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from limits import limit_address_space
from readme_table import write_readme_table

# (model, method, budget kind, budget: max_memory for soft, GiB of headroom for hard)
ROWS = [
    ("mlp", "find_max_batch_size", "soft", "96MiB"),
    ("mlp", "find_max_batch_size", "hard", 1.0),
    ("convnet", "find_max_batch_size", "soft", "256MiB"),
    ("convnet", "find_max_batch_size", "hard", 1.0),
    ("convnet", "AdaptiveBatch", "soft", "120MiB"),
    ("llama128k", "find_max_batch_size", "soft", "2GiB"),
    ("llama128k", "find_max_batch_size", "hard", 2.5),
    ("bert", "find_max_batch_size", "soft", "512MiB"),
    ("bert", "find_max_batch_size", "hard", 1.5),
    ("hf-llama", "AdaptiveBatchTrainer", "soft", "24MiB"),
    ("hf-llama8k", "AdaptiveBatchTrainer", "hard", 1.5),
    # Added after the table below was last made whole (docs/probe.md has their first rows).
    ("lstm", "find_max_batch_size", "soft", "256MiB"),
    ("lstm", "find_max_batch_size", "hard", 1.0),
    ("vit", "find_max_batch_size", "soft", "256MiB"),
    ("vit", "find_max_batch_size", "hard", 1.0),
    ("t5", "find_max_batch_size", "soft", "512MiB"),
    ("t5", "find_max_batch_size", "hard", 1.0),
    ("audio-conv", "find_max_batch_size", "soft", "256MiB"),
    ("audio-conv", "find_max_batch_size", "hard", 1.0),
]
# The Trainer's models: (vocabulary, hidden, intermediate, layers, heads, shortest and longest sample).
TRAINER_MODELS = {"hf-llama": (512, 128, 256, 2, 4, 32, 64), "hf-llama8k": (8192, 256, 688, 4, 4, 32, 512)}
MARGIN = 0.01  # the CPU's default safety margin: the budget the truth is held to


def _trainer_parts(model: str, max_length: int, cls, **kwargs):
    """A random-init Llama of :data:`TRAINER_MODELS` in the Trainer: ``samples`` (64) of uneven
    lengths (the longest among them) through a padding collator (``max_length`` pins the samples
    to it and one token less for the truth: every batch the longest, padded), an effective batch of 32 (16 x 2, or ``per_device`` x 2), ``steps``
    steps, on the CPU in fp32 unless ``training`` (TrainingArguments' keywords) says otherwise."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "adaptive_batch", "hf"))
    from test_trainer import ByteCollator

    vocab, hidden, intermediate, layers, heads, shortest, longest = TRAINER_MODELS[model]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=longest)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (kwargs.pop("samples", 64),), generator=generator).tolist()
    lengths[7] = longest
    # Pinned: every other sample one token short, so each batch is padded as real ones are.
    samples = [{"input_ids": torch.randint(1, vocab, (max_length - i % 2 if max_length else n,),
                                           generator=generator).tolist()} for i, n in enumerate(lengths)]
    training = {"use_cpu": True, **kwargs.pop("training", {})}
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=kwargs.pop("per_device", 16),
                             gradient_accumulation_steps=2, max_steps=kwargs.pop("steps", 2), learning_rate=1e-3,
                             report_to=[], disable_tqdm=True, save_strategy="no", logging_strategy="no", **training)
    return cls(model=LlamaForCausalLM(config), args=args, train_dataset=samples, data_collator=ByteCollator(), **kwargs)


def probe(row: int) -> dict:
    """One fresh process's answer, its trial steps and out-of-memory trials."""
    model, method, kind, budget = ROWS[row]
    lines = []
    start = time.perf_counter()
    if method == "AdaptiveBatchTrainer":
        from adaptive_batch.hf import AdaptiveBatchTrainer

        trainer = _trainer_parts(model, 0, AdaptiveBatchTrainer, max_memory=budget if kind == "soft" else None,
                                 probe_eval=False, log=lines.append)
        if kind == "hard":  # glibc's defaults, as a user's script has them: the Trainer sets its own
            limit_address_space(int(budget * 2**30), recipe_allocator=False)
        start = time.perf_counter()
        trainer.train()  # the probe, then training's own steps at the answer
        found = trainer.adaptive_batch["max_micro_batch_size"]
    else:
        from zoo_models import BUILDERS

        from adaptive_batch import AdaptiveBatch, find_max_batch_size

        target = BUILDERS[model]()
        if kind == "hard":
            limit_address_space(int(budget * 2**30), recipe_allocator=False)
        start = time.perf_counter()
        if method == "AdaptiveBatch":
            found = _adaptive_batch_answer(target, budget, lines)
        else:
            found = find_max_batch_size(
                target.train_step, make_batch=target.make_batch, model=target.model, optimizer=target.optimizer,
                max_memory=budget if kind == "soft" else None, log=lines.append,
                build=BUILDERS[model] if kind == "hard" else None,
            )
    trials = [line for line in lines if line.startswith("probe trial")]
    return {"found": found, "trials": len(trials), "oom_trials": sum("out of memory" in t for t in trials),
            "seconds": time.perf_counter() - start}


def _adaptive_batch_answer(target, budget, lines) -> int:
    from adaptive_batch import AdaptiveBatch

    samples = [target.make_batch(1) for _ in range(4096)]
    samples = [{k: v[0] for k, v in s.items()} for s in samples]
    model = target.model
    import torch.nn.functional as F

    adaptive = AdaptiveBatch(model, target.optimizer, samples, lambda b: F.cross_entropy(model(b["x"]), b["y"]),
                             batch_size=1, make_batch=target.make_batch, use_maximum_batch_size=True,
                             max_memory=budget, probe_cache=False, log=lines.append, shuffle=False)
    adaptive.batches(0)
    return adaptive.controller.probe_report.batch_size


def soft_truth(row: int) -> int:
    """MemTracker's largest batch within the budget less the margin."""
    import torch

    from truth import memtracker_max_batch_size

    from adaptive_batch.memory.device import parse_memory

    model, method, _, budget = ROWS[row]
    budget_bytes = int(parse_memory(budget) * (1 - MARGIN))
    if method == "AdaptiveBatchTrainer":
        return _trainer_truth(budget_bytes)
    from zoo_models import BUILDERS

    target = BUILDERS[model]()
    return memtracker_max_batch_size(target.train_step, target.make_batch, model=target.model,
                                     optimizer=target.optimizer, budget_bytes=budget_bytes, upper=1 << 14,
                                     device=torch.device("cpu"))


def _trainer_truth(budget_bytes: int) -> int:
    """The largest micro-batch whose Trainer loop (2 accumulated micro-batches a step, the
    samples 64 and 63 tokens: every batch padded to the longest) MemTracker keeps within the budget."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import Trainer

    tracker = None

    class Tracked(Trainer):
        def training_step(self, *args, **kwargs):  # MemTracker measures one forward at a time
            tracker.reset_mod_stats()
            return super().training_step(*args, **kwargs)

    def fits(b: int) -> bool:
        nonlocal tracker
        trainer = _trainer_parts("hf-llama", 64, Tracked, per_device=b)
        tracker = MemTracker()
        tracker.track_external(trainer.model)
        with tracker:
            trainer.train()
        return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()) <= budget_bytes

    b = 1
    while fits(b + 1):
        b += 1
    return b


def trains(row: int, batch_size: int, steps: int) -> dict:
    """Whether ``batch_size`` trains ``steps`` steps in this fresh process under the row's limit."""
    from zoo_models import BUILDERS

    from adaptive_batch import is_oom_error

    model, method, _, headroom = ROWS[row]
    if method == "AdaptiveBatchTrainer":
        return _trainer_trains(model, headroom, batch_size, steps)
    target = BUILDERS[model]()
    # the process as find_max_batch_size leaves its caller under a hard limit: the recipes' glibc settings
    limit_address_space(int(headroom * 2**30), recipe_allocator=True)
    for step in range(steps):
        try:
            target.train_step(target.make_batch(batch_size))
        except Exception as e:  # noqa: BLE001
            if not is_oom_error(e, after_a_smaller_step=True):
                raise
            return {"trains": False, "failed_at": step + 1}
    return {"trains": True}


def _trainer_trains(model: str, headroom: float, batch_size: int, steps: int) -> dict:
    """A plain ``Trainer`` at ``batch_size`` x 2 accumulated micro-batches, every batch padded to
    the longest length, ``steps`` steps, on the glibc settings ``AdaptiveBatchTrainer`` trains with."""
    from transformers import Trainer

    from adaptive_batch import is_oom_error

    trainer = _trainer_parts(model, TRAINER_MODELS[model][-1], Trainer, per_device=batch_size, steps=steps)
    limit_address_space(int(headroom * 2**30), recipe_allocator=True)
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001
        if not is_oom_error(e, after_a_smaller_step=True):
            raise
        return {"trains": False, "failed_at": int(trainer.state.global_step) + 1}
    return {"trains": True}


def _run(*args) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", *map(str, args)], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-400:], "returncode": proc.returncode}
    return json.loads(lines[-1][len("RESULT "):])


def hard_truth(row: int, found: int, steps: int) -> int:
    """The largest size that trains in each of 2 fresh processes: from ``found``, strides that
    double away from it until the outcome changes, then a bisection."""
    def trains_twice(b: int) -> bool:
        return all(_run("trains", row, b, steps).get("trains") for _ in range(2))

    good, bad, stride = (found, None, 1) if trains_twice(found) else (None, found, 1)
    while good is None or bad is None:
        if bad is None:
            b = good + stride
            good, bad = (b, None) if trains_twice(b) else (good, b)
        else:
            b = max(1, bad - stride)
            good, bad = (b, bad) if trains_twice(b) else (None, b)
            if good is None and b == 1:
                return 0
        stride *= 2
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if trains_twice(middle) else (good, middle)
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(str(i) for i in range(len(ROWS))))
    parser.add_argument("--processes", type=int, default=5, help="fresh processes that probe each row")
    parser.add_argument("--steps", type=int, default=10, help="steps a hard row's truth trains")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, *rest = args.worker
        result = {"probe": lambda: probe(int(rest[0])), "soft_truth": lambda: {"truth": soft_truth(int(rest[0]))},
                  "trains": lambda: trains(int(rest[0]), int(rest[1]), int(rest[2]))}[mode]()
        print("RESULT " + json.dumps(result), flush=True)
        return
    header = ("| model | method | budget | found | truth | found/true | trial steps | OOM trials | "
              f"answers of {args.processes} fresh processes | probe s |")
    rows = [header, "|" + "---|" * 10]
    print(header, flush=True)
    for index in (int(i) for i in args.rows.split(",")):
        model, method, kind, budget = ROWS[index]
        runs = [_run("probe", index) for _ in range(args.processes)]
        ok = [r for r in runs if "found" in r]
        if not ok:
            line = f"| {model} | {method} | {kind} | error: {runs[0].get('error', '')[-120:]!r} |"
        else:
            first = ok[0]
            truth = (_run("soft_truth", index).get("truth") if kind == "soft"
                     else hard_truth(index, first["found"], args.steps))
            label = f"{kind} {budget}" if kind == "soft" else f"hard +{budget:g} GiB"
            ratio = "-" if not truth else f"{first['found'] / truth:.3f}"
            answers = ", ".join(str(r.get("found", "crash")) for r in runs)
            line = (f"| {model} | {method} | {label} | {first['found']} | {truth} | {ratio} | {first['trials']} | "
                    f"{first['oom_trials']} | {answers} | {first['seconds']:.1f} |")
        rows.append(line)
        print(line, flush=True)
    if args.rows == parser.get_default("rows") and args.processes == 5:
        write_readme_table("zoo-table", "\n".join(rows))


if __name__ == "__main__":
    main()
