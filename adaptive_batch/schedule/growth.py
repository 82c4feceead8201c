"""The user's batch increase function: resolving it, checking it, calling it, and built-ins.

A batch increase function is ``f(epoch, current_batch_size) -> increment``, as in torchtune's
adaptive-batching RFC. The recipe calls it at every boundary of ``batch_increase_interval``
(the start of every epoch by default; every N steps, samples or tokens otherwise, see
:mod:`adaptive_batch.schedule.interval`) with the 0-based boundary index and the current global batch
size, and adds the returned increment, clamped to an upper bound.

A function that also wants to see how training goes declares a keyword argument ``stats``:
``f(epoch, current_batch_size, *, stats=None)`` then receives a :class:`GrowthStatistics`
(steps, samples and tokens so far, the gradient noise scale, the bound). Functions without it
are called as before.

The built-ins are factories, so a config can parameterise them with a ``_component_`` node::

    batch_increase_function:
      _component_: adaptive_batch.schedule.growth.multiply_every
      factor: 2
      every_n_epochs: 1
"""

import collections.abc
import numbers
from dataclasses import dataclass
import functools
import importlib
import inspect
import math
from typing import Any, Callable, Dict, Optional, Sequence, Union

from adaptive_batch.errors import BatchIncreaseFunctionError, ConfigError
from adaptive_batch.identity import code_of, digest
from adaptive_batch.schedule.interval import GrowthInterval, parse_interval
from adaptive_batch.validation import check_bool

KEY = "batch_increase_function"

BatchIncreaseFunction = Callable[[int, int], int]


@dataclass(frozen=True)
class GrowthStatistics:
    """What a batch increase function sees of training, through its ``stats`` argument.

    Attributes:
        global_step: optimizer steps taken.
        samples_seen: samples trained on, all ranks.
        tokens_seen: loss-carrying tokens trained on, all ranks.
        gradient_noise_scale: the moving average of ``B_noise = tr(Sigma) / |G|^2`` in samples
            (McCandlish et al. 2018), or ``None`` when not measured (``measure_noise_scale``
            off, or no step of two or more micro-batches yet).
        max_batch_size: the global batch growth is clamped to, or ``None`` for no bound.
    """

    global_step: int
    samples_seen: int
    tokens_seen: int
    gradient_noise_scale: Optional[float]
    max_batch_size: Optional[int]


def accepts_statistics(fn: Callable) -> bool:
    """Whether ``fn`` takes the ``stats`` keyword (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "stats" and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        for p in parameters
    )


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def _import_dotted(path: str) -> object:
    """Imports ``pkg.module.attr``, telling a missing module from a missing attribute."""
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ConfigError(
            f"{KEY}={path!r} is not a dotted path: give it as module.function, e.g. "
            f"{KEY}=my_schedules.grow for grow() in my_schedules.py on PYTHONPATH."
        )
    last_error: Optional[BaseException] = None
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this module does not exist" means: try a shorter prefix.
            if e.name is not None and module_name.startswith(e.name):
                last_error = e
                continue
            raise ConfigError(f"{KEY}={path!r}: importing {module_name!r} failed: {e}") from e
        except Exception as e:  # an error inside the user's module
            raise ConfigError(f"{KEY}={path!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                raise ConfigError(
                    f"{KEY}={path!r}: module {module_name!r} has no attribute {attr!r}; "
                    f"check the function's name in {getattr(obj, '__file__', module_name)}."
                )
            obj = getattr(obj, attr)
        return obj
    raise ConfigError(
        f"{KEY}={path!r}: no module {parts[0]!r} can be imported ({last_error}); put the file "
        "in the working directory or on PYTHONPATH."
    )


def resolve_batch_increase_function(spec: Union[str, Callable]) -> BatchIncreaseFunction:
    """Turns the config value into a checked callable.

    Args:
        spec: a dotted path ``"pkg.module.fn"``, or a callable (what a ``_component_`` node
            instantiates to).

    Returns:
        The callable.

    Raises:
        ConfigError: when the path does not import, the attribute is missing, it is not
            callable, or its signature cannot take ``(epoch, current_batch_size)``.
    """
    if isinstance(spec, str):
        fn = _import_dotted(spec)
        name = spec
    else:
        fn = spec
        name = getattr(spec, "__qualname__", repr(spec))
    if not callable(fn):
        raise ConfigError(
            f"{KEY}={name!r} is {_a(type(fn).__name__)}, not a function: point it at a function "
            "f(epoch, current_batch_size) -> increment."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None  # builtins without a signature: the first call will tell
    if signature is not None and _builds_a_function(signature):
        raise ConfigError(
            f"{KEY}={name!r} builds the growth function (it returns {_annotation(signature)}), it is not one: "
            f"call it with its arguments ({function_name(fn)}(...)), or in a config give "
            f"{{_component_: {name if isinstance(spec, str) else function_name(fn)}, "
            f"{next(iter(signature.parameters), 'arg')}: ...}}."
        )
    if signature is not None:
        try:
            signature.bind(0, 1)
        except TypeError as e:
            try:
                signature.bind()
                fix = (
                    "it builds one: give a _component_ node with at least one of its arguments, e.g. "
                    f"{{_component_: {name}, {next(iter(signature.parameters), 'arg')}: ...}}"
                )
            except TypeError:
                fix = "define it as def f(epoch, current_batch_size)"
            raise ConfigError(
                f"{KEY}={name!r} has signature {signature}, which cannot be called as "
                f"f(epoch, current_batch_size) ({e}); {fix}."
            ) from None
    return fn


def _builds_a_function(signature: inspect.Signature) -> bool:
    """Whether the function says it returns a function (a factory such as :func:`linear_ramp`)."""
    returned = signature.return_annotation
    if isinstance(returned, str):  # postponed annotations
        return returned == "BatchIncreaseFunction" or returned.startswith(("Callable", "typing.Callable"))
    return getattr(returned, "__origin__", None) is collections.abc.Callable or returned is collections.abc.Callable


def _annotation(signature: inspect.Signature) -> str:
    returned = signature.return_annotation
    return returned if isinstance(returned, str) else "a function"


def function_name(fn: Callable) -> str:
    """A readable name for logs and errors, the same in every process (checkpoints compare it):
    a function's dotted path; a ``functools.partial``'s function and arguments; a callable
    object's type (never a ``repr`` holding a memory address)."""
    if isinstance(fn, functools.partial):
        arguments = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in sorted(fn.keywords.items())]
        return f"{function_name(fn.func)}({', '.join(arguments)})"
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module and qualname:
        return f"{module}.{qualname}"
    kind = type(fn)
    return f"{kind.__module__}.{kind.__qualname__}"


def function_identity(fn: Callable) -> str:
    """:func:`function_name` and, where it says too little, what the function is, the same in
    every process, for a checkpoint's comparison: one of this module's factories with its
    arguments (``linear_ramp(8)`` and ``linear_ramp(56)`` have one name), a lambda with a digest
    of its code (a script's lambdas are all ``<lambda>``). A closure of your own is its name:
    what it holds may be state it moves on, or differ in every process (a start time)."""
    made_by = getattr(fn, FACTORY_CALL, None)
    if made_by is not None:
        return f"{function_name(fn)} [{made_by}]"
    if getattr(fn, "__name__", None) == "<lambda>" and not isinstance(fn, functools.partial):
        return f"{function_name(fn)} #{digest(code_of(fn))[:8]}"
    return function_name(fn)


# Settings kept in checkpoints only since some release: a record without one is not compared
# (what that run had is not known), wherever records are compared.
RECORDED_SINCE = frozenset({"dataset_size", "enable_activation_checkpointing", "enable_activation_offloading"})


def same_setting_recorded(key: str, saved: Any, now: Any) -> bool:
    """Whether a checkpoint's record of setting ``key`` is ``now``'s; for the growth function
    (:func:`function_identity`), a record written before identities said more than the name (its
    bare name) is taken as the function of that name."""
    if saved == now:
        return True
    return key == KEY and isinstance(saved, str) and isinstance(now, str) and (
        now.startswith(saved + " [") or now.startswith(saved + " #"))


# Where one of this module's factories records the call that made a function.
FACTORY_CALL = "__growth_factory_call__"


def _records_its_call(factory: Callable[..., BatchIncreaseFunction]) -> Callable[..., BatchIncreaseFunction]:
    """``factory``, whose functions record the call that made them (:func:`function_identity`)."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def made(*args: Any, **kwargs: Any) -> BatchIncreaseFunction:
        fn = factory(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = ", ".join(f"{name}={value!r}" for name, value in bound.arguments.items())
        setattr(fn, FACTORY_CALL, f"{factory.__name__}({arguments})")
        return fn

    return made


def call_batch_increase_function(
    fn: BatchIncreaseFunction,
    epoch: int,
    current_batch_size: int,
    *,
    label: str = "epoch",
    stats: Optional[GrowthStatistics] = None,
) -> int:
    """Calls ``fn(epoch, current_batch_size)`` and checks the increment.

    Args:
        label: what the first argument counts in messages (``"epoch"`` or ``"interval"``).
        stats: passed as ``stats=`` when ``fn`` takes it.

    Raises:
        BatchIncreaseFunctionError: if the function raises, or returns anything but a
            non-negative ``int`` (``bool`` and ``float`` included).
    """
    where = f"{KEY} {function_name(fn)} at {label}={epoch}, current_batch_size={current_batch_size}"
    try:
        if accepts_statistics(fn):
            increment = fn(epoch, current_batch_size, stats=stats)
        else:
            increment = fn(epoch, current_batch_size)
    except BatchIncreaseFunctionError:
        raise  # already names the user's function (a wrapper such as per_rank_increase)
    except (Exception, KeyboardInterrupt) as e:  # a recipe notes a real Ctrl-C as a signal

        raise BatchIncreaseFunctionError(f"{where} raised {type(e).__name__}: {e}; fix the function") from e
    if isinstance(increment, bool) or not isinstance(increment, numbers.Integral):
        raise BatchIncreaseFunctionError(
            f"{where} returned {increment!r} ({type(increment).__name__}); it must return a "
            "non-negative int, the number of samples to add (0 for none)."
        )
    increment = int(increment)  # numpy's integers too
    if increment < 0:
        raise BatchIncreaseFunctionError(
            f"{where} returned {increment}; the batch only grows: return 0 or a positive int."
        )
    return increment


@dataclass(frozen=True)
class GrowthDecision:
    """What one epoch's call decided.

    Attributes:
        epoch: the epoch (or interval boundary) it was called for.
        previous: the global batch before.
        requested: ``previous + increment``.
        batch_size: the global batch from this epoch on (``requested`` clamped to the bound).
        bound: the bound it was clamped to, or ``None`` for no bound.
    """

    epoch: int
    previous: int
    requested: int
    batch_size: int
    bound: Optional[int]

    @property
    def clamped(self) -> bool:
        return self.batch_size < self.requested


def grow_batch_size(
    fn: BatchIncreaseFunction,
    *,
    epoch: int,
    current_batch_size: int,
    bound: Optional[int],
    label: str = "epoch",
    stats: Optional[GrowthStatistics] = None,
) -> GrowthDecision:
    """Asks ``fn`` for this epoch's (or boundary's) increment and clamps the new batch to ``bound``.

    Raises:
        BatchIncreaseFunctionError: see :func:`call_batch_increase_function`.
    """
    increment = call_batch_increase_function(fn, epoch, current_batch_size, label=label, stats=stats)
    requested = current_batch_size + increment
    new = requested if bound is None else min(requested, max(bound, current_batch_size))
    return GrowthDecision(epoch, current_batch_size, requested, new, bound)


@dataclass(frozen=True, kw_only=True)
class GrowthOptions:
    """The online-growth settings; they check themselves when built.

    Attributes:
        batch_increase_function: ``None`` for a fixed batch, a dotted path ``"pkg.module.fn"``
            or a callable (an instantiated ``_component_`` node); held resolved and checked.
        batch_increase_interval: when the function is called: ``"epoch"`` or
            ``"<N> steps|samples|tokens"``; held parsed, as a
            :class:`~adaptive_batch.schedule.interval.GrowthInterval`.
        grow_with_accumulation: growth may pass the memory maximum through gradient
            accumulation (else it stops there).
        retry_on_oom: a step that runs out of memory is retried in smaller micro-batches;
            ``None`` (the default): on, unless the optimizer steps inside backward, where a
            step cannot be split (:meth:`retries_oom`).

    Raises:
        ConfigError: for a bad value, or a function that cannot be resolved or called as
            ``f(epoch, current_batch_size)``.
    """

    batch_increase_function: Union[None, str, BatchIncreaseFunction] = None
    batch_increase_interval: Union[str, GrowthInterval] = "epoch"
    grow_with_accumulation: bool = False
    retry_on_oom: Optional[bool] = None

    def retries_oom(self, optimizer_in_bwd: bool) -> bool:
        """Whether a step that runs out of memory is split and rerun."""
        return (not optimizer_in_bwd) if self.retry_on_oom is None else self.retry_on_oom

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_increase_interval", parse_interval(self.batch_increase_interval))
        check_bool("grow_with_accumulation", self.grow_with_accumulation)
        if self.retry_on_oom is not None:
            check_bool("retry_on_oom", self.retry_on_oom)
        if self.batch_increase_function is not None:
            fn = resolve_batch_increase_function(self.batch_increase_function)
            object.__setattr__(self, "batch_increase_function", fn)


# Built-ins. Each returns the function; a config points at the factory with ``_component_``.


@_records_its_call
def step_increments(epochs: Sequence[int], increments: Sequence[int]) -> BatchIncreaseFunction:
    """Adds ``increments[i]`` at the start of epoch ``epochs[i]``, nothing at other epochs.

    Raises:
        ValueError: if the lists differ in length, an epoch repeats or is negative, or an
            increment is negative.
    """
    epochs, increments = list(epochs), list(increments)
    if len(epochs) != len(increments):
        raise ValueError(f"step_increments: {len(epochs)} epochs but {len(increments)} increments; give one each.")
    if len(set(epochs)) != len(epochs) or any(_bad_int(e, 0) for e in epochs):
        raise ValueError(f"step_increments: epochs={epochs} must be distinct non-negative ints.")
    if any(_bad_int(i, 0) for i in increments):
        raise ValueError(f"step_increments: increments={increments} must be non-negative ints.")
    table: Dict[int, int] = dict(zip(epochs, increments))

    def step_increment(epoch: int, current_batch_size: int) -> int:
        return table.get(epoch, 0)

    return step_increment


# With batch_increase_interval other than epoch, the built-ins' "epochs" are intervals: the
# first argument they get is the boundary index either way.


@_records_its_call
def linear_ramp(increment: int, every_n_epochs: int = 1) -> BatchIncreaseFunction:
    """Adds ``increment`` samples every ``every_n_epochs`` epochs (not before epoch 1).

    Raises:
        ValueError: for a negative increment or an interval under 1.
    """
    if _bad_int(increment, 0) or _bad_int(every_n_epochs, 1):
        raise ValueError(
            f"linear_ramp(increment={increment!r}, every_n_epochs={every_n_epochs!r}): the increment "
            "must be an int >= 0 and the interval an int >= 1."
        )

    def ramp(epoch: int, current_batch_size: int) -> int:
        return increment if epoch > 0 and epoch % every_n_epochs == 0 else 0

    return ramp


@_records_its_call
def multiply_every(factor: float, every_n_epochs: int = 1) -> BatchIncreaseFunction:
    """Multiplies the batch by ``factor`` every ``every_n_epochs`` epochs (not before epoch 1):
    Smith et al., "Don't decay the learning rate, increase the batch size".

    Raises:
        ValueError: for a factor under 1 (or NaN, or infinite) or an interval under 1.
    """
    bad_factor = isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor)
    if bad_factor or factor < 1 or _bad_int(every_n_epochs, 1):
        raise ValueError(
            f"multiply_every(factor={factor!r}, every_n_epochs={every_n_epochs!r}): the factor must "
            "be a finite number >= 1 and the interval an int >= 1."
        )

    def multiply(epoch: int, current_batch_size: int) -> int:
        if epoch > 0 and epoch % every_n_epochs == 0:
            return int(round(current_batch_size * factor)) - current_batch_size
        return 0

    return multiply


def double_every_epoch(epoch: int, current_batch_size: int) -> int:
    """Doubles the batch at the start of every epoch after the first (usable as a dotted path)."""
    return current_batch_size if epoch > 0 else 0


@_records_its_call
def linear_rampup(start_batch_size: int, final_batch_size: int, ramp_intervals: int) -> BatchIncreaseFunction:
    """Megatron's ``--rampup-batch-size`` and GPT-3's shape: the global batch goes linearly from
    ``start_batch_size`` at boundary 0 to ``final_batch_size`` at boundary ``ramp_intervals``,
    and stays there. With ``batch_increase_interval: "<N> samples"`` (or tokens) the ramp
    lasts ``N x ramp_intervals`` samples (tokens).

    The target depends on the boundary index alone, so a resumed run continues the ramp.

    Raises:
        ValueError: for sizes under 1, a final batch under the start, or no intervals.
    """
    if _bad_int(start_batch_size, 1) or _bad_int(final_batch_size, 1) or _bad_int(ramp_intervals, 1):
        raise ValueError(
            f"linear_rampup(start_batch_size={start_batch_size!r}, final_batch_size={final_batch_size!r}, "
            f"ramp_intervals={ramp_intervals!r}): all three must be ints >= 1."
        )
    if final_batch_size < start_batch_size:
        raise ValueError(
            f"linear_rampup: final_batch_size={final_batch_size} is under start_batch_size={start_batch_size}; "
            "the batch only grows."
        )

    def rampup(k: int, current_batch_size: int) -> int:
        target = start_batch_size + (final_batch_size - start_batch_size) * min(k, ramp_intervals) // ramp_intervals
        return max(0, target - current_batch_size)

    return rampup


@_records_its_call
def seesaw(total_intervals: int, warmup_intervals: int = 0, factor: int = 2) -> BatchIncreaseFunction:
    """Seesaw (Meterez et al. 2025, arXiv 2510.14717): where a cosine schedule's LR has fallen
    by another ``factor`` (to 1/2, 1/4, ... of the peak, for ``factor=2``), multiply the batch
    by ``factor`` instead of cutting the LR that much.

    Pair it with the cosine schedule (``get_cosine_schedule_with_warmup``, counted in samples)
    and ``lr_scaling: sqrt``: at every cut the LR then falls by ``sqrt(factor)`` while the batch
    grows by ``factor``, which is the paper's rule. ``total_intervals`` and ``warmup_intervals``
    are the schedule's length and warmup in ``batch_increase_interval`` units.

    Raises:
        ValueError: for intervals under 1 (warmup under 0 or not shorter) or a factor under 2.
    """
    if _bad_int(total_intervals, 1) or _bad_int(warmup_intervals, 0) or warmup_intervals >= total_intervals:
        raise ValueError(
            f"seesaw(total_intervals={total_intervals!r}, warmup_intervals={warmup_intervals!r}): the "
            "schedule needs total_intervals >= 1 and 0 <= warmup_intervals < total_intervals."
        )
    if _bad_int(factor, 2):
        raise ValueError(f"seesaw(factor={factor!r}): the factor must be an int >= 2.")

    def cuts(k: int) -> int:
        """How many times the cosine LR has fallen by ``factor`` at boundary ``k``."""
        if k <= warmup_intervals:
            return 0
        progress = min(1.0, (k - warmup_intervals) / (total_intervals - warmup_intervals))
        multiplier = 0.5 * (1.0 + math.cos(math.pi * progress))
        # The schedule reaches 0 at its end; the batch bound stops growth long before.
        return int(math.floor(-math.log(max(multiplier, 1e-12)) / math.log(factor) + 1e-9))

    def seesaw_increment(k: int, current_batch_size: int) -> int:
        new_cuts = cuts(k) - (cuts(k - 1) if k > 0 else 0)
        return current_batch_size * (factor**new_cuts - 1)

    return seesaw_increment


def _bad_int(value: object, minimum: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < minimum
