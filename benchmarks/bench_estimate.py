"""How well each memory estimate predicts a step's peak, on the tiny vocabulary and a real one.

For each config: full training steps (AdamW, fp32, CPU, every sequence at max_seq_len) measured
at batch 1, 2, 3 and at a larger batch; the peak predicted for the larger batch by one line
through the step peaks at 1 and 2 (the RFC's memory-delta estimate), by a line per phase from
1 and 2, and by a line per operator from 2 and 3, against the measured one.

    python benchmarks/bench_estimate.py [--batch 8] [--no-readme]
"""

import argparse
import os
from pathlib import Path
import time

from omegaconf import OmegaConf
from readme_table import write_readme_table
import torch
from torchtune import config

from adaptive_batch.memory.device import format_bytes
from adaptive_batch.memory.estimator import LinearMemoryEstimate, OperatorMemoryEstimate, PhaseMemoryEstimate
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.trials import measure_training_step, worst_case_text_batch
from adaptive_batch.torchtune import next_token_loss

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ["configs/tiny/full_single_device.yaml", "configs/tiny/qwen2_5_vocab152k_full_single_device.yaml"]


def measure_config(path: str, large: int) -> dict:
    cfg = OmegaConf.load(REPO / path)
    torch.manual_seed(0)
    model = config.instantiate(cfg.model)
    loss_fn = config.instantiate(cfg.loss)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    seq_len, vocab = cfg.tokenizer.max_seq_len, cfg.model.vocab_size

    def step(batch) -> None:
        next_token_loss(model, loss_fn, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def measure(b: int):
        batch = worst_case_text_batch(b, seq_len=seq_len, vocab_size=vocab, device=torch.device("cpu"))
        return measure_training_step(ProbeTarget(step, None, model, optimizer, torch.device("cpu")), batch)

    measure(1)  # warm-up: the optimizer state
    m = {b: measure(b) for b in (1, 2, 3, large)}
    true = m[large].peak_bytes
    step_line = LinearMemoryEstimate.fit([(b, m[b].peak_bytes) for b in (1, 2)])
    phases = PhaseMemoryEstimate.fit([(b, m[b].phase_peak_bytes) for b in (1, 2)])
    same_1_2 = m[1].operators == m[2].operators
    first = 1 if same_1_2 else 2
    operators = OperatorMemoryEstimate.fit(
        (first, m[first].timeline), (first + 1, m[first + 1].timeline), (m[first].operators, m[first + 1].operators)
    )
    return {
        "config": path,
        "vocab": vocab,
        "params": sum(p.numel() for p in model.parameters()),
        "true": true,
        "step": step_line.peak_bytes(large),
        "phases": phases.peak_bytes(large),
        "operators": operators.peak_bytes(large),
        "operator_sizes": f"{first} and {first + 1}",
    }


def render(rows, large: int) -> str:
    fmt = format_bytes
    lines = [
        f"Peak of a full training step at batch {large} (AdamW, fp32, CPU, every sequence at "
        "max_seq_len), measured and predicted from smaller steps; error = predicted / measured - 1.",
        "",
        "| config | vocabulary | parameters | measured | one line (1, 2) | a line per phase (1, 2) "
        "| a line per operator | operators from batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{fmt(r[k])} ({r[k] / r['true'] - 1:+.1%})" for k in ("step", "phases", "operators")]
        lines.append(
            f"| `{Path(r['config']).name}` | {r['vocab']:,} | {r['params'] / 1e6:.1f} M | {fmt(r['true'])} | "
            + " | ".join(cells) + f" | {r['operator_sizes']} |"
        )
    lines += ["", f"Made by `python benchmarks/bench_estimate.py --batch {large}` on {time.strftime('%Y-%m-%d')}, "
              f"{os.cpu_count()} CPU cores."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    rows = [measure_config(path, args.batch) for path in CONFIGS]
    table = render(rows, args.batch)
    print(table)
    if not args.no_readme:
        write_readme_table("bench_estimate", table)


if __name__ == "__main__":
    main()
