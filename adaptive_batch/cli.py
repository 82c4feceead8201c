"""The ``adaptive-batch`` command: plan memory without allocating it, or probe without training.

    adaptive-batch plan --config CONFIG [--device-memory 80GiB] [--json] [key=value ...]
    adaptive-batch probe --config CONFIG [--no-cache] [key=value ...]

``key=value`` overrides work as in ``tune run``.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch
from omegaconf import DictConfig

from adaptive_batch.config_checks import ConfigError, default_safety_margin
from adaptive_batch.memory import device_capacity, format_bytes, parse_memory
from adaptive_batch.planner import CATEGORY_ORDER, MemoryPlan, plan_memory
from adaptive_batch.search import BatchSizeTooLargeError

REPO_RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def load_config(config_path: str, overrides: Sequence[str]) -> DictConfig:
    """The config with ``key=value`` overrides merged the way ``tune run`` merges them.

    Raises:
        ConfigError: if the file is missing or an override is not ``key=value``.
    """
    from torchtune.config._utils import _merge_yaml_and_cli_args

    if not Path(config_path).is_file():
        raise ConfigError(f"--config {config_path!r}: no such file.")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value, e.g. batch_size=8.")
    yaml_args = argparse.Namespace(**_load_yaml(config_path))
    return _merge_yaml_and_cli_args(yaml_args, list(overrides))


def _load_yaml(path: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


# ---------------------------------------------------------------- plan


def plan_from_config(
    cfg: DictConfig,
    *,
    device_memory_bytes: Optional[int],
    safety_margin: float,
    max_batch_size: Optional[int] = None,
) -> MemoryPlan:
    """Plans the config's model, optimizer, loss, dtype, sequence length and activation
    checkpointing with fake tensors.

    Raises:
        ConfigError: when the config leaves the sequence length open, or sets what the
            planner cannot model (``optimizer_in_bwd``).
    """
    from torchtune import config, modules, training
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from adaptive_batch.loss import next_token_loss

    seq_len = cfg.tokenizer.get("max_seq_len", None)
    if seq_len is None:
        raise ConfigError(
            "tokenizer.max_seq_len=null: the plan needs the longest sequence a batch can hold; "
            "set tokenizer.max_seq_len, e.g. tokenizer.max_seq_len=2048."
        )
    if cfg.get("optimizer_in_bwd", False):
        raise ConfigError(
            "optimizer_in_bwd=True: the planner models a step that keeps all gradients until the "
            "optimizer step; set optimizer_in_bwd=False (adaptive batching needs it off too)."
        )
    dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=torch.device("cpu"))
    loss_fn = config.instantiate(cfg.loss)
    activation_checkpointing = bool(cfg.get("enable_activation_checkpointing", False))

    def build_model() -> torch.nn.Module:
        with training.set_default_dtype(dtype):
            model = config.instantiate(cfg.model)
        adapters = get_adapter_params(model)
        if adapters:  # LoRA: only the adapters train
            set_trainable_params(model, adapters)
        if activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if hasattr(loss_fn, "num_output_chunks"):
            model.set_num_output_chunks(loss_fn.num_output_chunks)
        return model

    def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return config.instantiate(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])

    def forward_backward(model: torch.nn.Module, batch: dict) -> None:
        next_token_loss(model, loss_fn, dict(batch)).backward()

    return plan_memory(
        build_model=build_model,
        build_optimizer=build_optimizer,
        forward_backward=forward_backward,
        seq_len=int(seq_len),
        device_memory_bytes=device_memory_bytes,
        safety_margin=safety_margin,
        max_batch_size=max_batch_size,
    )


def plan_table(plan: MemoryPlan) -> str:
    """The plan as a text table."""
    header = ["batch", "peak", *CATEGORY_ORDER[:4]]
    lines = [header]
    for row in plan.rows:
        marker = " <" if row.batch_size == plan.max_batch_size else ""
        lines.append(
            [str(row.batch_size), format_bytes(row.peak_bytes)]
            + [format_bytes(row.categories[c]) for c in CATEGORY_ORDER[:4]]
            + ([marker] if marker else [])
        )
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(header))]
    out = ["  ".join(cell.rjust(widths[i]) if i < len(widths) else cell for i, cell in enumerate(line)) for line in lines]
    est = plan.estimate
    out.append(
        f"seq_len {plan.seq_len}; peak(b) = {format_bytes(est.fixed_bytes)} + {format_bytes(est.bytes_per_sample)} x b; "
        f"planned in {plan.seconds:.1f}s without allocating"
    )
    if plan.budget_bytes is not None:
        out.append(
            f"largest batch under {format_bytes(plan.device_memory_bytes)} "
            f"(budget {format_bytes(plan.budget_bytes)}): {plan.max_batch_size}"
        )
    return "\n".join(out)


def plan_json(plan: MemoryPlan) -> dict:
    """The plan as one JSON object."""
    return {
        "max_batch_size": plan.max_batch_size,
        "device_memory_bytes": plan.device_memory_bytes,
        "budget_bytes": plan.budget_bytes,
        "seq_len": plan.seq_len,
        "estimate": plan.estimate.to_dict(),
        "rows": [{"batch_size": r.batch_size, "peak_bytes": r.peak_bytes, **r.categories} for r in plan.rows],
        "measured": [{"batch_size": r.batch_size, "peak_bytes": r.peak_bytes, **r.categories} for r in plan.measured],
        "seconds": plan.seconds,
    }


def _plan_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    device_type = args.device or str(cfg.get("device", "cpu"))
    if args.device_memory is not None:
        try:
            memory = parse_memory(args.device_memory, key="--device-memory")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif cfg.get("max_memory", None) is not None:
        memory = parse_memory(cfg.max_memory, capacity_bytes=device_capacity(torch.device("cpu")).headroom_bytes)
    else:
        local = torch.device("cuda" if device_type == "cuda" and torch.cuda.is_available() else "cpu")
        memory = device_capacity(local).headroom_bytes
    margin = args.safety_margin
    if margin is None:
        margin = cfg.get("memory_safety_margin", None)
    if margin is None:
        margin = default_safety_margin(device_type)
    plan = plan_from_config(
        cfg, device_memory_bytes=memory, safety_margin=float(margin), max_batch_size=cfg.get("max_batch_size", None)
    )
    print(json.dumps(plan_json(plan), indent=2) if args.json else plan_table(plan))
    if args.plot:
        from adaptive_batch.plot import plot_probe_report

        path = plot_probe_report(plan_report(plan), args.plot)
        print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def plan_report(plan: MemoryPlan) -> dict:
    """The plan in the shape of a probe report, for the plot: the fake-measured steps are its
    trials."""
    return {
        "trials": [
            {"phase": "planned", "batch_size": r.batch_size, "fits": True, "peak_bytes": r.peak_bytes}
            for r in plan.measured
        ],
        "estimate": plan.estimate.to_dict(),
        "budget_bytes": plan.budget_bytes,
        "max_batch_size": plan.max_batch_size,
        "batch_size": plan.max_batch_size,
        "seq_len": plan.seq_len,
        "device": f"a {format_bytes(plan.device_memory_bytes)} device (planned)",
    }


# ---------------------------------------------------------------- probe


def load_recipe_class(cfg: DictConfig, recipe: Optional[str]) -> Callable:
    """The recipe class for ``cfg``: the LoRA recipe for a LoRA model, else full finetuning.

    Raises:
        ConfigError: if the recipe file is not there (the recipes ship with the repository).
    """
    if recipe is None:
        name = "lora" if "lora" in str(cfg.model.get("_component_", "")) else "full"
        recipe = str(REPO_RECIPES / f"{name}_finetune_single_device.py")
    path = Path(recipe)
    if not path.is_file():
        raise ConfigError(f"--recipe {recipe!r}: no such file; point --recipe at recipes/<recipe>.py in the repository.")
    # This repository's `recipes` package must win over the one torchtune's wheel installs.
    root = str(path.resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    if "recipes" in sys.modules and not str(getattr(sys.modules["recipes"], "__file__", "")).startswith(root):
        del sys.modules["recipes"]
    module_name = f"recipes.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    classes = [
        v for v in vars(module).values()
        if isinstance(v, type) and v.__module__ == module_name and hasattr(v, "setup") and hasattr(v, "train")
    ]
    return classes[-1]


def probe_table(report: dict) -> str:
    """The probe's trials as a text table."""
    rows = [["trial", "phase", "batch", "fits", "peak", "seconds"]]
    for i, t in enumerate(report["trials"], 1):
        rows.append([
            str(i), t["phase"], str(t["batch_size"]), "yes" if t["fits"] else ("oom" if t.get("oom") else "no"),
            format_bytes(t["peak_bytes"]) if t.get("peak_bytes") is not None else "-", f"{t['seconds']:.2f}",
        ])
    out = _columns(rows)
    throughput = report.get("throughput")
    if throughput:
        out += _columns(
            [["batch", "samples/s", "s/step"]]
            + [[str(t["batch_size"]), f"{t['samples_per_second']:.1f}", f"{t['seconds_per_step']:.3f}"] for t in throughput["trials"]]
        )
        out.append(f"fastest within {throughput['tolerance']:.0%}: batch {throughput['batch_size']}")
    if report.get("cache", {}).get("hit"):
        out.append(f"from the probe cache: {report['cache']['path']} (--no-cache probes again)")
    out.append(f"largest batch that fits: {report['max_batch_size']}; batch to use: {report['batch_size']}")
    return "\n".join(out)


def _columns(rows: List[List[str]]) -> List[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]


def _probe_command(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, "use_maximum_batch_size=True"]
    if args.no_cache:
        overrides.append("probe_cache=False")
    cfg = load_config(args.config, overrides)
    recipe_cls = load_recipe_class(cfg, args.recipe)
    # The recipe's own constructor and setup: the same checks and the same probe as `tune run`.
    recipe = recipe_cls(cfg=cfg)
    recipe.setup(cfg=cfg)
    report = recipe._probe_report
    recipe.cleanup()
    print(probe_table(report))
    if args.plot:
        from adaptive_batch.plot import plot_probe_report

        print(f"plot: {plot_probe_report(report, args.plot)}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``adaptive-batch`` console script."""
    parser = argparse.ArgumentParser(prog="adaptive-batch", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    overrides_note = "Arguments key=value override the config, before or after the options, as in `tune run`."
    plan = sub.add_parser(
        "plan", help="predict peak memory and the largest batch, allocating nothing", epilog=overrides_note
    )
    plan.add_argument("--config", required=True)
    plan.add_argument("--device-memory", help="memory to plan for, e.g. 80GiB (default: max_memory, else this machine)")
    plan.add_argument("--device", choices=["cpu", "cuda"], help="device kind, for the default safety margin")
    plan.add_argument("--safety-margin", type=float, help="fraction held back (default: the config's, else 0.05 cuda / 0.01 cpu)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--plot", metavar="PATH", help="draw predicted memory against batch size to PATH (needs matplotlib)")
    plan.set_defaults(run=_plan_command)

    probe = sub.add_parser(
        "probe", help="run only the recipe's offline probe: no training, no checkpoint", epilog=overrides_note
    )
    probe.add_argument("--config", required=True)
    probe.add_argument("--recipe", help="recipe file (default: the repository's LoRA or full single-device recipe)")
    probe.add_argument("--no-cache", action="store_true", help="probe again even if a cached result matches")
    probe.add_argument("--plot", metavar="PATH", help="draw memory against batch size to PATH (needs matplotlib)")
    probe.set_defaults(run=_probe_command)

    # key=value overrides may come before or after the options, as with `tune run`.
    args, overrides = parser.parse_known_args(argv)
    unknown = [item for item in overrides if item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = overrides
    try:
        return args.run(args)
    except (ConfigError, BatchSizeTooLargeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
