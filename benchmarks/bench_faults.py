"""The fault table: each recipe killed at each named point, then resumed with
``resume_from_checkpoint=auto``; is every resumed step the uninterrupted run's, and is every
file under its final name whole?

Every run is a real ``tune run`` process (two under torchrun for the distributed recipe) on
the tiny configs, killed by ``ADAPTIVE_BATCH_FAULT`` (:mod:`adaptive_batch.faults`): SIGKILL at
the point, as a preemption or the OOM killer would, or SIGTERM, as a scheduler does first.
The table goes into docs/checkpoints.md.

    .venv/bin/python benchmarks/bench_faults.py [--recipes full,lora,2-ranks] [--points ...]
"""

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_table import write_readme_table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.recipes.conftest import read_metric_log  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TUNE = str(Path(sys.executable).with_name("tune"))
RECIPES = {
    "full": ("recipes/full_finetune_single_device.py", "configs/tiny/full_single_device.yaml", None),
    "lora": ("recipes/lora_finetune_single_device.py", "configs/tiny/lora_single_device.yaml", None),
    "2-ranks": ("recipes/full_finetune_distributed.py", "configs/tiny/full_distributed.yaml", 2),
}
# Epoch 0: the probe, 4 steps of 4 samples, a step checkpoint after step 3; epoch 1: 2 steps
# of 8 (the batch doubles), a step checkpoint after step 6.
COMMON = [
    "epochs=2", "max_steps_per_epoch=4", "max_batch_size=8", "save_every_n_steps=3", "use_maximum_batch_size=True",
    "max_memory=512MiB", "probe_cache=False",
]
# (fault, where it lands)
POINTS = [
    ("probe_trial:2", "during the probe (nothing saved yet)"),
    ("inside_step:2", "inside step 2, before its optimizer step"),
    ("after_step:3", "after step 3, before its step checkpoint"),
    ("step_checkpoint_written:1", "inside the step 3 checkpoint's write, before its rename"),
    ("epoch_staged:1", "inside epoch 0's save, its files written aside"),
    ("epoch_committing:1", "inside epoch 0's save, weights in place, recipe state not yet"),
    ("after_epoch:1", "right after epoch 0's checkpoint"),
    ("inside_step:5", "inside step 5 (epoch 1), after both checkpoints"),
    ("after_step:5:SIGTERM", "SIGTERM in step 5: the run stops after it and saves"),
]
KEYS = ["step", "batch_size", "micro_batch_size", "samples_seen", "tokens_seen", "lr", "loss"]


def tune(recipe: str, out: Path, *overrides: str, fault: Optional[str] = None) -> subprocess.CompletedProcess:
    path, config, nproc = RECIPES[recipe]
    launch = ["--nproc_per_node", str(nproc)] if nproc else []
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("ADAPTIVE_BATCH_FAULT", None)
    if fault:
        env["ADAPTIVE_BATCH_FAULT"] = fault
    cmd = [TUNE, "run", *launch, path, "--config", config, f"output_dir={out}", *COMMON, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def unreadable_files(out: Path) -> List[str]:
    """Files under their final names (no temporaries, no staging) that do not load."""
    bad = []
    for path in out.rglob("*"):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(out).parts):
            continue
        try:
            if path.suffix in (".pt", ".bin"):
                torch.load(path, map_location="cpu", weights_only=True)
            elif path.suffix == ".json":
                json.loads(path.read_text())
        except Exception:  # noqa: BLE001 - any failure to load is a damaged file
            bad.append(str(path.relative_to(out)))
    return bad


def leftovers(out: Path) -> List[str]:
    return [str(p.relative_to(out)) for p in out.rglob(".*") if p.name != ".adaptive_batch.lock"]


def case(recipe: str, fault: str, whole: List[Dict[str, float]], root: Path) -> Tuple[str, ...]:
    out = root / f"{recipe}_{fault.replace(':', '_')}"
    killed = tune(recipe, out, fault=fault)
    damaged = unreadable_files(out)
    left = leftovers(out)
    resumed = tune(recipe, out, "resume_from_checkpoint=auto", f"metric_logger.log_dir={out}/logs_resumed")
    got = read_metric_log(out, "logs_resumed") if resumed.returncode == 0 else []
    by_step = {r["step"]: r for r in whole}
    exact = (
        resumed.returncode == 0 and bool(got) and got[-1]["step"] == whole[-1]["step"]
        and all(all(r[k] == by_step[r["step"]][k] for k in KEYS) for r in got)
    )
    intact = not damaged and not leftovers(out) and resumed.returncode == 0
    start = "fresh" if "nothing saved yet" in resumed.stderr else f"step {int(got[0]['step']) - 1}" if got else "-"
    note = "; ".join(filter(None, [
        f"damaged: {', '.join(damaged)}" if damaged else "",
        f"temporaries left by the kill: {len(left)} (removed by the resume)" if left else "",
        "" if resumed.returncode == 0 else f"resume failed: {resumed.stderr.strip().splitlines()[-1][:120]}",
    ]))
    return (recipe, fault, str(killed.returncode), start, "yes" if exact else "NO", "yes" if intact else "NO", note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--points", default=",".join(p for p, _ in POINTS))
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    points = [p for p in args.points.split(",") if p]
    where = dict(POINTS)
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_faults_") as tmp:
        root = Path(tmp)
        for recipe in args.recipes.split(","):
            run = tune(recipe, root / f"{recipe}_whole")
            assert run.returncode == 0, run.stderr[-3000:]
            whole = read_metric_log(root / f"{recipe}_whole")
            for fault in points:
                rows.append(case(recipe, fault, whole, root))
                print(" | ".join(rows[-1]), flush=True)
    header = ("| recipe | kill point | where | exit | resumed from | exact | files intact | notes |\n"
              "|---|---|---|---|---|---|---|---|")
    lines = [f"| {r[0]} | `{r[1]}` | {where.get(r[1], '')} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]} |" for r in rows]
    table = "\n".join([header, *lines, "", f"{len(rows)} kills and resumes in {time.perf_counter() - started:.0f} s "
                       f"(`{' '.join(['python', 'benchmarks/bench_faults.py'] + sys.argv[1:])}`); settings: "
                       f"`{' '.join(COMMON)}`."])
    print(table)
    if not args.no_write and write_readme_table("fault-table", table):
        print("written to docs/checkpoints.md")


if __name__ == "__main__":
    main()
