"""Every check of a run's config, before anything expensive: the one module that refuses one.

A recipe calls :func:`check_command_line` before torchtune parses its arguments (a config that
does not load is one line), then :func:`check_run_settings` first thing in ``__init__``: every
number in the config is finite, the run's scalar keys have the right type and range, and every
directory the run will write (output, checkpoints, logs, the probe cache) can be written, with no
file in the way of a checkpoint; :func:`check_stock_recipe_options` and :func:`check_profiler`
refuse the combinations torchtune's recipe refuses, and the probe's own. The adaptive keys check
themselves as :class:`~adaptive_batch.run.options.AdaptiveBatchOptions` is built.
"""

import math
import os
import tempfile
from typing import Any, Iterator, Optional, Sequence, Tuple, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from adaptive_batch.errors import ConfigError
from adaptive_batch.torchtune.config import load_config
from adaptive_batch.validation import check_positive_int


def config_leaves(cfg: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """Every ``(dotted key, value)`` in ``cfg`` whose value is not a mapping or list, nested
    nodes included (``model._component_``, ``optimizer.lr``)."""
    container = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, (DictConfig, ListConfig)) else cfg
    items = container.items() if isinstance(container, dict) else enumerate(container) if isinstance(container, list) else ()
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, (dict, list)):
            yield from config_leaves(value, name)
        else:
            yield name, value


def non_finite_numbers(cfg: Any) -> Iterator[Tuple[str, float]]:
    """Every ``(dotted key, value)`` in ``cfg`` whose value is a NaN or infinite float."""
    return ((name, v) for name, v in config_leaves(cfg) if isinstance(v, float) and not math.isfinite(v))


def check_finite_numbers(cfg: Any) -> None:
    """Raises:
    ConfigError: naming the first key whose value is NaN or infinite."""
    for name, value in non_finite_numbers(cfg):
        raise ConfigError(
            f"{name}={value!r} is not a finite number: no setting of this recipe takes NaN or infinity; "
            f"give {name} a finite value, or null where the key allows it."
        )


def check_seed(seed: Any) -> None:
    """Raises:
    ConfigError: unless ``seed`` is a non-negative integer or ``None``."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"seed={seed!r} must be a non-negative integer or null: e.g. seed=42.")


def check_writable_dir(key: str, path: Any) -> str:
    """Makes sure ``path`` is, or can be created as, a directory this process can write in.

    It really writes (so permissions, read-only mounts and quotas all count): a temporary file
    in ``path`` when it exists, else a temporary directory in its nearest existing ancestor.
    Both have unique names and are removed, so the check leaves nothing behind and ranks
    checking the same path at once do not trip over each other.

    Raises:
        ConfigError: for a path that is not a string, is a file or lies under one, or cannot
            be written, with the reason.
    """
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}={path!r} must be a directory path.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is a file, not a directory: point {key} at a directory.")
    ancestor = os.path.abspath(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    fix = f"point {key} at a directory you can write"
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{key}={path!r} cannot be written ({ancestor!r} is a file): {fix}.")
    try:
        if os.path.isdir(path):
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            with tempfile.TemporaryDirectory(dir=ancestor):
                pass
    except OSError as e:
        raise ConfigError(f"{key}={path!r} cannot be written ({e.strerror or e}): {fix}.") from None
    return path


def check_writable_file(key: str, path: str, fix: Optional[str] = None) -> str:
    """Makes sure a file can be written at ``path``.

    Args:
        key: what names the path in the message.
        path: the file.
        fix: what to do when a directory is in the way (default: give another path).

    Raises:
        ConfigError: when ``path`` is a directory or its directory cannot be written.
    """
    if os.path.isdir(path):
        fix = fix or f"give a file path, e.g. {os.path.join(path, 'plot.png')!r}"
        raise ConfigError(f"{key}={path!r} is a directory: {fix}.")
    check_writable_dir(f"{key} (its directory)", os.path.dirname(os.path.abspath(path)))
    return path


def check_checkpoint_dir(key: str, path: Any, epochs: int) -> None:
    """The checkpoint directory can be written and no file sits where an epoch's folder goes.

    Raises:
        ConfigError: for an unwritable directory or an ``epoch_N`` that is a file.
    """
    check_writable_dir(key, path)
    for epoch in range(epochs):
        folder = os.path.join(path, f"epoch_{epoch}")
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ConfigError(
                f"{key}={path!r} holds a file named epoch_{epoch} where the checkpoint of epoch {epoch} "
                f"goes: move or remove {folder!r}, or set {key} to another directory."
            )


def model_max_seq_len(cfg: DictConfig) -> Optional[int]:
    """The longest input the model's config states (``model.max_seq_len``), or ``None``."""
    model = cfg.get("model", None)
    value = model.get("max_seq_len", None) if model is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_seq_len(cfg: DictConfig) -> Optional[int]:
    """``tokenizer.max_seq_len``: an integer of at least 2 and no longer than the model's
    ``max_seq_len`` (the model refuses a longer input in its forward), or null.

    Raises:
        ConfigError: otherwise.
    """
    tokenizer = cfg.get("tokenizer", None)
    max_seq_len = tokenizer.get("max_seq_len", None) if tokenizer is not None else None
    if max_seq_len is None:
        return None
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ConfigError(
            f"tokenizer.max_seq_len={max_seq_len!r} must be an integer of at least 2, or null: "
            "e.g. tokenizer.max_seq_len=2048."
        )
    model_max = model_max_seq_len(cfg)
    if model_max is not None and max_seq_len > model_max:
        raise ConfigError(
            f"tokenizer.max_seq_len={max_seq_len} is longer than model.max_seq_len={model_max}: the model refuses "
            f"longer inputs; set tokenizer.max_seq_len to at most {model_max}, or raise model.max_seq_len."
        )
    return max_seq_len


RESUME_AUTO = "auto"


def check_resume_setting(value: Any) -> Union[bool, str]:
    """``resume_from_checkpoint``: ``True`` (resume, refuse when nothing is saved), ``False``
    (start afresh) or ``"auto"`` (resume when something is saved, else start: a requeued job).

    Raises:
        ConfigError: for any other value.
    """
    if value is True or value is False or value == RESUME_AUTO:
        return value
    raise ConfigError(
        f"resume_from_checkpoint={value!r}: use True (resume), False (start afresh) or auto (resume when "
        "output_dir holds a checkpoint, start afresh when it does not)."
    )


def component_nodes(cfg: Any) -> Iterator[Tuple[str, Any]]:
    """Every ``(dotted key, _component_ value)`` in ``cfg``, nested nodes included."""
    return ((name, v) for name, v in config_leaves(cfg) if name.rsplit(".", 1)[-1] == "_component_")


def check_components(cfg: Any, only: Optional[Tuple[str, ...]] = None) -> None:
    """Every ``_component_`` in the config (or in its top-level nodes ``only``) names something
    that imports, so a misspelt model or optimizer is one line before any data is read or model
    built.

    Raises:
        ConfigError: naming the key, the value, why, and the closest name that exists.
    """
    from torchtune.config._utils import _get_component_from_path

    for key, path in component_nodes(cfg):
        if only is not None and key.split(".")[0] not in only:
            continue
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{key}={path!r} must be a dotted path to a class or function, e.g. torch.optim.AdamW.")
        try:
            _get_component_from_path(path)
        except Exception as e:  # noqa: BLE001 - an import error or an error inside the module
            cause = e.__cause__ or e
            reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise ConfigError(
                f"{key}={path!r} cannot be imported ({type(cause).__name__}: {reason}){_closest_name(path)}"
            ) from None


def _closest_name(path: str) -> str:
    """``"; did you mean 'pkg.mod.name'?"`` for the nearest name in the deepest module that
    imports, or a hint to check the spelling."""
    import difflib
    import importlib

    module_path, _, name = path.rpartition(".")
    while module_path:
        try:
            module = importlib.import_module(module_path)
        except Exception:  # noqa: BLE001 - try the parent module
            module_path, _, name = module_path.rpartition(".")
            continue
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if close:
            return f": did you mean {module_path}.{close[0]!r}?".replace(f"{module_path}.'", f"'{module_path}.")
        return f": {module_path!r} has no {name!r}; check the spelling."
    return ": check the spelling, and that its package is installed."


def check_weight_decay_scaling(cfg: DictConfig) -> None:
    """``weight_decay_scaling: timescale`` needs an optimizer whose weight decay is not zero
    (the config's, else its class's default): zero scaled stays zero, a silent no-op.

    Raises:
        ConfigError: for a weight decay of zero.
    """
    import inspect

    from torchtune.config._utils import _get_component_from_path

    optimizer = cfg.get("optimizer", None)
    if cfg.get("weight_decay_scaling", "none") != "timescale" or not isinstance(optimizer, DictConfig):
        return
    decay = optimizer.get("weight_decay", None)
    if decay is None:
        try:
            default = inspect.signature(_get_component_from_path(optimizer._component_)).parameters.get("weight_decay")
        except (TypeError, ValueError):
            return  # no signature to read: the scaler checks the built optimizer
        decay = None if default is None else default.default
    if decay == 0:
        raise ConfigError(
            f"weight_decay_scaling='timescale' with {optimizer._component_}'s weight_decay=0: scaling zero changes "
            "nothing; set optimizer.weight_decay above 0, or weight_decay_scaling=none."
        )


def check_run_settings(cfg: DictConfig, *, probe_cache_dir: Optional[str] = None) -> None:
    """Everything about a run that can be checked before a model is built.

    Args:
        cfg: the recipe config.
        probe_cache_dir: the probe cache's directory when the run will use it.

    Raises:
        ConfigError: for the first bad setting.
    """
    check_finite_numbers(cfg)
    check_components(cfg)
    check_weight_decay_scaling(cfg)
    check_seed(cfg.get("seed", None))
    epochs = check_positive_int("epochs", cfg.get("epochs", None))
    check_positive_int("max_steps_per_epoch", cfg.get("max_steps_per_epoch", None), allow_none=True)
    check_positive_int("log_every_n_steps", cfg.get("log_every_n_steps", 1))
    check_resume_setting(cfg.get("resume_from_checkpoint", False))
    check_seq_len(cfg)
    check_writable_dir("output_dir", cfg.get("output_dir", None))
    checkpointer = cfg.get("checkpointer", None)
    if checkpointer is not None and checkpointer.get("output_dir", None) is not None:
        check_checkpoint_dir("checkpointer.output_dir", checkpointer.output_dir, epochs)
    if checkpointer is not None and checkpointer.get("checkpoint_files", None) is None:
        # The recipe writes a random initialisation there.
        check_writable_dir("checkpointer.checkpoint_dir", checkpointer.get("checkpoint_dir", None))
    logger = cfg.get("metric_logger", None)
    if logger is not None and logger.get("log_dir", None) is not None:
        check_writable_dir("metric_logger.log_dir", logger.log_dir)
    if probe_cache_dir is not None:
        check_writable_dir("probe_cache_dir", probe_cache_dir)


def norm_layer_noise_scale(cfg: Any) -> bool:
    """Whether the config measures the noise scale from the norm layers' per-example gradients."""
    return cfg.get("measure_noise_scale", False) is True and cfg.get("noise_scale_estimator", None) == "norm_layers"


def check_stock_recipe_options(
    *,
    dtype: str,
    device_type: str,
    optimizer_in_bwd: bool,
    gradient_accumulation_steps: Any,
    clip_grad_norm: Any,
    enable_activation_checkpointing: bool,
    enable_activation_offloading: bool,
    collate_fn: str,
    compile_model: bool,
    use_maximum_batch_size: bool,
    norm_layer_noise_scale: bool = False,
) -> None:
    """The combinations torchtune's full-finetune recipe rejects, plus the probe's own and the
    norm-layer noise scale's (``norm_layer_noise_scale``: ``measure_noise_scale`` with
    ``noise_scale_estimator: norm_layers``).

    Raises:
        ConfigError: for the first bad combination.
    """
    if dtype == "fp16":
        raise ConfigError("dtype='fp16': full fp16 training is not supported by this recipe; set dtype=bf16 or dtype=fp32.")
    check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    if optimizer_in_bwd and clip_grad_norm is not None:
        raise ConfigError(
            f"clip_grad_norm={clip_grad_norm!r} with optimizer_in_bwd=True: gradient clipping needs "
            "the whole gradient; set clip_grad_norm=null or optimizer_in_bwd=False."
        )
    if optimizer_in_bwd and gradient_accumulation_steps > 1:
        raise ConfigError(
            f"gradient_accumulation_steps={gradient_accumulation_steps} with optimizer_in_bwd=True: "
            "set gradient_accumulation_steps=1 or optimizer_in_bwd=False."
        )
    if enable_activation_offloading and device_type != "cuda":
        raise ConfigError(
            f"enable_activation_offloading=True on device={device_type!r}: offloading moves "
            "activations from CUDA to the CPU; set enable_activation_offloading=False."
        )
    if enable_activation_offloading and not enable_activation_checkpointing:
        raise ConfigError(
            "enable_activation_offloading=True needs enable_activation_checkpointing=True: "
            "set both, or enable_activation_offloading=False."
        )
    if "left_pad_sequence" in collate_fn:
        raise ConfigError(
            f"collate_fn={collate_fn!r} is for inference only: use torchtune.data.padded_collate_sft."
        )
    if compile_model and norm_layer_noise_scale:
        raise ConfigError(
            "noise_scale_estimator='norm_layers' with compile=True: its hooks on the norm layers' outputs are not "
            "tested inside compiled layers; set compile=False or noise_scale_estimator=micro_batches."
        )
    if compile_model and device_type == "npu":
        raise ConfigError("compile=True on device='npu': NPU cannot compile the model; set compile=False.")
    if use_maximum_batch_size and optimizer_in_bwd:
        raise ConfigError(
            "use_maximum_batch_size=True with optimizer_in_bwd=True: the probe cannot yet save and "
            "restore per-parameter optimizers; set optimizer_in_bwd=False."
        )


def check_profiler(cfg_profiler: Any, device_type: str) -> None:
    """torchtune records a CUDA memory-history window for ``profile_memory``; there is none to
    record off CUDA.

    Raises:
        ConfigError: for ``profiler.profile_memory=True`` on another device.
    """
    if cfg_profiler is not None and cfg_profiler.get("enabled", False) and cfg_profiler.get("profile_memory", False):
        if device_type != "cuda":
            raise ConfigError(
                f"profiler.profile_memory=True on device={device_type!r}: the memory snapshot records "
                "CUDA allocations only; set profiler.profile_memory=False."
            )


def check_command_line(argv: Sequence[str]) -> None:
    """What ``tune run`` hands a recipe (``--config PATH key=value ...``) loads as a config.

    torchtune's ``config.parse`` would end a YAML syntax error or an unparsable override in a
    traceback; a recipe calls this first, so each is one line.

    Raises:
        SystemExit: with an ``error:`` line, when the config does not load.
    """
    args = list(argv)
    path = None
    for i, item in enumerate(args):
        if item == "--config" and i + 1 < len(args):
            path = args[i + 1]
        elif item.startswith("--config="):
            path = item.split("=", 1)[1]
    if path is None:
        return  # argparse says what is missing
    overrides = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] != "--config")]
    try:
        load_config(path, overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
