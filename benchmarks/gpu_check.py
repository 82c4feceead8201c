"""The CUDA paths on a real GPU: the probe against real CUDA out-of-memory errors.

For the tiny config and the 152K-vocabulary one, twice (a small ``max_memory`` with no safety
margin, then the whole card with the default margin):

1. the card is held to the budget's limit with ``torch.cuda.set_per_process_memory_fraction``,
   so a trial past it is a real CUDA OOM, and the probe (real steps) finds the largest batch;
2. the found batch trains a few steps back to back (expandable segments on, as the recipe sets them);
3. the card is held to the probe's budget and batch + 10% (at least +1) must run out of memory;
4. the planner's prediction at the found batch (fake tensors, nothing allocated) is compared
   with ``torch.cuda.max_memory_allocated`` of those training steps.

    make gpu-check                  # prints the table; --readme writes it to the README

Without a CUDA device it says so and exits 0. ``--device cpu`` runs the same code on the CPU
(no memory fraction: steps 1, 2 and 4 only), which is how the test suite keeps it working.
"""

import argparse
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import List, Optional

from readme_table import write_readme_table

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [
    REPO / "configs/tiny/full_single_device.yaml",
    REPO / "configs/tiny/qwen2_5_vocab152k_full_single_device.yaml",
]
COLUMNS = [
    "config", "vocab", "max_memory", "margin", "budget", "found", "trials", "OOM trials", "max overshoot",
    "trains", "found+10% OOMs", "measured peak", "planned peak", "plan error",
]


def check(config_path: Path, device, max_memory: Optional[str], margin: Optional[float], steps: int) -> List[str]:
    """One row of the table: probe, train, over-the-budget step and plan for one setting."""
    import torch
    from omegaconf import OmegaConf
    from torchtune import config

    import adaptive_batch as ab
    from adaptive_batch.memory import format_bytes
    from adaptive_batch.probing import step_budget
    from adaptive_batch.torchtune import next_token_loss
    from adaptive_batch.torchtune.planning import plan_from_config

    cfg = OmegaConf.load(config_path)
    torch.manual_seed(0)
    with torch.device(device):
        model = config.instantiate(cfg.model)
    loss_fn = config.instantiate(cfg.loss)
    if hasattr(loss_fn, "num_output_chunks"):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    optimizer = config.instantiate(cfg.optimizer, model.parameters())
    seq_len = int(cfg.tokenizer.max_seq_len)
    make_batch = partial(
        ab.worst_case_text_batch, seq_len=seq_len, vocab_size=model.tok_embeddings.num_embeddings, device=device
    )

    def step(batch) -> None:
        next_token_loss(model, loss_fn, dict(batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    total = torch.cuda.get_device_properties(device).total_memory if cuda else None
    options = ab.ProbeOptions(max_memory=max_memory, memory_safety_margin=margin)
    budget, _ = step_budget(options, device=device, model=model, optimizer=optimizer)

    def hold_card_to(limit_bytes: int) -> None:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), device)

    hold_card_to(budget.limit_bytes)
    result = ab.probe_max_batch_size(
        train_step=step, make_batch=make_batch, model=model, optimizer=optimizer, device=device,
        budget_bytes=budget.budget_bytes,
    )
    found = result.max_batch_size

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trains = "yes"
    try:
        for _ in range(steps):
            step(make_batch(found))
    except Exception as e:  # noqa: BLE001 - reported in the table
        trains = f"no: {type(e).__name__}"
    measured = torch.cuda.max_memory_allocated(device) if cuda else None
    ab.release_memory(device)

    over_oom = "n/a (no CUDA)"
    if cuda:
        over = max(found + 1, math.ceil(found * 1.1))
        hold_card_to(budget.budget_bytes)
        try:
            step(make_batch(over))
            over_oom = f"no ({over} ran)"
        except Exception as e:  # noqa: BLE001 - an OOM is the expected outcome
            if not ab.is_oom_error(e):
                raise
            over_oom = f"yes ({over})"
        optimizer.zero_grad(set_to_none=True)
        ab.release_memory(device)
        hold_card_to(total)

    plan_cfg = OmegaConf.merge(cfg, {"max_memory": None})
    plan = plan_from_config(
        plan_cfg, device_memory_bytes=budget.limit_bytes, safety_margin=budget.safety_margin
    )
    planned = plan.row_at(found).peak_bytes
    error = f"{(planned - measured) / measured:+.1%}" if measured else "n/a"
    overshoot = result.max_overshoot
    return [
        config_path.stem, str(cfg.model.vocab_size), str(max_memory), f"{budget.safety_margin:.0%}",
        format_bytes(budget.budget_bytes), str(found), str(result.num_trials),
        str(sum(t.oom for t in result.trials)), "-" if overshoot is None else f"{overshoot:.2f}x",
        trains, over_oom, format_bytes(measured), format_bytes(planned), error,
    ]


def markdown(rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--small-memory", default="2GiB", help="the small max_memory of the first setting")
    parser.add_argument("--steps", type=int, default=3, help="training steps at the found batch")
    parser.add_argument("--config", action="append", help="config file(s) (default: the tiny and 152K ones)")
    parser.add_argument("--small-only", action="store_true", help="only the small max_memory setting")
    parser.add_argument("--readme", action="store_true", help="write the table to the README")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing to check (exit 0).")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":  # as the recipe does before probing
        import adaptive_batch as ab

        ab.use_expandable_segments(log=print, warn=print)
    configs = [Path(c) for c in args.config] if args.config else CONFIGS
    settings = [(args.small_memory, 0.0)] + ([] if args.small_only else [(None, None)])
    rows = []
    for config_path in configs:
        for max_memory, margin in settings:
            t0 = time.perf_counter()
            rows.append(check(config_path, device, max_memory, margin, args.steps))
            print(f"{config_path.stem} max_memory={max_memory}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    table = f"On {name}, torch {torch.__version__}:\n\n{markdown(rows)}"
    print(table)
    if args.readme and device.type == "cuda":
        write_readme_table("gpu_check", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
