"""The probe with and without its first guess from fake steps, side by side in one run.

Each arm is a fresh process. Recipe rows run ``adaptive-batch probe`` on a config (the recipe's
own probe: warmup, then the guess and its neighbour; or warmup, estimate steps at batch 1, 2 and
3, the prediction and its neighbour) with ``probe_first_guess`` on and off; library rows probe a
model outside the transformer family through ``probe_batch_size`` with and without
``first_guess=`` (``guess_max_batch_size`` on the same model). Rounds alternate which arm runs
first. Per row: the answer of each arm (found/true, the truth being the search without a guess,
whose answer fitted with the size above it over the budget), real trial steps, the probe's
seconds (the guess's included) and the guess's own, and the probe's share of one epoch.

    make bench-first-guess          # or: python benchmarks/bench_first_guess.py --rounds 3
"""

import argparse
import json
import os
from pathlib import Path
import statistics
import subprocess
import sys
import tempfile

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "probe.md"
START, END = "<!-- bench_first_guess:start -->", "<!-- bench_first_guess:end -->"
# (row name, config, max_memory): the tiny config and a real vocabulary.
RECIPE_ROWS = [
    ("tiny (byte vocabulary, 4 layers)", "configs/tiny/full_single_device.yaml", "512MiB"),
    ("Llama 3.2 128K vocabulary", "configs/tiny/llama3_2_vocab128k_full_single_device.yaml", "3GiB"),
]
LIBRARY_ROWS = [("LSTM language model (library)", "lstm")]
LIBRARY_SEQ, LIBRARY_VOCAB, LIBRARY_BUDGET = 64, 10_000, 1 << 30
DATASET_SIZE = 10_000  # the library rows' epoch, for the share


# ----------------------------------------------------------------------------- worker side
def _lstm():
    import torch
    from torch import nn

    class LSTMLanguageModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(LIBRARY_VOCAB, 256)
            self.lstm = nn.LSTM(256, 512, num_layers=2, batch_first=True)
            self.head = nn.Linear(512, LIBRARY_VOCAB)

        def forward(self, tokens):
            return self.head(self.lstm(self.embedding(tokens))[0])

    torch.manual_seed(0)
    return LSTMLanguageModel()


def _forward_backward(model, batch):
    import torch.nn.functional as F

    logits = model(batch["tokens"])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)).backward()


def _library_worker(name: str, guess: bool, out: str) -> dict:
    from functools import partial

    import torch

    from adaptive_batch import ProbeOptions, probe_batch_size
    from adaptive_batch.probe.first_guess import guess_max_batch_size
    from adaptive_batch.probe.target import ProbeTarget
    from adaptive_batch.probe.trials import worst_case_text_batch

    build = {"lstm": _lstm}[name]
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        _forward_backward(model, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    make_batch = partial(worst_case_text_batch, seq_len=LIBRARY_SEQ, vocab_size=LIBRARY_VOCAB, device=torch.device("cpu"))
    target = ProbeTarget(step, make_batch, model, optimizer, torch.device("cpu"))
    first_guess = None
    if guess:
        def first_guess(budget_bytes, cap):
            return guess_max_batch_size(build_model=build, build_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                                        forward_backward=_forward_backward, seq_len=LIBRARY_SEQ,
                                        budget_bytes=budget_bytes, max_batch_size=cap)
    options = ProbeOptions(use_maximum_batch_size=True, max_memory=LIBRARY_BUDGET, probe_cache=False)
    report = probe_batch_size(options, target, seq_len=LIBRARY_SEQ, dataset_size=DATASET_SIZE, output_dir=out,
                              first_guess=first_guess)
    return report.to_dict()


# ----------------------------------------------------------------------------- driver side
def _recipe_arm(config: str, max_memory: str, guess: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(Path(sys.executable).with_name("adaptive-batch")), "probe", "--config", config, "--no-cache",
               f"max_memory={max_memory}", f"probe_first_guess={guess}", f"output_dir={out}",
               "batch_increase_function=null"]
        proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return json.loads((Path(out) / "batch_probe.json").read_text())


def _library_arm(name: str, guess: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, __file__, "--library-worker", name, str(guess), out], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"library worker {name} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.rsplit("RESULT ", 1)[1])


def _rows(rounds: int):
    arms = [(name, lambda g, c=config, m=mem: _recipe_arm(c, m, g)) for name, config, mem in RECIPE_ROWS]
    arms += [(name, lambda g, n=key: _library_arm(n, g)) for name, key in LIBRARY_ROWS]
    runs = {(label, guess): [] for label, _ in arms for guess in (True, False)}
    for r in range(rounds):
        for label, arm in arms:
            for guess in ((True, False) if r % 2 == 0 else (False, True)):
                report = arm(guess)
                runs[(label, guess)].append(report)
                print(f"round {r + 1} {label} first_guess={guess}: found {report['max_batch_size']}, "
                      f"{report['num_trials']} trials, {report['total_seconds']:.1f}s", file=sys.stderr)
    return arms, runs


def _table(arms, runs) -> str:
    head = ("| model | first guess | found | found/true | real trial steps | probe s (median) | guess s | "
            "probe s / without | probe / epoch |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for label, _ in arms:
        truth = {r["max_batch_size"] for r in runs[(label, False)]}
        base = statistics.median(r["total_seconds"] for r in runs[(label, False)])
        for guess in (True, False):
            reports = runs[(label, guess)]
            found = sorted({r["max_batch_size"] for r in reports})
            ratio = "/".join(f"{f / max(truth):.3f}" for f in found)
            seconds = statistics.median(r["total_seconds"] for r in reports)
            guesses = [r["first_guess"]["seconds"] for r in reports if r.get("first_guess")]
            guess_s = statistics.median(guesses) if guesses else None
            share = statistics.median(r["epoch_share"] for r in reports if r.get("epoch_share") is not None)
            trials = sorted({r["num_trials"] for r in reports})
            lines.append(
                f"| {label} | {'on' if guess else 'off'} | {'/'.join(map(str, found))} | {ratio} | "
                f"{'/'.join(map(str, trials))} | {seconds:.2f} | {'-' if guess_s is None else f'{guess_s:.2f}'} | "
                f"{seconds / base:.2f}x | {share:.1%} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the table without writing it to the docs")
    parser.add_argument("--library-worker", nargs=3, metavar=("MODEL", "GUESS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.library_worker:
        name, guess, out = args.library_worker
        print("RESULT " + json.dumps(_library_worker(name, guess == "True", out)))
        return
    arms, runs = _rows(args.rounds)
    table = _table(arms, runs)
    print(table)
    if not args.no_write:
        text = DOC.read_text()
        if START in text:
            before, rest = text.split(START, 1)
            DOC.write_text(before + START + "\n" + table + "\n" + END + rest.split(END, 1)[1])
        print(f"written to {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
