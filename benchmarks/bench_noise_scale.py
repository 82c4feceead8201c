"""The gradient noise scale for free: what each estimator costs, and whether they agree.

Two tables, written to docs/schedules.md:

- **Cost**: `tune run` of the recipe on the same config, data, initial weights and seed, in
  rounds that rotate which runs first: `measure_noise_scale=False`, the per-example estimator
  (`noise_scale_estimator=norm_layers`, steps of one micro-batch) and the micro-batch one
  (`noise_scale_split_step=True`, which halves every step to have two gradients). Each is
  reported against the run without it as the median over steps of the ratio of tokens/s at
  the same step (the same batch in both).
- **Agreement**: both estimators on the same training run, in-process: every step is run as two
  micro-batches with both observers on it, so `micro_batches` (two gradients and a copy of all
  of them) and `norm_layers` (each example's gradient of the LayerNorm/RMSNorm weights) read
  the same steps. Reported: each one's `B_noise` (samples) at a quarter, half, three quarters and
  the end of the run, and their ratio. Models: the tiny config (vocabulary 259), the
  152K-vocabulary one, both on the embedded text, and a residual MLP with LayerNorm on a
  regression task (outside the transformer family).

    python benchmarks/bench_noise_scale.py [--rounds 3] [--steps 24] [--agreement-steps 200] [--no-docs]

About 40 minutes on 2 CPU cores, half of it the 152K model's agreement run.
"""

import argparse
import os
from pathlib import Path
import statistics
import sys
import tempfile
import time

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_overhead import initial_weights, paired_ratio, tune_run  # noqa: E402
from readme_table import write_readme_table  # noqa: E402

CONFIGS = {
    "tiny (vocabulary 259)": "configs/tiny/full_single_device.yaml",
    "152K vocabulary": "configs/tiny/qwen2_5_vocab152k_full_single_device.yaml",
}
ARMS = {
    "off": ["measure_noise_scale=False"],
    "norm_layers": ["measure_noise_scale=True", "noise_scale_estimator=norm_layers"],
    "micro_batches, split": ["measure_noise_scale=True", "noise_scale_split_step=True"],
}
FEATURES_OFF = ["batch_increase_function=null", "use_maximum_batch_size=False", "lr_scaling=none"]


# ---------------------------------------------------------------- cost, through the recipe


def cost_rows(config: str, rounds: int, steps: int, batch_size: int) -> list:
    """Per arm with the noise scale: the mean and spread over rounds of its step ratio to "off"."""
    import bench_overhead

    bench_overhead.CONFIG = config
    common = [f"batch_size={batch_size}", "log_peak_memory_stats=False", "epochs=1", *FEATURES_OFF]
    ratios = {arm: [] for arm in ARMS if arm != "off"}
    logged = {arm: steps for arm in ARMS}  # the fewest steps that logged it in any one run
    with tempfile.TemporaryDirectory() as d:
        shared = Path(d)
        run = [*common, *initial_weights(shared, common), f"max_steps_per_epoch={steps}"]
        names = list(ARMS)
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            logs = {arm: tune_run("recipes/full_finetune_single_device.py", shared / f"{r}_{i}", shared,
                                  [*run, *ARMS[arm]]) for i, arm in enumerate(order)}
            for arm in ratios:
                ratios[arm].append(paired_ratio(logs[arm], logs["off"]))
            for arm in ARMS:
                logged[arm] = min(logged[arm], sum("gradient_noise_scale" in row for row in logs[arm]))
    return [(arm, statistics.fmean(v), min(v), max(v), logged[arm]) for arm, v in ratios.items()]


# ---------------------------------------------------------------- agreement, in-process


class BothObservers:
    """Hands every call of the step to both estimators' observers."""

    def __init__(self, *observers):
        self.observers = observers

    def __getattr__(self, name):
        return lambda *args: [getattr(o, name)(*args) for o in self.observers]


def recipe_parts(config: str, data_dir: str):
    """The config's model, loss and text batches (samples shuffled by seed 0)."""
    from omegaconf import OmegaConf
    import torch
    from torchtune import config as tt_config
    from torchtune.data import padded_collate_sft

    from adaptive_batch.torchtune import next_token_loss

    cfg = OmegaConf.load(REPO / config)
    torch.manual_seed(0)
    model = tt_config.instantiate(cfg.model)
    loss_fn = tt_config.instantiate(cfg.loss)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    dataset = tt_config.instantiate(OmegaConf.merge(cfg.dataset, {"data_dir": data_dir}), tokenizer)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()

    def batches(batch_size):
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield padded_collate_sft([dataset[i] for i in order[start : start + batch_size]],
                                     padding_idx=tokenizer.pad_id, ignore_idx=loss_fn.ignore_index)

    def forward_backward(piece):
        tokens = (piece["labels"] != loss_fn.ignore_index).sum()
        loss = next_token_loss(model, loss_fn, piece) * tokens
        loss.backward()
        return loss.detach(), tokens

    def row_tokens(piece):
        return (piece["labels"][..., 1:] != loss_fn.ignore_index).sum(-1)

    return model, batches, forward_backward, row_tokens, float(cfg.optimizer.lr)


def mlp_parts(width=128, inputs=32):
    """A residual MLP with LayerNorm learning a fixed random teacher with noise."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(inputs, width), Block(), Block(), nn.LayerNorm(width), nn.Linear(width, 1))
    teacher = nn.Sequential(nn.Linear(inputs, 64), nn.Tanh(), nn.Linear(64, 1))
    g = torch.Generator().manual_seed(0)

    def batches(batch_size):
        for _ in range(100000):
            x = torch.randn(batch_size, inputs, generator=g)
            with torch.no_grad():
                y = teacher(x).squeeze(-1) + 0.3 * torch.randn(batch_size, generator=g)
            yield {"x": x, "y": y}

    def forward_backward(piece):
        loss = (model(piece["x"]).squeeze(-1) - piece["y"]).pow(2).sum()
        loss.backward()
        return loss.detach(), torch.tensor(piece["x"].shape[0])

    def row_tokens(piece):
        return torch.ones(piece["x"].shape[0], dtype=torch.long)

    return model, batches, forward_backward, row_tokens, 1e-3


def agreement(parts, steps: int, batch_size: int) -> dict:
    """Both estimators' ``B_noise`` in samples along one run of ``steps`` steps, each step two
    micro-batches."""
    import torch

    from adaptive_batch.distributed import RankGroup
    from adaptive_batch.run.step import accumulate_gradients
    from adaptive_batch.schedule.noise_scale import GradientNoiseScale, MicroBatchGradients
    from adaptive_batch.schedule.norm_layer_gradients import NormLayerGradients

    model, batches, forward_backward, row_tokens, lr = parts
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    micro, norm = MicroBatchGradients(list(model.parameters())), NormLayerGradients(model, row_tokens)
    norm.attach()
    both, ranks = BothObservers(micro, norm), RankGroup.alone()
    scales = {"micro_batches": GradientNoiseScale(), "norm_layers": GradientNoiseScale()}
    curves = {name: [] for name in scales}
    for step, batch in zip(range(steps), batches(batch_size)):
        done = accumulate_gradients(forward_backward, batch, rows=batch_size, micro_batch_limit=batch_size // 2,
                                    zero_grad=lambda: optimizer.zero_grad(set_to_none=True), observer=both)
        for name, observer in (("micro_batches", micro), ("norm_layers", norm)):
            noise = observer.step_noise(ranks)
            if noise is None:  # fewer than two parts this step: the curve holds its last point
                curves[name].append(curves[name][-1] if curves[name] else None)
                continue
            value = scales[name].update(noise.estimate)
            curves[name].append(None if value is None else value * batch_size / noise.tokens)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(float(done.num_tokens))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    norm.detach()
    return curves


def at_quarters(curve: list) -> list:
    n = len(curve)
    return [curve[max(0, n * k // 4 - 1)] for k in (1, 2, 3, 4)]


def agreement_rows(steps: int, data_dir: str) -> list:
    rows = []
    cases = [(name, lambda c=config: recipe_parts(c, data_dir), 8) for name, config in CONFIGS.items()]
    cases.append(("residual MLP with LayerNorm", mlp_parts, 64))
    for name, make, batch_size in cases:
        t0 = time.perf_counter()
        curves = agreement(make(), steps, batch_size)
        micro, norm = at_quarters(curves["micro_batches"]), at_quarters(curves["norm_layers"])
        rows.append((name, batch_size, micro, norm, time.perf_counter() - t0))
        print(name, micro, norm, flush=True)
    return rows


def fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--agreement-steps", type=int, default=200)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    import torch

    cost = {name: cost_rows(config, args.rounds, args.steps, args.batch_size) for name, config in CONFIGS.items()}
    with tempfile.TemporaryDirectory() as d:
        agree = agreement_rows(args.agreement_steps, f"{d}/data")
    lines = [
        f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, torchtune 0.6.1. Cost: batch {args.batch_size}, "
        f"{args.steps} steps a run, {args.rounds} rounds rotating which arm runs first; tokens/s against the run "
        "without the noise scale, the median over steps of the ratio at the same step.",
        "",
        "| model | estimator | tokens/s vs off (mean, range) | steps that logged `gradient_noise_scale` (fewest in a run) |",
        "|---|---|---|---|",
        *(f"| {name} | {arm} | {mean:.3f}x ({low:.3f}-{high:.3f}) | {logged} of {args.steps} |"
          for name, rows in cost.items() for arm, mean, low, high, logged in rows),
        "",
        f"Both estimators on the same run ({args.agreement_steps} steps of two micro-batches, AdamW): "
        "`B_noise` in samples at a quarter, half, three quarters and the end.",
        "",
        "| model | batch | micro_batches | norm_layers | norm_layers / micro_batches at the end | seconds |",
        "|---|---|---|---|---|---|",
        *(f"| {name} | {batch} | {' / '.join(fmt(v) for v in micro)} | {' / '.join(fmt(v) for v in norm)} | "
          f"{(norm[-1] / micro[-1]) if micro[-1] and norm[-1] else float('nan'):.2f} | {secs:.0f} |"
          for name, batch, micro, norm, secs in agree),
        "",
        f"Made by `python benchmarks/bench_noise_scale.py --rounds {args.rounds} --steps {args.steps} "
        f"--agreement-steps {args.agreement_steps}` on {time.strftime('%Y-%m-%d')}.",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        write_readme_table("bench_noise_scale", table)


if __name__ == "__main__":
    main()
