"""Checks of a recipe's settings that run before anything expensive is built.

Every failure is a :class:`ConfigError` whose message names the key, the value and the fix.
The functions take plain values, not a ``DictConfig``, so any loop can use them.
"""

import difflib
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from adaptive_batch.memory import MemorySpec, parse_memory
from adaptive_batch.lr_scaling import LR_SCALING_RULES, LR_SCALING_UNITS
from adaptive_batch.search import ROUNDING_MODES
from adaptive_batch.throughput import OBJECTIVES
from adaptive_batch.token_batching import LONG_SAMPLE_POLICIES, PICKING_ORDERS


class ConfigError(ValueError):
    """A setting the recipe cannot run with; the message says which and how to fix it."""


def check_known_keys(keys: Iterable[str], known_keys: Iterable[str]) -> None:
    """Rejects top-level keys the recipe does not read (``key=value`` typos add new keys).

    Raises:
        ConfigError: naming the first unknown key and the closest known one.
    """
    known = sorted(set(known_keys))
    for key in sorted(keys):
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        raise ConfigError(f"unknown config key {key!r}: this recipe does not read it; {hint}")


def check_bool(key: str, value: Any) -> bool:
    """Raises:
    ConfigError: unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false: set {key}=True or {key}=False.")
    return value


def check_positive_int(key: str, value: Any, *, allow_none: bool = False) -> Optional[int]:
    """Raises:
    ConfigError: unless ``value`` is an integer of at least 1 (or ``None`` when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = " or null" if allow_none else ""
        raise ConfigError(f"{key}={value!r} must be a positive integer{also}: e.g. {key}=8.")
    return value


def check_fraction(key: str, value: Any, example: str) -> float:
    """Raises:
    ConfigError: unless ``value`` is a number in ``[0, 1)``; ``example`` shows a good one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{key}={value!r} must be a number in [0, 1): e.g. {key}={example}.")
    return float(value)


def default_safety_margin(device_type: str) -> float:
    """The fraction of the budget held back when the config leaves it to the device.

    CUDA's caching allocator reserves more than it hands out (fragmentation), so 5%. On the CPU
    the probe counts live tensor bytes and glibc returns freed blocks at once, so 1% covers
    what kernels allocate outside tensors.
    """
    return 0.05 if device_type == "cuda" else 0.01


@dataclass(frozen=True)
class AdaptiveBatchOptions:
    """The checked adaptive-batch settings of a recipe.

    Attributes:
        use_maximum_batch_size: probe for the largest batch before training.
        max_memory_bytes: the user's memory limit for a step's peak, or ``None`` for the device.
        memory_safety_margin: fraction of the limit held back for fragmentation.
        batch_size_rounding: ``"none"`` or ``"power_of_two"``.
        max_batch_size: the largest batch the probe may choose, or ``None``.
        batch_size_objective: ``"max_fit"`` (the largest) or ``"throughput"`` (the smallest
            within ``throughput_tolerance`` of the best samples per second).
        throughput_tolerance: the fraction of the best rate a smaller batch may fall short by.
        probe_cache: reuse a cached probe result with the same key.
        probe_cache_dir: where the cache lives, or ``None`` for the user's cache directory.
        plot: draw memory against batch size to ``batch_probe.png``.
    """

    use_maximum_batch_size: bool
    max_memory_bytes: Optional[int]
    memory_safety_margin: float
    batch_size_rounding: str
    max_batch_size: Optional[int]
    batch_size_objective: str = "max_fit"
    throughput_tolerance: float = 0.02
    probe_cache: bool = True
    probe_cache_dir: Optional[str] = None
    plot: bool = False


def check_adaptive_batch_options(
    *,
    batch_size: Any,
    use_maximum_batch_size: Any,
    max_memory: MemorySpec,
    memory_safety_margin: Any,
    batch_size_rounding: Any,
    max_batch_size: Any,
    device_type: str,
    device_capacity_bytes: Optional[int],
    batch_size_objective: Any = "max_fit",
    throughput_tolerance: Any = 0.02,
    probe_cache: Any = True,
    probe_cache_dir: Any = None,
    plot: Any = False,
) -> AdaptiveBatchOptions:
    """Checks the adaptive-batch keys of a recipe config.

    Args:
        batch_size: the config's ``batch_size`` (used as is when probing is off).
        use_maximum_batch_size: must be a boolean.
        max_memory: bytes, a size string, a fraction of the device, or ``None``.
        memory_safety_margin: a float in ``[0, 1)``, or ``None`` for the device's default
            (:func:`default_safety_margin`).
        batch_size_rounding: one of ``ROUNDING_MODES``.
        max_batch_size: a positive integer or ``None``.
        device_type: ``"cpu"``, ``"cuda"``, ...; picks the default safety margin.
        device_capacity_bytes: what the device can hold, to read fractions and reject a
            ``max_memory`` larger than the device; ``None`` when unknown.
        batch_size_objective: one of ``OBJECTIVES``.
        throughput_tolerance: a number in ``[0, 1)``.
        probe_cache: must be a boolean.
        probe_cache_dir: a path or ``None``.
        plot: must be a boolean; ``True`` needs matplotlib.

    Returns:
        The checked options.

    Raises:
        ConfigError: for the first bad value.
    """
    check_positive_int("batch_size", batch_size)
    use_max = check_bool("use_maximum_batch_size", use_maximum_batch_size)
    try:
        max_memory_bytes = parse_memory(max_memory, capacity_bytes=device_capacity_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if memory_safety_margin is None:
        memory_safety_margin = default_safety_margin(device_type)
    check_fraction("memory_safety_margin", memory_safety_margin, "0.05 keeps 5% of the budget back")
    if batch_size_rounding not in ROUNDING_MODES:
        raise ConfigError(
            f"batch_size_rounding={batch_size_rounding!r} is not one of {list(ROUNDING_MODES)}: "
            "use batch_size_rounding=none to keep the exact size."
        )
    cap = check_positive_int("max_batch_size", max_batch_size, allow_none=True)
    if batch_size_objective not in OBJECTIVES:
        raise ConfigError(
            f"batch_size_objective={batch_size_objective!r} is not one of {list(OBJECTIVES)}: max_fit "
            "takes the largest batch that fits, throughput the fastest."
        )
    check_fraction(
        "throughput_tolerance", throughput_tolerance, "0.02 takes the smallest batch within 2% of the best samples per second"
    )
    cache = check_bool("probe_cache", probe_cache)
    if probe_cache_dir is not None and not isinstance(probe_cache_dir, str):
        raise ConfigError(f"probe_cache_dir={probe_cache_dir!r} must be a directory path or null.")
    if check_bool("plot", plot):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(
                "plot=True needs matplotlib, which is not installed: pip install 'adaptive-batch[plot]', "
                "or set plot=False."
            ) from None
    return AdaptiveBatchOptions(
        use_maximum_batch_size=use_max,
        max_memory_bytes=max_memory_bytes,
        memory_safety_margin=float(memory_safety_margin),
        batch_size_rounding=batch_size_rounding,
        max_batch_size=cap,
        batch_size_objective=batch_size_objective,
        throughput_tolerance=float(throughput_tolerance),
        probe_cache=cache,
        probe_cache_dir=probe_cache_dir,
        plot=plot,
    )


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
) -> None:
    """The combinations torchtune's full-finetune recipe rejects, plus the probe's own.

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
    if compile_model and device_type == "npu":
        raise ConfigError("compile=True on device='npu': NPU cannot compile the model; set compile=False.")
    if use_maximum_batch_size and optimizer_in_bwd:
        raise ConfigError(
            "use_maximum_batch_size=True with optimizer_in_bwd=True: the probe cannot yet save and "
            "restore per-parameter optimizers; set optimizer_in_bwd=False."
        )


@dataclass(frozen=True)
class TokenBatchOptions:
    """The checked token-budget and LR-scaling settings of a recipe.

    Attributes:
        max_tokens: the padded-token budget of a batch, or ``None`` for fixed-size batches.
        sequence_picking_order: ``"dataloader"``, ``"seqlen"`` or ``"random"``.
        min_batch_size: the fewest samples in a full token batch.
        long_sample_policy: ``"truncate"`` or ``"error"`` for samples over ``max_tokens``.
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``.
        lr_scaling_unit: ``"samples"`` or ``"tokens"``.
        lr_scaling_reference: the batch the configured LR was set for, in that unit.
    """

    max_tokens: Optional[int]
    sequence_picking_order: str
    min_batch_size: int
    long_sample_policy: str
    lr_scaling: str
    lr_scaling_unit: str
    lr_scaling_reference: Optional[float]


def check_token_batch_options(
    *,
    max_tokens: Any,
    sequence_picking_order: Any,
    min_batch_size: Any,
    max_batch_size: Any,
    long_sample_policy: Any,
    lr_scaling: Any,
    lr_scaling_unit: Any,
    lr_scaling_reference: Any,
    batch_size: int,
    packed: bool,
    gradient_accumulation_steps: int = 1,
) -> TokenBatchOptions:
    """Checks the token-budget and LR-scaling keys of a recipe config.

    Args:
        max_tokens: positive integer, or ``None`` for fixed-size batches.
        sequence_picking_order: one of ``PICKING_ORDERS``.
        min_batch_size: positive integer, at most ``max_batch_size``.
        max_batch_size: positive integer or ``None``.
        long_sample_policy: one of ``LONG_SAMPLE_POLICIES``.
        lr_scaling: one of ``LR_SCALING_RULES``.
        lr_scaling_unit: one of ``LR_SCALING_UNITS``.
        lr_scaling_reference: positive number, or ``None`` for ``batch_size`` samples.
        batch_size: the config's batch size (times ``gradient_accumulation_steps``, the
            default reference).
        packed: whether the dataset is packed (cannot combine with ``max_tokens``).
        gradient_accumulation_steps: must be 1 with ``max_tokens`` (a token batch is one
            optimizer step).

    Returns:
        The checked options.

    Raises:
        ConfigError: for the first bad value or combination.
    """
    check_positive_int("max_tokens", max_tokens, allow_none=True)
    if sequence_picking_order not in PICKING_ORDERS:
        raise ConfigError(
            f"sequence_picking_order={sequence_picking_order!r} is not one of {list(PICKING_ORDERS)}: "
            "use dataloader, seqlen or random."
        )
    check_positive_int("min_batch_size", min_batch_size)
    if max_batch_size is not None and isinstance(max_batch_size, int) and min_batch_size > max_batch_size:
        raise ConfigError(
            f"min_batch_size={min_batch_size} is larger than max_batch_size={max_batch_size}: "
            "lower min_batch_size or raise max_batch_size."
        )
    if long_sample_policy not in LONG_SAMPLE_POLICIES:
        raise ConfigError(
            f"long_sample_policy={long_sample_policy!r} is not one of {list(LONG_SAMPLE_POLICIES)}: "
            "truncate cuts samples longer than max_tokens, error stops the run."
        )
    if max_tokens is not None and packed:
        raise ConfigError(
            f"max_tokens={max_tokens} with dataset.packed=True: packed samples are already "
            "max_seq_len tokens each; set dataset.packed=False or max_tokens=null."
        )
    if max_tokens is not None and gradient_accumulation_steps != 1:
        raise ConfigError(
            f"gradient_accumulation_steps={gradient_accumulation_steps} with max_tokens={max_tokens}: "
            "a token batch is one optimizer step (split into micro-batches only if it runs out "
            "of memory); set gradient_accumulation_steps=1 and raise max_tokens instead."
        )
    if lr_scaling not in LR_SCALING_RULES:
        raise ConfigError(f"lr_scaling={lr_scaling!r} is not one of {list(LR_SCALING_RULES)}: use none, linear or sqrt.")
    if lr_scaling_unit not in LR_SCALING_UNITS:
        raise ConfigError(f"lr_scaling_unit={lr_scaling_unit!r} is not one of {list(LR_SCALING_UNITS)}.")
    if lr_scaling_reference is not None and (
        isinstance(lr_scaling_reference, bool)
        or not isinstance(lr_scaling_reference, (int, float))
        or lr_scaling_reference <= 0
    ):
        raise ConfigError(
            f"lr_scaling_reference={lr_scaling_reference!r} must be a positive number of "
            f"{lr_scaling_unit}, or null for batch_size samples."
        )
    if lr_scaling != "none" and lr_scaling_unit == "tokens" and lr_scaling_reference is None:
        raise ConfigError(
            "lr_scaling_unit=tokens needs lr_scaling_reference: the number of real tokens per "
            "step the configured LR was tuned for, e.g. lr_scaling_reference=4096."
        )
    reference = lr_scaling_reference if lr_scaling_reference is not None else batch_size * gradient_accumulation_steps
    return TokenBatchOptions(
        max_tokens=max_tokens,
        sequence_picking_order=sequence_picking_order,
        min_batch_size=min_batch_size,
        long_sample_policy=long_sample_policy,
        lr_scaling=lr_scaling,
        lr_scaling_unit=lr_scaling_unit,
        lr_scaling_reference=float(reference),
    )
