"""Every adaptive-batch setting, and the rules for how they combine.

:class:`AdaptiveBatchOptions` holds one section per owner, each checking its own values when
built. The rules between sections are two lists: :data:`SETTING_RULES` need the settings alone
and run in ``__post_init__``; :data:`RUN_RULES` need the run (device, ranks, the recipe's own
settings) and run in :meth:`AdaptiveBatchOptions.validate`. Each rule raises
:class:`~adaptive_batch.errors.ConfigError` naming the keys, their values and the fix.
"""

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, FrozenSet, List, Optional

import torch

from adaptive_batch.data.token_budget import TokenBatchOptions
from adaptive_batch.errors import ConfigError
from adaptive_batch.memory.device import device_capacity
from adaptive_batch.probe.cache import default_cache_dir
from adaptive_batch.probe.service import ProbeOptions
from adaptive_batch.schedule.global_batch import KEY as GLOBAL_KEY
from adaptive_batch.schedule.global_batch import GlobalBatchOptions, check_global_batch
from adaptive_batch.schedule.growth import KEY as GROWTH_KEY
from adaptive_batch.schedule.growth import GrowthOptions, function_identity, function_name
from adaptive_batch.schedule.lr_scaling import LRScalingOptions
from adaptive_batch.schedule.noise_scale import NoiseScaleOptions


@dataclass(frozen=True)
class RunContext:
    """What the run rules check the settings against.

    Attributes:
        device: where training runs.
        gradient_accumulation_steps: micro-batches a configured step has.
        packed: whether the dataset is packed.
        optimizer_in_bwd: whether the optimizer steps inside backward.
        world_size: data-parallel ranks.
        max_seq_len: the tokenizer's longest sequence, or ``None``.
    """

    device: torch.device
    gradient_accumulation_steps: int = 1
    packed: bool = False
    optimizer_in_bwd: bool = False
    world_size: int = 1
    max_seq_len: Optional[int] = None


# Adaptive keys that change nothing trained: where the probe's plot and cache go.
UNTRAINED_KEYS = frozenset({"plot", "probe_cache", "probe_cache_dir"})


@dataclass(frozen=True, kw_only=True)
class AdaptiveBatchOptions:
    """Every adaptive-batch setting, one section per owner; each section checks itself.

    Attributes:
        probe: finding the largest batch before training.
        growth: growing the batch during training.
        global_batch: a fixed global batch with probed micro-batches.
        noise: measuring the gradient noise scale.
        tokens: token-budget batches.
        lr_scaling: the LR following the batch.

    Raises:
        ConfigError: for the first combination :data:`SETTING_RULES` rejects.
    """

    probe: ProbeOptions = field(default_factory=ProbeOptions)
    growth: GrowthOptions = field(default_factory=GrowthOptions)
    global_batch: GlobalBatchOptions = field(default_factory=GlobalBatchOptions)
    noise: NoiseScaleOptions = field(default_factory=NoiseScaleOptions)
    tokens: TokenBatchOptions = field(default_factory=TokenBatchOptions)
    lr_scaling: LRScalingOptions = field(default_factory=LRScalingOptions)

    def __post_init__(self) -> None:
        for rule in SETTING_RULES:
            rule(self)

    @classmethod
    def keys(cls) -> FrozenSet[str]:
        """The flat setting names (the config keys), from the sections' fields."""
        return frozenset(f.name for section in fields(cls) for f in fields(section.default_factory))

    def trained_values(self) -> Dict[str, Any]:
        """Each flat setting that changes what is trained (:data:`UNTRAINED_KEYS` aside), as the
        run takes it, for :class:`~adaptive_batch.run.state.RunState`'s fingerprint: a function as
        its identity (:func:`function_identity`), any other object as its text."""
        def plain(value: Any) -> Any:
            if value is None or isinstance(value, (bool, int, float, str)):
                return value
            return function_identity(value) if callable(value) else str(value)

        return {f.name: plain(getattr(getattr(self, s.name), f.name)) for s in fields(self)
                for f in fields(getattr(self, s.name)) if f.name not in UNTRAINED_KEYS}

    @classmethod
    def defaults(cls) -> Dict[str, Any]:
        """Each flat setting's default, as its section holds it."""
        built = cls()
        return {f.name: getattr(getattr(built, s.name), f.name) for s in fields(cls) for f in fields(s.default_factory)}

    @classmethod
    def from_flat(cls, values: Dict[str, Any]) -> "AdaptiveBatchOptions":
        """Builds the sections from flat ``key: value`` settings; missing keys keep defaults.

        Raises:
            ConfigError: for a bad value, or a key no section has.
        """
        unknown = set(values) - cls.keys()
        if unknown:
            raise ConfigError(f"unknown adaptive-batch setting {sorted(unknown)[0]!r}; known: {sorted(cls.keys())}")
        sections = {}
        for section in fields(cls):
            names = {f.name for f in fields(section.default_factory)}
            sections[section.name] = section.default_factory(**{k: v for k, v in values.items() if k in names})
        return cls(**sections)

    @property
    def growing(self) -> bool:
        return self.growth.batch_increase_function is not None

    @property
    def needs_probe(self) -> bool:
        """Probing is asked for, or growth has no other bound than what fits."""
        return self.probe.use_maximum_batch_size or (self.growing and self.probe.max_batch_size is None)

    @property
    def probe_cache_dir(self) -> Optional[str]:
        """The directory the probe cache is read and written in, or ``None`` when unused."""
        if not (self.needs_probe and self.probe.probe_cache):
            return None
        return self.probe.probe_cache_dir or default_cache_dir()

    def validate(self, context: RunContext) -> None:
        """Checks the settings against the run, before anything expensive.

        Raises:
            ConfigError: for the first combination :data:`RUN_RULES` rejects.
        """
        for rule in RUN_RULES:
            rule(self, context)


# ---------------------------------------------------------------- rules on the settings alone


def _min_batch_within_max(o: AdaptiveBatchOptions) -> None:
    if o.probe.max_batch_size is not None and o.tokens.min_batch_size > o.probe.max_batch_size:
        raise ConfigError(
            f"min_batch_size={o.tokens.min_batch_size} is larger than max_batch_size={o.probe.max_batch_size}: "
            "lower min_batch_size or raise max_batch_size."
        )


def _global_batch_without_tokens(o: AdaptiveBatchOptions) -> None:
    global_batch, max_tokens = o.global_batch.global_batch_size, o.tokens.max_tokens
    if global_batch is not None and max_tokens is not None:
        raise ConfigError(
            f"{GLOBAL_KEY}={global_batch} with max_tokens={max_tokens}: a token budget "
            f"sets each step's samples; set max_tokens=null or {GLOBAL_KEY}=null."
        )


def _noise_growth_measures_noise(o: AdaptiveBatchOptions) -> None:
    function = o.growth.batch_increase_function
    if getattr(function, "needs_gradient_noise_scale", False) and not o.noise.measure_noise_scale:
        raise ConfigError(
            f"{GROWTH_KEY}={function_name(function)} grows toward the gradient noise "
            "scale, with measure_noise_scale=False: set measure_noise_scale=True (and, for steps of one "
            "micro-batch on one device, noise_scale_estimator=norm_layers or noise_scale_split_step=True)."
        )


def _interval_needs_growth(o: AdaptiveBatchOptions) -> None:
    if not o.growing and not o.growth.batch_increase_interval.per_epoch:
        raise ConfigError(
            f"batch_increase_interval='{o.growth.batch_increase_interval}' without a batch_increase_function: "
            "nothing would grow; set batch_increase_function, or batch_increase_interval=epoch."
        )


def _growth_without_tokens(o: AdaptiveBatchOptions) -> None:
    if o.growing and o.tokens.max_tokens is not None:
        raise ConfigError(
            f"{GROWTH_KEY} with max_tokens={o.tokens.max_tokens}: token-budget batches change size with every "
            f"step, so there is no batch size to grow; set max_tokens=null or {GROWTH_KEY}=null."
        )


# ---------------------------------------------------------------- rules on the settings and the run


def _max_memory_within_device(o: AdaptiveBatchOptions, c: RunContext) -> None:
    if c.device.type in ("cpu", "cuda"):
        o.probe.max_memory_bytes(device_capacity(c.device).device_bytes)


def _tokens_unpacked(o: AdaptiveBatchOptions, c: RunContext) -> None:
    if o.tokens.max_tokens is not None and c.packed:
        raise ConfigError(
            f"max_tokens={o.tokens.max_tokens} with dataset.packed=True: packed samples are already "
            "max_seq_len tokens each; set dataset.packed=False or max_tokens=null."
        )


def _tokens_without_accumulation(o: AdaptiveBatchOptions, c: RunContext) -> None:
    if o.tokens.max_tokens is not None and c.gradient_accumulation_steps != 1:
        raise ConfigError(
            f"gradient_accumulation_steps={c.gradient_accumulation_steps} with max_tokens={o.tokens.max_tokens}: "
            "a token batch is one optimizer step (split into micro-batches only if it runs out "
            "of memory); set gradient_accumulation_steps=1 and raise max_tokens instead."
        )


def _global_batch_fits_the_run(o: AdaptiveBatchOptions, c: RunContext) -> None:
    global_batch = o.global_batch.global_batch_size
    if global_batch is None:
        return
    if c.optimizer_in_bwd:
        raise ConfigError(
            f"{GLOBAL_KEY}={global_batch} with optimizer_in_bwd=True: a global batch is run in "
            f"accumulated micro-batches, which an optimizer stepping inside backward cannot do; "
            f"set optimizer_in_bwd=False or {GLOBAL_KEY}=null."
        )
    check_global_batch(global_batch, world_size=c.world_size, gradient_accumulation_steps=c.gradient_accumulation_steps)


def _splitting_without_optimizer_in_bwd(o: AdaptiveBatchOptions, c: RunContext) -> None:
    if not c.optimizer_in_bwd or not (o.growth.retry_on_oom or o.growing):  # None follows optimizer_in_bwd
        return
    what, off = (
        (f"{GROWTH_KEY}={o.growth.batch_increase_function!r}", f"{GROWTH_KEY}=null")
        if o.growing
        else ("retry_on_oom=True", "retry_on_oom=False")
    )
    raise ConfigError(
        f"{what} with optimizer_in_bwd=True: both split steps into accumulated micro-batches, "
        f"which an optimizer stepping inside backward cannot do; set optimizer_in_bwd=False or {off}."
    )


def _noise_scale_reads_gradients(o: AdaptiveBatchOptions, c: RunContext) -> None:
    if o.noise.measure_noise_scale and c.optimizer_in_bwd:
        raise ConfigError(
            "measure_noise_scale=True with optimizer_in_bwd=True: the noise scale reads the step's gradients, which "
            "an optimizer stepping inside backward frees as it goes; set optimizer_in_bwd=False or measure_noise_scale=False."
        )


def _probe_can_measure(o: AdaptiveBatchOptions, c: RunContext) -> None:
    if not o.needs_probe:
        return
    if c.device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"use_maximum_batch_size=True (or a batch_increase_function without "
            f"max_batch_size) on device={c.device.type!r}: the probe measures memory on "
            "cpu and cuda only; set use_maximum_batch_size=False and max_batch_size."
        )
    if c.max_seq_len is None:
        raise ConfigError(
            "probing the largest batch (use_maximum_batch_size=True, or a "
            "batch_increase_function without max_batch_size) with tokenizer.max_seq_len=null: the probe runs "
            "every sequence at that length so no longer batch can run out of memory "
            "later; set tokenizer.max_seq_len, e.g. tokenizer.max_seq_len=2048."
        )


SETTING_RULES: List[Callable[[AdaptiveBatchOptions], None]] = [
    _min_batch_within_max,
    _global_batch_without_tokens,
    _noise_growth_measures_noise,
    _interval_needs_growth,
    _growth_without_tokens,
]
RUN_RULES: List[Callable[[AdaptiveBatchOptions, RunContext], None]] = [
    _max_memory_within_device,
    _tokens_unpacked,
    _tokens_without_accumulation,
    _global_batch_fits_the_run,
    _splitting_without_optimizer_in_bwd,
    _noise_scale_reads_gradients,
    _probe_can_measure,
]
