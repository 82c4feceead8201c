"""Largest-batch finders side by side, under one real process memory limit.

Each method runs in a fresh process that imports everything (torch, torchtune, Lightning,
Accelerate), builds the tiny config's model and optimizer, then sets RLIMIT_AS to its size plus
the same headroom. Allocations past it fail with the CPU allocator's real out-of-memory error,
which every method catches. Ground truth: the largest batch whose full-length training steps
really run under the limit, each size checked in a fresh process.

    make bench                      # or: python benchmarks/bench_probe.py --headroom 1.5GiB

Peers (optional extras, `pip install -e .[bench]`): Lightning's ``Tuner.scale_batch_size``
(``power`` and ``binsearch``, its default 3 steps per trial) and Accelerate's
``find_executable_batch_size`` (one step per try, starting at 128, -10% per OOM).
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
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
CONFIG = REPO / "configs/tiny/full_single_device.yaml"
METHODS = ["ours", "ours_margin0", "lightning_adaptive", "lightning_power", "lightning_binsearch", "accelerate",
           "double_then_bisect"]
DEVICE = os.environ.get("BENCH_PROBE_DEVICE", "cpu")  # the workers' device: cpu, or cuda (a card held to the headroom)


# ----------------------------------------------------------------------------- worker side
def _setup(seed: int = 0):
    import accelerate  # noqa: F401  (imported by every worker, so all start the same size)
    import lightning  # noqa: F401
    from omegaconf import OmegaConf
    import torch
    import torch.nn.functional as F
    from torchtune import config

    from adaptive_batch.probe.trials import worst_case_text_batch

    cfg = OmegaConf.load(os.environ.get("BENCH_PROBE_CONFIG", CONFIG))
    torch.manual_seed(seed)
    device = torch.device(DEVICE)
    model = config.instantiate(cfg.model).to(device)
    loss_fn = config.instantiate(cfg.loss)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    seq_len, vocab = cfg.tokenizer.max_seq_len, cfg.model.vocab_size

    def loss_of(batch):
        logits = model(batch["tokens"])
        labels = F.pad(batch["labels"][..., 1:], (0, 1), value=loss_fn.ignore_index)
        return loss_fn(logits, labels)

    def train_step(batch):
        loss_of(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def make_batch(b):
        return worst_case_text_batch(b, seq_len=seq_len, vocab_size=vocab, device=device)

    return model, opt, loss_of, train_step, make_batch, seq_len, vocab


def _limit(headroom: int) -> None:
    """On the CPU, ``headroom`` over the process's size; on a card, the card held to ``headroom`` in
    all (``set_per_process_memory_fraction``), as a card of that size."""
    if DEVICE == "cpu":
        limit_address_space(headroom, recipe_allocator=True)  # the same allocator settings for every method
        return
    from gpu_check import hold_card_to
    import torch

    hold_card_to(torch.device(DEVICE), headroom)


def _run_ours(headroom: int, margin: float) -> dict:
    import torch

    from adaptive_batch.memory.device import device_capacity
    from adaptive_batch.memory.budget import memory_budget, training_state_bytes
    from adaptive_batch.probe.target import ProbeTarget
    from adaptive_batch.probe.trials import probe_max_batch_size

    model, opt, _, train_step, make_batch, _, _ = _setup()
    _limit(headroom)
    if DEVICE != "cpu":
        return _run_ours_on_a_card(train_step, make_batch, model, opt, margin)
    budget = memory_budget(
        max_memory_bytes=None,
        capacity=device_capacity(torch.device("cpu")),
        live_bytes=training_state_bytes(model, opt),
        safety_margin=margin,
    )
    with tempfile.TemporaryDirectory() as d:
        target = ProbeTarget(train_step, make_batch, model, opt, torch.device("cpu"))
        result = probe_max_batch_size(target, budget_bytes=budget.budget_bytes, snapshot_dir=d)
    search = [t for t in result.trials if t.phase == "search"]
    return {
        "found": result.max_batch_size,
        "trial_steps": result.num_trials,
        "predicted": result.predicted_max_batch_size,
        "first_search": search[0].batch_size if search else None,
        "failed_trials": sum(not t.fits for t in result.trials),
        "max_overshoot": result.max_overshoot,
        "estimate": type(result.estimate).__name__,
    }


def _run_ours_on_a_card(train_step, make_batch, model, opt, margin: float) -> dict:
    """``find_max_batch_size`` as a user calls it, its answer's consecutive-step check included."""
    import torch

    from adaptive_batch import find_max_batch_size

    steps = {"n": 0}

    def counted(batch):
        steps["n"] += 1
        train_step(batch)

    lines = []
    found = find_max_batch_size(counted, make_batch=make_batch, model=model, optimizer=opt, max_memory=None,
                                safety_margin=margin, device=torch.device(DEVICE), log=lines.append)
    print("\n".join(lines), flush=True)
    return {"found": found, "trial_steps": steps["n"]}


def _run_double_then_bisect(headroom: int) -> dict:
    """NeMo's OOMptimizer's search, one step per try: double from 1 until a try runs out of memory,
    then bisect between the last that trained and the first that did not."""
    from adaptive_batch import is_oom_error
    from adaptive_batch.memory.oom import release_memory

    _, opt, _, train_step, make_batch, _, _ = _setup()
    steps = {"n": 0}
    _limit(headroom)

    def trains(b: int) -> bool:
        steps["n"] += 1
        try:
            train_step(make_batch(b))
            return True
        except RuntimeError as e:
            if not is_oom_error(e):
                raise
            opt.zero_grad(set_to_none=True)
            release_memory()
            return False

    good, bad = 0, 1
    while trains(bad):
        good, bad = bad, bad * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if trains(mid) else (good, mid)
    return {"found": good, "trial_steps": steps["n"]}


def _run_lightning(headroom: int, mode: str) -> dict:
    """Lightning's ``BatchSizeFinder`` (``mode``: power or binsearch), or ours in its place
    (``mode="adaptive"``: ``adaptive_batch.lightning.find_batch_size``), on the same module."""
    import lightning as L
    from lightning.pytorch.tuner import Tuner
    import torch

    from adaptive_batch.lightning import find_batch_size

    model, opt, loss_of, _, make_batch, seq_len, vocab = _setup()
    steps = {"n": 0}

    class WorstCase(torch.utils.data.Dataset):
        def __len__(self):
            return 1_000_000

        def __getitem__(self, i):
            t = torch.randint(0, vocab, (seq_len,), generator=torch.Generator().manual_seed(i))
            return {"tokens": t, "labels": t.clone()}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.batch_size = 2

        def training_step(self, batch, _idx):
            steps["n"] += 1
            return loss_of(batch)

        def configure_optimizers(self):
            return opt

        def train_dataloader(self):
            return torch.utils.data.DataLoader(WorstCase(), batch_size=self.batch_size)

    with tempfile.TemporaryDirectory() as d:
        trainer = L.Trainer(
            accelerator="cpu" if DEVICE == "cpu" else "gpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=d,
        )
        _limit(headroom)
        if mode == "adaptive":
            found = find_batch_size(trainer, Module(), max_memory=None)
        else:
            found = Tuner(trainer).scale_batch_size(Module(), mode=mode, init_val=2, max_trials=25)
    return {"found": int(found), "trial_steps": steps["n"]}


def _run_accelerate(headroom: int) -> dict:
    from accelerate.utils import find_executable_batch_size

    _, _, _, train_step, make_batch, _, _ = _setup()
    steps = {"n": 0}
    _limit(headroom)

    @find_executable_batch_size(starting_batch_size=128)
    def find(batch_size):
        steps["n"] += 1
        train_step(make_batch(batch_size))
        return batch_size

    return {"found": find(), "trial_steps": steps["n"]}


def _run_truth(headroom: int, batch_size: int, steps: int) -> dict:
    from adaptive_batch import is_oom_error

    _, _, _, train_step, make_batch, _, _ = _setup()
    _limit(headroom)
    try:
        for _ in range(steps):
            train_step(make_batch(batch_size))
    except RuntimeError as e:
        if not is_oom_error(e):
            raise
        return {"trains": False}
    return {"trains": True}


def worker(args) -> None:
    t0 = time.perf_counter()
    if args.worker == "ours":
        out = _run_ours(args.headroom, margin=0.01)
    elif args.worker == "ours_margin0":
        out = _run_ours(args.headroom, margin=0.0)
    elif args.worker.startswith("lightning_"):
        out = _run_lightning(args.headroom, args.worker.split("_", 1)[1])
    elif args.worker == "accelerate":
        out = _run_accelerate(args.headroom)
    elif args.worker == "double_then_bisect":
        out = _run_double_then_bisect(args.headroom)
    else:
        out = _run_truth(args.headroom, args.batch_size, args.truth_steps)
    out["seconds"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- driver side
def _parse_size(text: str) -> int:
    from adaptive_batch import parse_memory

    return parse_memory(text, key="--headroom")


def _spawn(args, worker_name, batch_size=0) -> dict:
    cmd = [
        sys.executable, __file__, "--worker", worker_name, "--headroom", str(args.headroom),
        "--batch-size", str(batch_size), "--truth-steps", str(args.truth_steps),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               BENCH_PROBE_CONFIG=str(args.config), BENCH_PROBE_DEVICE=args.device)
    if args.device != "cpu":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # training's allocator settings, for every method
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    m = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if not m:
        raise RuntimeError(f"{worker_name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(m.group(1))


def _card_name(device: str) -> str:
    import torch

    return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"


def ground_truth(args, start: int) -> int:
    """Largest batch that trains ``truth_steps`` full-length steps, walking from ``start``."""
    if args.device != "cpu":
        return _ground_truth_at_once(args, start)
    if _spawn(args, "truth", start)["trains"]:
        b = start
        while _spawn(args, "truth", b + 1)["trains"]:
            b += 1
        return b
    b = start - 1
    while b > 0 and not _spawn(args, "truth", b)["trains"]:
        b -= 1
    return b


def _ground_truth_at_once(args, start: int, width: int = 4) -> int:
    """On a card the sizes around ``start`` run at once, each in a process holding its own share of
    the card (one at a time, a walk outlasted a 9-minute command); the window moves where the
    truth lies outside it. The answer: one below the smallest size that does not train."""
    low = max(1, start - width)
    while True:
        sizes = list(range(low, low + 2 * width + 1))
        with ThreadPoolExecutor(len(sizes)) as pool:
            trains = dict(zip(sizes, pool.map(lambda b: _spawn(args, "truth", b)["trains"], sizes)))
        if not trains[sizes[0]] and sizes[0] > 1:
            low = max(1, sizes[0] - 2 * width)
        elif trains[sizes[-1]]:
            low = sizes[-1]
        else:
            return next(b for b in sizes if not trains[b]) - 1


def render(rows, truth, args) -> str:
    from adaptive_batch.memory.device import format_bytes

    lightning_bin = next((r for r in rows if r["method"] == "lightning_binsearch"), None)
    held = (f"Headroom {format_bytes(args.headroom)} of address space over each process's size (RLIMIT_AS)"
            if args.device == "cpu" else
            f"The card held to {format_bytes(args.headroom)} in all (`set_per_process_memory_fraction`, expandable "
            f"segments) as a card of that size")
    lines = [
        f"{held}, `{Path(args.config).relative_to(REPO)}` ({args.describe}), seq_len 256, "
        f"AdamW, fp32, {args.device_name}. True max: **{truth}** (largest batch that trains "
        f"{args.truth_steps} full-length steps in a fresh process under the limit).",
        "",
        "| method | predicted | first search trial | found batch | found/true | trial steps | failed trials "
        "| largest trial peak / budget | steps vs Lightning binsearch | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = f"{r['trial_steps'] / lightning_bin['trial_steps']:.2f}" if lightning_bin else "-"
        overshoot = f"{r['max_overshoot']:.2f}" if r.get("max_overshoot") is not None else "-"
        lines.append(
            f"| {r['method']} | {r.get('predicted', '-')} | {r.get('first_search', '-')} | {r['found']} "
            f"| {r['found'] / truth:.3f} | {r['trial_steps']} | {r.get('failed_trials', '-')} | {overshoot} | {vs} "
            f"| {r['seconds']:.1f} |"
        )
    config_arg = "" if Path(args.config) == CONFIG else f" --config {Path(args.config).relative_to(REPO)}"
    device_arg = "" if args.device == "cpu" else f" --device {args.device}"
    lines += ["", f"Made by `python benchmarks/bench_probe.py --headroom {args.headroom_text}{config_arg}{device_arg}` "
              f"on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores. Failed trials: out of memory or "
              "over the budget; ours counts only its own trials, the peers report found sizes and steps. "
              "Largest trial peak / budget: ours bounds it to 1.25 (trials that ran out of memory have no peak)."
              + ("" if args.device == "cpu" else " On a card ours is `find_max_batch_size` as a user calls it: its "
                 "trial steps include its answer's 10 consecutive steps.")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headroom", default="1.5GiB")
    parser.add_argument("--config", default=str(CONFIG), help="a single-device config (default: the tiny one)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--truth-steps", type=int, default=3)
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu (a process memory limit), or cuda: the card held to "
                        "--headroom in all, ours through find_max_batch_size with its answer's check")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.headroom = int(args.headroom)
        worker(args)
        return
    args.headroom_text = args.headroom
    args.device_name = "CPU" if args.device == "cpu" else _card_name(args.device)
    args.headroom = _parse_size(args.headroom)
    args.config = str(Path(args.config).resolve())
    from omegaconf import OmegaConf

    model = OmegaConf.load(args.config).model
    args.describe = (
        f"{model._component_.rsplit('.', 1)[-1]} architecture, {model.num_layers} layers, dim {model.embed_dim}, "
        f"vocabulary {model.vocab_size:,}"
    )
    rows = []
    for method in args.methods.split(","):
        out = _spawn(args, method)
        out["method"] = method
        rows.append(out)
        print(f"{method}: {out}", flush=True)
    ours = next((r["found"] for r in rows if r["method"] == "ours"), rows[0]["found"])
    truth = ground_truth(args, ours)
    table = render(rows, truth, args)
    print(table)
    if not args.no_readme:
        name = "bench_probe" if Path(args.config) == CONFIG else f"bench_probe_{Path(args.config).stem}"
        write_readme_table(name, table)


if __name__ == "__main__":
    main()
