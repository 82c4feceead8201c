"""torchtune configs onto the library's options: the one place a ``DictConfig`` is read.

:func:`adaptive_options` maps a recipe config's adaptive keys onto
:class:`~adaptive_batch.run.options.AdaptiveBatchOptions` (whose sections check themselves);
:func:`recipe_keys` is every top-level key a recipe reads, derived from those options and the
keys of torchtune's own recipe, so a typo (``batch_sise=8``) is caught; :func:`load_config`
merges a file and overrides as ``tune run`` does; :func:`build` instantiates a component. Every
check of a config's values is in :mod:`~adaptive_batch.torchtune.checks`.
"""

import argparse
from pathlib import Path
from typing import Any, Dict, Iterable, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
import torch
import yaml

from adaptive_batch.errors import ConfigError
from adaptive_batch.memory.device import format_bytes
from adaptive_batch.memory.oom import is_oom_error
from adaptive_batch.run.options import UNTRAINED_KEYS, AdaptiveBatchOptions

# The keys torchtune 0.6.1's full_finetune_single_device recipe reads.
TORCHTUNE_KEYS = frozenset(
    {
        "output_dir", "model", "tokenizer", "dataset", "seed", "shuffle", "checkpointer",
        "resume_from_checkpoint", "batch_size", "epochs", "optimizer", "loss", "lr_scheduler",
        "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer_in_bwd",
        "clip_grad_norm", "compile", "device", "enable_activation_checkpointing",
        "enable_activation_offloading", "dtype", "metric_logger", "log_every_n_steps",
        "log_peak_memory_stats", "profiler", "collate_fn", "cudnn_deterministic_mode",
    }
)


# Mid-epoch checkpoints (torchtune main's names; 0.6.1 saves at epoch ends only).
STEP_CHECKPOINT_KEYS = frozenset({"save_every_n_steps", "keep_last_n_checkpoints"})


def recipe_keys(extra: Iterable[str] = ()) -> frozenset:
    """Every top-level key a recipe reads: torchtune's, the adaptive ones, the step-checkpoint
    ones, and ``extra``."""
    return TORCHTUNE_KEYS | AdaptiveBatchOptions.keys() | STEP_CHECKPOINT_KEYS | frozenset(extra)


# The torchtune keys that change the samples, batches or updates a run trains; a resumed run's
# must match the checkpoint's. Logging, checkpoint cadence, devices and output paths do not.
TRAINED_KEYS = (
    "model", "tokenizer", "dataset", "seed", "shuffle", "batch_size", "epochs", "optimizer", "loss",
    "lr_scheduler", "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer_in_bwd", "clip_grad_norm",
    "dtype", "collate_fn",
)


def trained_settings(cfg: DictConfig) -> Dict[str, Any]:
    """The config's settings that change what is trained, as plain values, for
    :class:`~adaptive_batch.run.state.RunState`'s fingerprint."""
    keys = list(TRAINED_KEYS) + sorted(AdaptiveBatchOptions.keys() - UNTRAINED_KEYS)
    fits = ("enable_activation_checkpointing", "enable_activation_offloading")
    if cfg.get("use_maximum_batch_size", False):
        # What fits, where the probe's answer is trained: resumed with checkpointing off, the saved
        # answer trained at 2.4 times the budget.
        keys += fits
    settings = {}
    for key in keys:
        value = cfg.get(key, False if key in fits else None)  # unset is off, as the recipes read it
        settings[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return settings


def _increase_function(node: Any) -> Any:
    """A ``_component_`` node with arguments becomes the callable its factory builds; a node
    with only ``_component_`` names the function itself; a path string stays as is."""
    from torchtune import config

    if not isinstance(node, DictConfig):
        return node
    if set(node.keys()) == {"_component_"} and not _builds_without_arguments(node._component_):
        return node._component_  # the growth function itself, e.g. adaptive_batch.double_every_epoch
    try:
        return config.instantiate(node)
    except Exception as e:
        args = {k: v for k, v in node.items() if k != "_component_"}
        raise ConfigError(f"batch_increase_function: building {node.get('_component_')!r} with {args} failed: {e}") from None


def _builds_without_arguments(path: Any) -> bool:
    """Whether ``path`` names a factory that builds with no arguments (every one has a
    default), so a bare ``_component_`` node means "instantiate" as everywhere else."""
    import inspect

    from torchtune.config._utils import _get_component_from_path

    try:
        target = _get_component_from_path(path)
        inspect.signature(target).bind()
    except Exception:  # noqa: BLE001 - not importable here, or needs arguments: a function
        return False
    return callable(target)


def adaptive_options(cfg: DictConfig) -> AdaptiveBatchOptions:
    """The config's adaptive keys as checked options; absent keys keep their defaults.

    Raises:
        ConfigError: for the first bad value.
    """
    values = {key: cfg[key] for key in AdaptiveBatchOptions.keys() if key in cfg}
    if "batch_increase_function" in values:
        values["batch_increase_function"] = _increase_function(values["batch_increase_function"])
    return AdaptiveBatchOptions.from_flat(values)


def load_config(config_path: str, overrides: Sequence[str]) -> DictConfig:
    """The config with ``key=value`` overrides merged the way ``tune run`` merges them.

    Raises:
        ConfigError: if the file is missing, is not valid YAML or not a mapping of keys, or an
            override is not ``key=value`` or does not parse.
    """
    from torchtune.config._utils import _merge_yaml_and_cli_args

    if not Path(config_path).is_file():
        raise ConfigError(f"--config {config_path!r}: no such file.")
    for item in overrides:
        if "=" not in item and not item.startswith("~"):
            raise ConfigError(f"override {item!r} is not key=value, e.g. batch_size=8.")
    try:
        loaded = OmegaConf.load(config_path)
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {config_path!r} is not valid YAML: {_yaml_problem(e)}; fix the file there.") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"--config {config_path!r} is not text (byte {e.start} is no UTF-8): a config is a YAML file of "
            "`key: value` lines; point --config at one."
        ) from None
    except OSError as e:
        raise ConfigError(f"--config {config_path!r} cannot be read ({e.strerror}); fix its permissions.") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"--config {config_path!r} holds a {type(loaded).__name__}, not a mapping of keys: a config "
            "is `key: value` lines, e.g. `batch_size: 8`."
        )
    if "config" in loaded:
        raise ConfigError(f"--config {config_path!r} has a key named 'config', which tune run reserves: rename it.")
    yaml_args = argparse.Namespace(**OmegaConf.to_container(loaded, resolve=False))
    for item in [o for o in overrides if not o.startswith("~")]:
        try:
            _merge_yaml_and_cli_args(argparse.Namespace(), [item])
        except (OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
            reason = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
            raise ConfigError(
                f"override {item!r} does not parse ({reason}): quote a list or a string with spaces, "
                "e.g. 'optimizer.betas=[0.9,0.95]'."
            ) from None
    try:
        return _merge_yaml_and_cli_args(yaml_args, list(overrides))
    except ValueError as e:  # `~key` for a key the config lacks
        raise ConfigError(f"{str(e).strip()}: remove that ~override, or check the key's spelling.") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """Where and what, from a YAML parser error: ``line 3, column 7: found ...``."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).strip().splitlines()[-1]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _memory_left() -> str:
    """What this process may still map, for a message."""
    from adaptive_batch.memory.device import device_capacity

    try:
        capacity = device_capacity(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - the message goes out without it
        return "little memory left"
    return f"{format_bytes(capacity.headroom_bytes)} left under its {capacity.source}"


def build(key: str, node: DictConfig, *args: Any) -> Any:
    """``config.instantiate(node, *args)``, with a construction error as one line naming ``key``.

    Raises:
        ConfigError: when the component cannot be built (a missing file, a bad argument).
    """
    from torchtune import config

    try:
        return config.instantiate(node, *args)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any construction failure is the config's to fix
        component = node.get("_component_", None) if isinstance(node, DictConfig) else None
        if is_oom_error(e):  # the machine's limit, not the config's values
            raise ConfigError(
                f"{key}: building {component!r} ran out of memory ({type(e).__name__}): the process "
                f"has {_memory_left()}; raise the memory limit (ulimit -v, the job's memory request), "
                f"or build a smaller {key}."
            ) from None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: building {component!r} failed: {type(e).__name__}: {reason}") from None
