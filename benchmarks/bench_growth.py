"""Does growing the batch help? Five batch schedules on the same samples, several seeds.

Each run is a real `tune run` of the recipe (the script runs the recipe file) on the same
first ``--samples`` samples of the local data for ``--epochs`` epochs, with the same cosine LR
counted in samples and the square-root LR rule against batch 4:

- fixed small: batch 4;
- fixed large: batch 32 (its LR sqrt(8) times higher);
- doubling per epoch: 4, 8, 16 (``adaptive_batch.double_every_epoch``);
- Seesaw: 4, doubled where the cosine LR has halved (``adaptive_batch.seesaw``), every
  ``--interval`` samples;
- noise-scale growth: 4, toward the measured ``B_noise`` at most doubling every ``--interval``
  samples (``adaptive_batch.noise_scale_growth``, steps split in two to measure it), the same
  measured from the norm layers' per-example gradients (no split), and the first toward half of it.

Reported per schedule (mean and spread over seeds): the training loss of the last tenth of the
samples, steps, training seconds (the recipe's own step times, summed), and for noise-scale
growth the ``B_noise`` it measured. A plot draws loss against samples and against seconds.

``--fixed 4,8,16,32`` adds a sweep of fixed batches; the table then times every schedule to the
loss the best fixed batch ends at (per seed), and gives each one's tokens/s. ``--packed`` packs
the samples into full sequences of ``max_seq_len`` tokens; ``--only "A;B"`` runs those schedules
(and the sweep).

    python benchmarks/bench_growth.py [--config configs/tiny/full_single_device.yaml] [--seeds 3]
        [--samples 512] [--epochs 3] [--device cpu] [--readme] [--fixed 4,8,16,32] [--packed] [--only "A;B"]
"""

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from readme_table import write_readme_table  # noqa: E402
from tests.recipes.conftest import read_metric_log  # noqa: E402

START = 4  # the starting (and fixed small) batch, and the LR's reference batch
LARGE = 32
MAX_BATCH = 64
WARMUP_SAMPLES = 16


def schedules(samples: int, epochs: int, interval: int) -> Dict[str, List[str]]:
    """Each schedule's overrides, and its initial batch (the LR schedule counts steps of it)."""
    intervals = samples * epochs // interval
    return {
        "fixed small": [f"batch_size={START}", "batch_increase_function=null"],
        "fixed large": [f"batch_size={LARGE}", "batch_increase_function=null"],
        "doubling per epoch": [f"batch_size={START}", "batch_increase_function=adaptive_batch.double_every_epoch"],
        "Seesaw": [
            f"batch_size={START}", f"batch_increase_interval={interval} samples",
            f"batch_increase_function={{_component_: adaptive_batch.seesaw, total_intervals: {intervals}, factor: 2}}",
        ],
        "noise-scale growth": [
            f"batch_size={START}", f"batch_increase_interval={interval} samples",
            "batch_increase_function={_component_: adaptive_batch.noise_scale_growth, max_factor: 2}",
            "measure_noise_scale=True", "noise_scale_split_step=True",
        ],
        "noise-scale growth, norm layers": [
            f"batch_size={START}", f"batch_increase_interval={interval} samples",
            "batch_increase_function={_component_: adaptive_batch.noise_scale_growth, max_factor: 2}",
            "measure_noise_scale=True", "noise_scale_estimator=norm_layers",
        ],
        "noise-scale growth, ½ B_noise": [
            f"batch_size={START}", f"batch_increase_interval={interval} samples",
            "batch_increase_function={_component_: adaptive_batch.noise_scale_growth, max_factor: 2, "
            "target_fraction: 0.5}",
            "measure_noise_scale=True", "noise_scale_split_step=True",
        ],
    }


def fixed_sweep(sizes: List[int]) -> Dict[str, List[str]]:
    """A fixed batch of each size, to find the best fixed batch."""
    return {f"fixed {b}": [f"batch_size={b}", "batch_increase_function=null"] for b in sizes}


def run(config: str, name: str, overrides: List[str], *, seed: int, samples: int, epochs: int, device: str,
        out_root: str, extra: List[str] = ()) -> Dict[str, object]:
    out = Path(out_root) / f"{''.join(c if c.isalnum() else '_' for c in name)}_{seed}"
    initial = int(next(o for o in overrides if o.startswith("batch_size=")).split("=")[1])
    cmd = [
        sys.executable, "recipes/full_finetune_single_device.py", "--config", config, f"output_dir={out}",
        f"device={device}", f"seed={seed}", f"epochs={epochs}", f"dataset.split=train[:{samples}]",
        f"max_batch_size={MAX_BATCH}", "use_maximum_batch_size=False", "max_steps_per_epoch=null", "lr_scaling=sqrt",
        f"lr_scaling_reference={START}", "grow_with_accumulation=False",
        "lr_scheduler._component_=torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        f"lr_scheduler.num_warmup_steps={max(1, WARMUP_SAMPLES // initial)}",
        # the schedule's steps are steps of the initial batch: the same samples for every schedule
        f"lr_scheduler.num_training_steps={samples * epochs // initial}",
        *extra,
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    rows = read_metric_log(out)
    seconds, curve = 0.0, []
    for r in rows:
        seconds += r["real_tokens"] / r["tokens_per_second_per_gpu"]
        curve.append((r["samples_seen"], seconds, r["loss"], r["batch_size"], r.get("gradient_noise_scale")))
    total = curve[-1][0]
    tail = [(c[3], c[2]) for c in curve if c[0] > 0.9 * total]
    return {
        "curve": curve,
        "tokens_per_second": sum(r["real_tokens"] for r in rows[1:]) / max(1e-9, seconds - curve[0][1]),
        "final_loss": sum(b * loss for b, loss in tail) / sum(b for b, _ in tail),
        "steps": len(rows),
        "seconds": seconds,
        "samples": total,
        "batches": [int(c[3]) for c in curve],
    }


def spread(values: List[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ± {format(statistics.stdev(values), fmt)}"


def noise_trajectory(curve: List[tuple]) -> str:
    """B_noise at a quarter, half, three quarters and the end of the samples."""
    total = curve[-1][0]
    points = []
    for q in (0.25, 0.5, 0.75, 1.0):
        measured = [c[4] for c in curve if c[0] <= q * total and c[4] is not None]
        points.append(f"{measured[-1]:.1f}" if measured else "-")
    return " / ".join(points)


def smoothed(curve: List[tuple]) -> List[float]:
    """The loss as an exponential average per sample seen, so batches of any size weigh alike."""
    out, value = [], None
    for c in curve:
        weight = 1 - 0.98 ** c[3]
        value = c[2] if value is None else value + weight * (c[2] - value)
        out.append(value)
    return out


def seconds_to(curve: List[tuple], target: float) -> float:
    """Training seconds until the smoothed loss first reaches ``target`` (inf if never)."""
    return next((c[1] for c, loss in zip(curve, smoothed(curve)) if loss <= target), math.inf)


def time_to_target(results: Dict[str, List[Dict[str, object]]]) -> tuple:
    """The best fixed batch (the fixed schedule whose smoothed loss ends lowest, mean over seeds),
    its final smoothed loss (mean over seeds) as the target, and each schedule's mean over seeds
    of the seconds to reach its seed's target (the best fixed batch's own end on that seed)."""
    fixed = {name: runs for name, runs in results.items() if name.startswith("fixed")}
    if not fixed:  # nothing to time against
        return None, math.nan, {name: math.nan for name in results}
    best = min(fixed, key=lambda n: statistics.fmean(smoothed(r["curve"])[-1] for r in fixed[n]))
    targets = [smoothed(r["curve"])[-1] for r in fixed[best]]
    reach = {name: statistics.fmean(seconds_to(r["curve"], t) for r, t in zip(runs, targets))
             for name, runs in results.items()}
    return best, statistics.fmean(targets), reach


def table(results: Dict[str, List[Dict[str, object]]], config: str, args, device_name: str) -> str:
    base = results.get("fixed small") or next((r for n, r in results.items() if n.startswith("fixed")), None)
    base = base or next(iter(results.values()))  # no fixed schedule run: ratios against the first
    base_seconds = statistics.fmean(r["seconds"] for r in base)
    best, target, reach = time_to_target(results)
    lines = [
        f"`{config}`, {device_name}: the first {args.samples} samples x {args.epochs} epochs, seeds "
        f"{', '.join(str(s) for s in range(args.seeds))}; cosine LR counted in samples, square-root rule against "
        f"batch {START}; growth every {args.interval} samples; batch bound {MAX_BATCH}. Loss: the training loss of "
        "the last tenth of the samples (mean ± standard deviation over seeds).",
        "",
        "| schedule | final loss | steps | training s | s vs fixed small | tokens/s | batch (seed 0): first → largest | B_noise at 1/4, 1/2, 3/4, end (seed 0) | s to the best fixed batch's loss | vs it |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        batches = runs[0]["batches"]
        noise = noise_trajectory(runs[0]["curve"]) if name.startswith("noise-scale growth") else "-"
        seconds = statistics.fmean(r["seconds"] for r in runs)
        lines.append(
            f"| {name} | {spread([r['final_loss'] for r in runs], '.3f')} | {spread([r['steps'] for r in runs], '.0f')} "
            f"| {spread([r['seconds'] for r in runs], '.1f')} | {seconds / base_seconds:.2f}x "
            f"| {statistics.fmean(r['tokens_per_second'] for r in runs):.0f} "
            f"| {batches[0]} → {max(batches)} | {noise} | {reach[name]:.1f} | {reach[name] / reach.get(best, math.nan):.2f}x |"
        )
    lines += ["", f"The best fixed batch: {best}, whose smoothed loss ends at {target:.3f} (mean over seeds; each seed's "
              "own is its target); inf: never reached."]
    return "\n".join(lines)


def plot(results: Dict[str, List[Dict[str, object]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_seconds) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (name, runs) in enumerate(results.items()):
        color = f"C{i}"
        for j, r in enumerate(runs):
            curve = r["curve"]
            smooth = smoothed(curve)
            label = name if j == 0 else None
            by_samples.plot([c[0] for c in curve], smooth, color=color, lw=1, alpha=0.8, label=label)
            by_seconds.plot([c[1] for c in curve], smooth, color=color, lw=1, alpha=0.8)
    by_samples.set_xlabel("samples")
    by_seconds.set_xlabel("training seconds")
    by_samples.set_ylabel("training loss (smoothed)")
    by_samples.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", help="config file(s) (default: the tiny one)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512, help="the first N samples of the data")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--interval", type=int, default=128, help="samples between growth decisions")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plot-dir", default=str(REPO / "docs"), help="where bench_growth_<config>.png goes")
    parser.add_argument("--readme", action="store_true", help="write the tables to the README")
    parser.add_argument("--fixed", default="", help="comma-separated fixed batches to sweep beside the schedules")
    parser.add_argument("--only", default="", help="semicolon-separated schedule names to run (default: all)")
    parser.add_argument("--packed", action="store_true", help="pack samples into full sequences (max_seq_len tokens)")
    args = parser.parse_args()
    extra = ["dataset.packed=True"] if args.packed else []
    sweep = fixed_sweep([int(b) for b in args.fixed.split(",") if b])
    configs = args.config or ["configs/tiny/full_single_device.yaml"]
    if args.device == "cuda":
        import torch

        device_name = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    else:
        device_name = f"CPU ({os.cpu_count()} cores)"
    for config in configs:
        stem = Path(config).stem
        results: Dict[str, List[Dict[str, object]]] = {}
        with tempfile.TemporaryDirectory() as out_root:
            chosen = {**sweep, **schedules(args.samples, args.epochs, args.interval)}
            if args.only:
                chosen = {n: o for n, o in chosen.items() if n in args.only.split(";") or n in sweep}
            for name, overrides in chosen.items():
                results[name] = []
                for seed in range(args.seeds):
                    r = run(config, name, overrides, seed=seed, samples=args.samples, epochs=args.epochs,
                            device=args.device, out_root=out_root, extra=extra)
                    results[name].append(r)
                    print(f"{stem} {name} seed {seed}: loss {r['final_loss']:.3f}, {r['steps']} steps, "
                          f"{r['seconds']:.1f}s", file=sys.stderr, flush=True)
        text = table(results, config, args, device_name)
        print(text, flush=True)
        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        plot(results, Path(args.plot_dir) / f"bench_growth_{stem}.png", f"{stem}, {device_name}")
        if args.readme:
            write_readme_table(f"bench_growth_{stem}", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
