"""The user's batch increase function: resolving it, checking it, calling it, and built-ins.

A batch increase function is ``f(epoch, current_batch_size) -> increment``, as in torchtune's
adaptive-batching RFC. The recipe calls it at the start of every epoch (0-based) with the
current global batch size and adds the returned increment, clamped to an upper bound.

The built-ins are factories, so a config can parameterise them with a ``_component_`` node::

    batch_increase_function:
      _component_: adaptive_batch.growth.multiply_every
      factor: 2
      every_n_epochs: 1
"""

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Union

from adaptive_batch.validation import check_bool, ConfigError

KEY = "batch_increase_function"

BatchIncreaseFunction = Callable[[int, int], int]


class BatchIncreaseFunctionError(ConfigError):
    """The batch increase function failed or returned something that is not an increment."""


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
            f"{KEY}={name!r} is a {type(fn).__name__}, not a function: point it at a function "
            "f(epoch, current_batch_size) -> increment."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None  # builtins without a signature: the first call will tell
    if signature is not None:
        try:
            signature.bind(0, 1)
        except TypeError as e:
            raise ConfigError(
                f"{KEY}={name!r} has signature {signature}, which cannot be called as "
                f"f(epoch, current_batch_size) ({e}); define it as def f(epoch, current_batch_size)."
            ) from None
    return fn


def function_name(fn: Callable) -> str:
    """A readable name for logs and errors."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(fn)


def call_batch_increase_function(fn: BatchIncreaseFunction, epoch: int, current_batch_size: int) -> int:
    """Calls ``fn(epoch, current_batch_size)`` and checks the increment.

    Raises:
        BatchIncreaseFunctionError: if the function raises, or returns anything but a
            non-negative ``int`` (``bool`` and ``float`` included).
    """
    where = f"{KEY} {function_name(fn)} at epoch={epoch}, current_batch_size={current_batch_size}"
    try:
        increment = fn(epoch, current_batch_size)
    except BatchIncreaseFunctionError:
        raise  # already names the user's function (a wrapper such as per_rank_increase)
    except Exception as e:
        raise BatchIncreaseFunctionError(f"{where} raised {type(e).__name__}: {e}") from e
    if isinstance(increment, bool) or not isinstance(increment, int):
        raise BatchIncreaseFunctionError(
            f"{where} returned {increment!r} ({type(increment).__name__}); it must return a "
            "non-negative int, the number of samples to add (0 for none)."
        )
    if increment < 0:
        raise BatchIncreaseFunctionError(
            f"{where} returned {increment}; the batch only grows: return 0 or a positive int."
        )
    return increment


@dataclass(frozen=True)
class GrowthDecision:
    """What one epoch's call decided.

    Attributes:
        epoch: the epoch it was called for.
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
    fn: BatchIncreaseFunction, *, epoch: int, current_batch_size: int, bound: Optional[int]
) -> GrowthDecision:
    """Asks ``fn`` for this epoch's increment and clamps the new batch to ``bound``.

    Raises:
        BatchIncreaseFunctionError: see :func:`call_batch_increase_function`.
    """
    increment = call_batch_increase_function(fn, epoch, current_batch_size)
    requested = current_batch_size + increment
    new = requested if bound is None else min(requested, max(bound, current_batch_size))
    return GrowthDecision(epoch, current_batch_size, requested, new, bound)


@dataclass(frozen=True, kw_only=True)
class GrowthOptions:
    """The online-growth settings; they check themselves when built.

    Attributes:
        batch_increase_function: ``None`` for a fixed batch, a dotted path ``"pkg.module.fn"``
            or a callable (an instantiated ``_component_`` node); held resolved and checked.
        grow_with_accumulation: growth may pass the memory maximum through gradient
            accumulation (else it stops there).
        retry_on_oom: a step that runs out of memory is retried in smaller micro-batches.

    Raises:
        ConfigError: for a bad value, or a function that cannot be resolved or called as
            ``f(epoch, current_batch_size)``.
    """

    batch_increase_function: Union[None, str, BatchIncreaseFunction] = None
    grow_with_accumulation: bool = False
    retry_on_oom: bool = True

    def __post_init__(self) -> None:
        check_bool("grow_with_accumulation", self.grow_with_accumulation)
        check_bool("retry_on_oom", self.retry_on_oom)
        if self.batch_increase_function is not None:
            fn = resolve_batch_increase_function(self.batch_increase_function)
            object.__setattr__(self, "batch_increase_function", fn)


# Built-ins. Each returns the function; a config points at the factory with ``_component_``.


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


def _bad_int(value: object, minimum: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < minimum
