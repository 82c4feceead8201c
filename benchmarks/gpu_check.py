"""The CUDA paths on a real GPU: the probe against real CUDA out-of-memory errors, row by row.

For each row (a config with overrides: the tiny model, the 152K-vocabulary one full and LoRA, a
1B Llama 3.2 in bf16 with activation checkpointing off and on) and each budget (a small
``max_memory`` with no margin, then the whole card with the default margin):

1. the card is held to the budget's limit with ``torch.cuda.set_per_process_memory_fraction``,
   so a trial past it is a real CUDA OOM, and the probe (real steps) finds the largest batch;
2. a fresh process, with the allocator settings training uses (expandable segments), held to the
   budget, trains the found batch for ``--steps`` steps; it must run every one;
3. another fresh process, held the same way, must run out of memory at found + 1 within 10 steps;
4. the planner's prediction at the found batch (fake tensors, nothing allocated) is compared
   with the allocated peak of those training steps (their reserved peak beside it).

    make gpu-check                  # prints the table; ARGS=--readme writes it to the README

Every row is also written as JSON to ``--out`` (one file per row, the probe's trials included),
so a table fills over several short visits to a card. Without a CUDA device it says so and exits
0. ``--device cpu`` runs the same code on the CPU (no memory fraction, no fresh-process checks),
which is how the test suite keeps it working.
"""

import argparse
import json
import os
from pathlib import Path
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from readme_table import write_readme_table

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/tiny"
# name -> (config, overrides): the rows `--rows` picks from.
ROWS: Dict[str, Any] = {
    "tiny": (TINY / "full_single_device.yaml", {}),
    "152k": (TINY / "qwen2_5_vocab152k_full_single_device.yaml", {}),
    "152k-lora": (TINY / "qwen2_5_vocab152k_lora_single_device.yaml", {}),
    # Llama 3.2 1B's architecture with random weights, its 128K vocabulary and the byte tokenizer.
    "1b": (TINY / "llama3_2_vocab128k_full_single_device.yaml", {
        "model": {"_component_": "torchtune.models.llama3_2.llama3_2_1b"}, "dtype": "bf16",
        "tokenizer": {"max_seq_len": 2048}, "optimizer": {"fused": True}}),
    "1b-ac": (TINY / "llama3_2_vocab128k_full_single_device.yaml", {
        "model": {"_component_": "torchtune.models.llama3_2.llama3_2_1b"}, "dtype": "bf16",
        "tokenizer": {"max_seq_len": 2048}, "optimizer": {"fused": True},
        "enable_activation_checkpointing": True}),
}
COLUMNS = [
    "row", "vocab", "dtype", "AC", "max_memory", "budget", "found", "trial steps", "OOM trials",
    "probe s", "probe / epoch", "trains (steps)", "found+1 fresh", "alloc peak", "reserved peak",
    "planned peak", "plan error",
]


def load_config(name: str):
    from omegaconf import OmegaConf

    path, overrides = ROWS[name]
    cfg = OmegaConf.load(path)
    if "model" in overrides:  # a new model node, not the tiny one's keys merged into it
        cfg.model = OmegaConf.create(overrides["model"])
    return OmegaConf.merge(cfg, {k: v for k, v in overrides.items() if k != "model"})


def build(cfg, device):
    """The model, optimizer and one training step, as the recipes build them."""
    import torch
    from torchtune import config, modules, training
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from adaptive_batch.torchtune import next_token_loss

    dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=device)
    torch.manual_seed(0)
    with training.set_default_dtype(dtype), torch.device(device):
        model = config.instantiate(cfg.model)
    adapters = get_adapter_params(model)
    if adapters:
        set_trainable_params(model, adapters)
    if cfg.get("enable_activation_checkpointing", False):
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    loss_fn = config.instantiate(cfg.loss)
    if hasattr(loss_fn, "num_output_chunks"):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    optimizer = config.instantiate(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])

    def step(batch) -> None:
        next_token_loss(model, loss_fn, dict(batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, step


def make_batch_fn(cfg, model, device):
    from functools import partial

    from adaptive_batch.probe.trials import worst_case_text_batch

    return partial(worst_case_text_batch, seq_len=int(cfg.tokenizer.max_seq_len),
                   vocab_size=model.tok_embeddings.num_embeddings, device=device)


def hold_card_to(device, limit_bytes: Optional[int]) -> None:
    import torch

    if device.type == "cuda" and limit_bytes is not None:
        from adaptive_batch.memory.device import cuda_index

        index = cuda_index(device)
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), index)


def card_or_none(device_name: str, script: str):
    """The device to check on, with training's allocator settings (expandable segments, as the
    recipes turn them on before probing) on a card; ``None`` (said in a line) where ``cuda`` is
    asked for and this torch sees none."""
    import torch

    if device_name == "cuda" and not torch.cuda.is_available():
        print(f"{script}: no CUDA device here; nothing to check (exit 0).")
        return None
    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        from adaptive_batch.logs import lines_to
        from adaptive_batch.memory.device import use_expandable_segments

        with lines_to(print, print):
            use_expandable_segments()
    return device


# What a fresh process makes before its first step at the batch (``train``'s ``warm``): the
# layouts that tell which kept block splits the room step 2 needs.
WARM = {
    "step": "one training step at batch 1 (cuBLAS's workspaces and the optimizer state)",
    "workspace": "one forward at batch 1 without gradients (cuBLAS's workspaces only)",
    "optimizer": "the optimizer state, from zero gradients (no product, so no cuBLAS workspace)",
}


def warm_up(kind: str, model, optimizer, step, make_batch) -> None:
    """Makes what :data:`WARM` names for ``kind`` before training's first step."""
    import torch

    if kind == "step":
        step(make_batch(1))
    elif kind == "workspace":
        with torch.no_grad():
            model(make_batch(1)["tokens"])
    elif kind == "optimizer":
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        raise ValueError(f"warm={kind!r}: expected one of {', '.join(WARM)}")


def train(name: str, batch_size: int, steps: int, limit_bytes: Optional[int], device_name: str,
          warm: Optional[str] = None) -> Dict[str, Any]:
    """``steps`` training steps at ``batch_size`` (in the calling process), held to ``limit_bytes``;
    with ``warm``, after what :data:`WARM` names for it (a layout made before any large
    activation)."""
    import torch

    import adaptive_batch as ab

    device = torch.device(device_name)
    cfg = load_config(name)
    model, optimizer, step = build(cfg, device)
    make_batch = make_batch_fn(cfg, model, device)
    if warm is not None:
        warm_up(warm, model, optimizer, step, make_batch)
    hold_card_to(device, limit_bytes)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds: List[float] = []
    per_step: List[List[int]] = []  # each step's allocated peak and reserved bytes: where memory creeps
    error = message = None
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            step(make_batch(batch_size))
        except Exception as e:  # noqa: BLE001 - reported
            error = "OOM" if ab.is_oom_error(e) else f"{type(e).__name__}: {e}"
            message = str(e)[:600]
            break
        if cuda:
            torch.cuda.synchronize(device)
            per_step.append([torch.cuda.max_memory_allocated(device), torch.cuda.memory_reserved(device)])
        seconds.append(time.perf_counter() - t0)
    return {
        "batch_size": batch_size, "steps_run": len(seconds), "error": error, "error_message": message,
        "step_seconds": statistics.median(seconds[1:] or seconds) if seconds else None,
        "allocated_peak": torch.cuda.max_memory_allocated(device) if cuda else None,
        "reserved_peak": torch.cuda.max_memory_reserved(device) if cuda else None,
        "per_step": per_step,
    }


def train_fresh(name: str, batch_size: int, steps: int, limit_bytes: int, device: str) -> Dict[str, Any]:
    """:func:`train` in a fresh process with training's allocator settings."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    cmd = [sys.executable, __file__, "--train", name, "--batch", str(batch_size), "--steps", str(steps),
           "--limit-bytes", str(limit_bytes), "--device", device]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        return {"batch_size": batch_size, "steps_run": 0, "error": f"exit {run.returncode}: {run.stderr[-300:]}"}
    return json.loads(lines[-1])


def dataset_size(cfg, workdir: Path) -> int:
    from omegaconf import OmegaConf
    from torchtune import config

    cfg = OmegaConf.merge(cfg, {"output_dir": str(workdir)})
    return len(config.instantiate(cfg.dataset, config.instantiate(cfg.tokenizer)))


def measure_curve(step, make_batch, model, optimizer, device, found: int) -> List[Dict[str, Any]]:
    """Each phase's peak at batch sizes from 1 to ``found``: what a first guess has to predict."""
    from adaptive_batch.probe.target import ProbeTarget
    from adaptive_batch.probe.trials import measure_training_step

    sizes = sorted({1, 2, 3, 4, 6, 8} | {max(1, found * k // 8) for k in range(1, 9)})
    points = []
    for b in [b for b in sizes if b <= found]:
        memory = measure_training_step(ProbeTarget(step, make_batch, model, optimizer, device), make_batch(b))
        points.append({"batch_size": b, "phases": memory.phase_peak_bytes, "start": memory.start_bytes})
    return points


def check(name: str, device, max_memory: Optional[str], margin: Optional[float], steps: int, workdir: Path,
          curve_points: bool = False) -> Dict[str, Any]:
    """One row: probe, fresh-process training at found and found + 1, and the plan."""
    from omegaconf import OmegaConf

    import adaptive_batch as ab
    from adaptive_batch.memory.oom import release_memory
    from adaptive_batch.probe.service import probe_batch_size, step_budget
    from adaptive_batch.probe.target import ProbeTarget
    from adaptive_batch.torchtune.planning import plan_from_config

    cfg = load_config(name)
    model, optimizer, step = build(cfg, device)
    make_batch = make_batch_fn(cfg, model, device)
    options = ab.ProbeOptions(max_memory=max_memory, memory_safety_margin=margin, probe_cache=False)
    target = ProbeTarget(step, make_batch, model, optimizer, device)
    budget, _, _ = step_budget(options, target)
    hold_card_to(device, budget.limit_bytes)
    t0 = time.perf_counter()
    # The recipes' probe: the search, then the answer's consecutive steps held to the budget.
    report = probe_batch_size(options, target, seq_len=int(cfg.tokenizer.max_seq_len), output_dir=str(workdir),
                              log=None, save_report=False)
    probe_seconds = time.perf_counter() - t0
    found = report.batch_size
    curve = measure_curve(step, make_batch, model, optimizer, device, found) if curve_points else []
    del model, optimizer, step, target
    release_memory(device)
    hold_card_to(device, 1 << 62)
    row: Dict[str, Any] = {
        "row": name, "vocab": int(cfg.model.get("vocab_size", 128256)), "dtype": str(cfg.get("dtype", "fp32")),
        "ac": bool(cfg.get("enable_activation_checkpointing", False)), "max_memory": max_memory,
        "budget_bytes": budget.budget_bytes, "limit_bytes": budget.limit_bytes, "margin": budget.safety_margin,
        "found": found, "searched": report.max_batch_size, "predicted": report.estimate["predicted_max_batch_size"],
        "probe_seconds": probe_seconds, "search": report.to_dict(), "curve": curve,
    }
    if device.type == "cuda":
        row["trained"] = train_fresh(name, found, steps, budget.budget_bytes, str(device))
        row["over"] = train_fresh(name, found + 1, 10, budget.budget_bytes, str(device))
    else:
        row["trained"] = train(name, found, steps, None, str(device))
    samples = dataset_size(cfg, workdir)
    step_s = row["trained"].get("step_seconds")
    row["epoch_seconds"] = None if not step_s else -(-samples // found) * step_s
    plan = plan_from_config(OmegaConf.merge(cfg, {"max_memory": None}), device_memory_bytes=budget.limit_bytes,
                            safety_margin=budget.safety_margin, device_type=device.type)
    row["planned_peak"] = plan.row_at(found).peak_bytes
    return row


def cells(row: Dict[str, Any]) -> List[str]:
    from adaptive_batch.memory.device import format_bytes

    trials = row["search"]["trials"]
    trained, over = row["trained"], row.get("over")
    measured = trained.get("allocated_peak")
    epoch = row.get("epoch_seconds")
    searched = row.get("searched", row["found"])  # the search's answer, before the consecutive steps
    found = str(row["found"]) if searched == row["found"] else f"{row['found']} (search {searched})"
    return [
        row["row"], str(row["vocab"]), row["dtype"], "on" if row["ac"] else "off", str(row["max_memory"]),
        format_bytes(row["budget_bytes"]), found, str(len(trials)), str(sum(t["oom"] for t in trials)),
        f"{row['probe_seconds']:.1f}", f"{row['probe_seconds'] / epoch:.1%}" if epoch else "n/a",
        f"{'yes' if trained['error'] is None else 'no: ' + trained['error'][:40]} ({trained['steps_run']})",
        "n/a (no CUDA)" if over is None else (f"OOMs (step {over['steps_run'] + 1})" if over["error"] == "OOM"
                                               else f"no: {over['error'] or 'ran'} ({over['steps_run']})"),
        format_bytes(measured), format_bytes(trained.get("reserved_peak")), format_bytes(row["planned_peak"]),
        f"{(row['planned_peak'] - measured) / measured:+.1%}" if measured else "n/a",
    ]


def markdown(rows: List[Dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cells(row)) + " |" for row in rows])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--rows", default="tiny,152k,152k-lora", help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--small-memory", default="2GiB", help="the small max_memory of the first setting")
    parser.add_argument("--steps", type=int, default=50, help="training steps at the found batch")
    parser.add_argument("--small-only", action="store_true", help="only the small max_memory setting")
    parser.add_argument("--whole-only", action="store_true", help="only the whole device with its margin")
    parser.add_argument("--curve", action="store_true", help="also measure each phase's peak from 1 to found")
    parser.add_argument("--out", default="outputs/gpu_check", help="where each row's JSON goes")
    parser.add_argument("--table-from", help="print the table of the row files in this folder and exit")
    parser.add_argument("--readme", action="store_true", help="write the table to the README")
    parser.add_argument("--train", help=argparse.SUPPRESS)  # the fresh-process training run
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--limit-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warm", choices=sorted(WARM), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.train:
        print(json.dumps(train(args.train, args.batch, args.steps, args.limit_bytes, args.device, args.warm)))
        return 0
    if args.table_from:
        rows = [json.loads(p.read_text()) for p in sorted(Path(args.table_from).glob("*.json"))]
        print(markdown(rows))
        return 0

    import torch

    device = card_or_none(args.device, "gpu-check")
    if device is None:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))  # the rows' text data
    settings = ([] if args.whole_only else [(args.small_memory, 0.0)]) + ([] if args.small_only else [(None, None)])
    rows = []
    for name in args.rows.split(","):
        for max_memory, margin in settings:
            t0 = time.perf_counter()
            row = check(name, device, max_memory, margin, args.steps, work, args.curve)
            rows.append(row)
            (out / f"{name}_{max_memory or 'whole'}.json").write_text(json.dumps(row, indent=1))
            print(f"{name} max_memory={max_memory}: {time.perf_counter() - t0:.1f}s | {' | '.join(cells(row))}",
                  file=sys.stderr, flush=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    table = f"On {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}:\n\n{markdown(rows)}"
    print(table)
    if args.readme and device.type == "cuda":
        write_readme_table("gpu_check", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
