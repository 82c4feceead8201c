"""Does the batch ``find_max_batch_size`` hands back train in the caller's own process?

For each vocabulary and headroom: one process builds a 4-layer torchtune Llama (sequence 512,
AdamW), sets ``RLIMIT_AS`` to its size plus the headroom (as ``prlimit --as`` would), and
calls ``find_max_batch_size(max_memory=None)``. Then fresh processes, with the same limit and
the glibc settings ``find_max_batch_size`` leaves its caller with under a hard limit (the
recipes'), train the answer and the answer + 1 for ``--steps`` steps each.
The answer holds when it trains every step and answer + 1 does not.

    python benchmarks/bench_holds.py                       # the table in docs/probe.md
    python benchmarks/bench_holds.py --rows 32000:2.0 --steps 5
"""

import argparse
import json
import subprocess
import sys
import time

from limits import limit_address_space
from readme_table import write_readme_table

ROWS = "32000:1.5,32000:2.0,32000:2.5,32000:3.0,128256:3.0,128256:4.0"
SEQ_LEN = 512


def _parts(vocab: int):
    import torch
    import torch.nn.functional as F
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    model = llama3(vocab_size=vocab, num_layers=4, num_heads=8, num_kv_heads=8, embed_dim=512,
                   max_seq_len=SEQ_LEN, intermediate_dim=1536)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens):
        logits = model(tokens)
        F.cross_entropy(logits.float().view(-1, vocab), tokens.view(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def make_batch(b):
        return torch.randint(0, vocab, (b, SEQ_LEN), generator=torch.Generator().manual_seed(b))

    return model, optimizer, step, make_batch


def _limit(headroom_gib: float, *, probing: bool) -> None:
    # A plain script starts on glibc's defaults; find_max_batch_size then sets the recipes' options
    # under a hard limit, and the caller trains on them.
    limit_address_space(int(headroom_gib * 2**30), recipe_allocator=not probing)


def worker(mode: str, vocab: int, headroom_gib: float, batch_size: int, steps: int) -> dict:
    import torchtune.models.llama3  # noqa: F401  (imported before the limit, as a user's script would)

    from adaptive_batch import BatchSizeTooLargeError, find_max_batch_size, is_oom_error

    _limit(headroom_gib, probing=mode == "probe")
    model, optimizer, step, make_batch = _parts(vocab)
    if mode == "probe":
        start = time.perf_counter()
        try:
            found = find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory=None)
        except BatchSizeTooLargeError:
            found = 0  # batch 1 does not fit this headroom: a row that says so
        return {"found": found, "seconds": round(time.perf_counter() - start, 1)}
    done = 0
    try:
        for _ in range(steps):
            step(make_batch(batch_size))
            done += 1
    except RuntimeError as e:
        if not is_oom_error(e):
            raise
    return {"batch_size": batch_size, "steps": done}


def _run(*args) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=ROWS, help="vocab:headroom_GiB pairs, comma-separated")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, vocab, headroom, batch, steps = args.worker
        print(json.dumps(worker(mode, int(vocab), float(headroom), int(batch), int(steps))))
        return
    lines = [
        f"| vocab | headroom | found | probe s | found trains (of {args.steps}) | found + 1 trains | holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in args.rows.split(","):
        vocab, headroom = row.split(":")
        probe = _run("probe", vocab, headroom, 0, 0)
        found = probe["found"]
        if not found:
            lines.append(f"| {int(vocab) // 1000}K | {headroom} GiB | - | {probe['seconds']} | - | - | batch 1 does not fit |")
            print(lines[-1], flush=True)
            continue
        at = _run("train", vocab, headroom, found, args.steps)["steps"]
        over = _run("train", vocab, headroom, found + 1, args.steps)["steps"]
        holds = "yes" if at == args.steps and over < args.steps else ("no" if at < args.steps else "undershoot")
        lines.append(f"| {int(vocab) // 1000}K | {headroom} GiB | {found} | {probe['seconds']} | {at} | {over} | {holds} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.rows == ROWS and args.steps == 10:
        write_readme_table("holds-table", table)


if __name__ == "__main__":
    main()
