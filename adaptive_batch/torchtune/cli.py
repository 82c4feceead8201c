"""The ``adaptive-batch`` command: plan memory without allocating it, or probe without training.

    adaptive-batch plan --config CONFIG [--device-memory 80GiB] [--json] [key=value ...]
    adaptive-batch probe --config CONFIG [--no-cache] [key=value ...]

``key=value`` overrides work as in ``tune run``.
"""

import argparse
import importlib
import importlib.util
import json
from pathlib import Path
import sys
from typing import Callable, FrozenSet, List, Optional

from omegaconf import DictConfig
import torch

from adaptive_batch.errors import BatchSizeTooLargeError, ConfigError
from adaptive_batch.memory.device import device_capacity, format_bytes, parse_memory
from adaptive_batch.probe.fake_step import CATEGORY_ORDER
from adaptive_batch.probe.plan import MemoryPlan
from adaptive_batch.probe.report import ProbeReport
from adaptive_batch.probe.search import Trial
from adaptive_batch.memory.budget import default_safety_margin
from adaptive_batch.schedule.global_batch import check_global_batch, split_global_batch
from adaptive_batch.validation import check_known_keys, check_positive_int, check_safety_margin

# The repository's `recipes/` folder, installed as this package (see pyproject.toml).
RECIPES_PACKAGE = "adaptive_batch_recipes"


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
            + (f" per rank x {plan.world_size} ranks" if plan.world_size > 1 else "")
            + f", {plan.max_batch_size * plan.seq_len * plan.world_size} tokens per step"
        )
    out += [f"assumed: {note}" for note in plan.assumptions]
    return "\n".join(out)


def plan_json(plan: MemoryPlan) -> dict:
    """The plan as one JSON object."""
    return {
        "max_batch_size": plan.max_batch_size,
        "world_size": plan.world_size,
        "tokens_per_step": None if plan.max_batch_size is None else plan.max_batch_size * plan.seq_len * plan.world_size,
        "assumptions": plan.assumptions,
        "device_memory_bytes": plan.device_memory_bytes,
        "budget_bytes": plan.budget_bytes,
        "seq_len": plan.seq_len,
        "estimate": plan.estimate.to_dict(),
        "rows": [{"batch_size": r.batch_size, "peak_bytes": r.peak_bytes, **r.categories} for r in plan.rows],
        "measured": [{"batch_size": r.batch_size, "peak_bytes": r.peak_bytes, **r.categories} for r in plan.measured],
        "seconds": plan.seconds,
    }


def _plan_command(args: argparse.Namespace) -> int:
    from adaptive_batch.torchtune.checks import check_components, check_finite_numbers, check_writable_file
    from adaptive_batch.torchtune.config import adaptive_options, load_config
    from adaptive_batch.torchtune.planning import plan_from_config

    cfg = load_config(args.config, args.overrides)
    # As strictly as `probe` and `tune run` read it: a typo or a batch of 0 planned without a word.
    check_known_keys(cfg.keys(), _known_keys_of_the_recipes())
    adaptive_options(cfg)  # its sections check themselves, as the recipes build them
    check_positive_int("batch_size", cfg.get("batch_size", None), allow_none=True)
    check_finite_numbers(cfg)
    # The model only: the planner plans optimizers it cannot import (bitsandbytes) by their state.
    check_components(cfg, only=("model",))
    if args.plot:
        check_writable_file("--plot", args.plot)
    device_type = args.device or str(cfg.get("device", "cpu"))
    try:
        if args.device_memory is not None:
            memory = parse_memory(args.device_memory, key="--device-memory")
        elif cfg.get("max_memory", None) is not None:
            memory = parse_memory(cfg.max_memory, capacity_bytes=device_capacity(torch.device("cpu")).headroom_bytes)
        else:
            local = torch.device("cuda" if device_type == "cuda" and torch.cuda.is_available() else "cpu")
            memory = device_capacity(local).headroom_bytes
    except ValueError as e:
        raise ConfigError(str(e)) from None
    margin = args.safety_margin
    if margin is None:
        margin = cfg.get("memory_safety_margin", None)
    if margin is None:
        margin = default_safety_margin(device_type)
    check_safety_margin(margin, key="--safety-margin" if args.safety_margin is not None else "memory_safety_margin")
    global_batch = cfg.get("global_batch_size", None)
    if global_batch is not None:  # the split is per rank: the share must divide first
        check_positive_int("global_batch_size", global_batch)
        check_global_batch(global_batch, world_size=args.world_size, gradient_accumulation_steps=1)
    plan = plan_from_config(
        cfg,
        device_memory_bytes=memory,
        safety_margin=float(margin),
        max_batch_size=cfg.get("max_batch_size", None),
        world_size=args.world_size,
        device_type=device_type,
    )
    split = None
    if global_batch is not None and plan.max_batch_size:
        split = split_global_batch(global_batch, world_size=args.world_size, largest_micro_batch=plan.max_batch_size)
    if args.json:
        print(json.dumps(dict(plan_json(plan), global_batch=None if split is None else split.to_dict()), indent=2))
    else:
        print(plan_table(plan) + ("" if split is None else f"\n{split.describe()}"))
    if args.plot:
        from adaptive_batch.probe.plot import plot_probe_report

        path = plot_probe_report(plan_report(plan), args.plot)
        print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def plan_report(plan: MemoryPlan) -> ProbeReport:
    """The plan as a probe report, for the plot: the fake-measured steps are its trials."""
    return ProbeReport(
        trials=[
            Trial(batch_size=r.batch_size, fits=True, peak_bytes=r.peak_bytes, seconds=0.0, oom=False, phase="planned")
            for r in plan.measured
        ],
        estimate=plan.estimate.to_dict(),
        budget_bytes=plan.budget_bytes,
        max_batch_size=plan.max_batch_size,
        batch_size=plan.max_batch_size,
        seq_len=plan.seq_len,
        device=f"a {format_bytes(plan.device_memory_bytes)} device (planned)",
    )


# ---------------------------------------------------------------- probe


def _known_keys_of_the_recipes() -> FrozenSet[str]:
    """Every key one of the installed recipes reads (a plan serves any of them)."""
    keys: set = set()
    for name in ("full_finetune_single_device", "lora_finetune_single_device", "full_finetune_distributed"):
        module = importlib.import_module(f"{RECIPES_PACKAGE}.{name}")
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__ and hasattr(value, "known_keys"):
                keys |= set(value.known_keys)
    return frozenset(keys)


def load_recipe_class(cfg: DictConfig, recipe: Optional[str]) -> Callable:
    """The recipe class for ``cfg``: the LoRA recipe for a LoRA model, else full finetuning.

    Args:
        cfg: the config.
        recipe: a recipe file to load instead of the installed recipes.

    Raises:
        ConfigError: if the recipe file is not there.
    """
    if recipe is None:
        name = "lora" if "lora" in str(cfg.model.get("_component_", "")) else "full"
        module = importlib.import_module(f"{RECIPES_PACKAGE}.{name}_finetune_single_device")
    else:
        module = load_recipe_file(Path(recipe))
    classes = [
        v for v in vars(module).values()
        if isinstance(v, type) and v.__module__ == module.__name__ and hasattr(v, "setup") and hasattr(v, "train")
    ]
    return classes[-1]


def load_recipe_file(path: Path) -> object:
    """A recipe file of a ``recipes/`` folder, imported as ``recipes.<name>`` so its relative
    imports of sibling recipes work; that folder's parent goes first on ``sys.path``, before
    the ``recipes`` package torchtune's wheel installs."""
    if not path.is_file():
        raise ConfigError(f"--recipe {str(path)!r}: no such file; point --recipe at recipes/<recipe>.py.")
    root = str(path.resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    if "recipes" in sys.modules and not str(getattr(sys.modules["recipes"], "__file__", "")).startswith(root):
        for name in [m for m in sys.modules if m == "recipes" or m.startswith("recipes.")]:
            del sys.modules[name]
    module_name = f"recipes.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def probe_table(report: ProbeReport) -> str:
    """The probe's trials as a text table."""
    rows = [["trial", "phase", "batch", "fits", "peak", "seconds"]]
    for i, t in enumerate(report.trials, 1):
        rows.append([
            str(i), t.phase, str(t.batch_size), "yes" if t.fits else ("oom" if t.oom else "no"),
            format_bytes(t.peak_bytes) if t.peak_bytes is not None else "-", f"{t.seconds:.2f}",
        ])
    out = _columns(rows)
    throughput = report.throughput
    if throughput is not None:
        out += _columns(
            [["batch", "samples/s", "s/step"]]
            + [[str(t.batch_size), f"{t.samples_per_second:.1f}", f"{t.seconds_per_step:.3f}"] for t in throughput.trials]
        )
        out.append(f"fastest within {throughput.tolerance:.0%}: batch {throughput.batch_size}")
    if report.cache is not None and report.cache.hit:
        out.append(f"from the probe cache: {report.cache.path} (--no-cache probes again)")
    out.append(f"largest batch that fits: {report.max_batch_size}; batch to use: {report.batch_size}")
    return "\n".join(out)


def _columns(rows: List[List[str]]) -> List[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]


def _probe_command(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, "use_maximum_batch_size=True"]
    if args.no_cache:
        overrides.append("probe_cache=False")
    from adaptive_batch.torchtune.config import load_config

    cfg = load_config(args.config, overrides)
    if args.plot:
        from adaptive_batch.torchtune.checks import check_writable_file

        check_writable_file("--plot", args.plot)
    recipe_cls = load_recipe_class(cfg, args.recipe)
    # The recipe's own constructor and setup: the same checks and the same probe as `tune run`.
    recipe = recipe_cls(cfg=cfg)
    try:
        recipe.setup(cfg=cfg)
        report = recipe.probe_report
        recipe.cleanup()
    finally:
        recipe.release()  # output_dir's lock, however setup ended
    print(probe_table(report))
    if args.plot:
        from adaptive_batch.probe.plot import plot_probe_report

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
    plan.add_argument(
        "--world-size", type=int, default=1, help="plan one rank's share of N data-parallel ranks under FSDP2 (batch per rank)"
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--plot", metavar="PATH", help="draw predicted memory against batch size to PATH (needs matplotlib)")
    plan.set_defaults(run=_plan_command)

    probe = sub.add_parser(
        "probe", help="run only the recipe's offline probe: no training, no checkpoint", epilog=overrides_note
    )
    probe.add_argument("--config", required=True)
    probe.add_argument("--recipe", help="recipe file (default: the installed LoRA or full single-device recipe)")
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
        try:
            return args.run(args)
        except (TypeError, ValueError) as e:
            raise _as_a_config_error(e) from e
    except (ConfigError, BatchSizeTooLargeError) as e:
        print(f"error: {e}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading stdout gets an object, not nothing
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        return 1


def _as_a_config_error(error: Exception) -> Exception:
    """A component of the config that its own values fail to build (``model.num_layers=abc``,
    ``optimizer.lr=fast``), as one line naming it; any other error as it was (a traceback of 40
    lines ended in the component's own TypeError)."""
    frame, component = error.__traceback__, None
    while frame is not None:
        if frame.tb_frame.f_code.co_name == "_instantiate_node":
            component = frame.tb_frame.f_locals.get("node", {}).get("_component_")
        frame = frame.tb_next
    if component is None:
        return error
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ConfigError(f"_component_={component!r} could not be built from its section of the config "
                       f"({type(error).__name__}: {reason}); fix that section's keys and values (or the key=value "
                       "overrides).")


if __name__ == "__main__":
    sys.exit(main())
