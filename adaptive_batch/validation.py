"""The error every bad setting raises, and the checks of single values the options share.

A leaf module: it imports nothing from the package, so every options class can use it and
validation never sits in the middle of the import graph.
"""

import difflib
import math
import numbers
from typing import Any, Iterable, Optional, Sequence

from adaptive_batch.errors import ConfigError


def check_known_keys(keys: Iterable[str], known_keys: Iterable[str], *, kind: str = "config key",
                     reader: str = "this recipe") -> None:
    """Rejects keys ``reader`` does not read (``key=value`` typos add new keys).

    Raises:
        ConfigError: naming the first unknown key and the closest known one.
    """
    known = sorted(set(known_keys))
    for key in sorted(keys):
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        raise ConfigError(f"unknown {kind} {key!r}: {reader} does not read it; {hint}")


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


def check_callable(key: str, value: Any, example: str, *, allow_none: bool = False) -> Any:
    """Raises:
    ConfigError: unless ``value`` can be called (or is ``None`` when allowed)."""
    if (value is None and allow_none) or callable(value):
        return value
    raise ConfigError(f"{key}={value!r} is not a function: pass one, e.g. {key}={example}.")


def check_fraction(key: str, value: Any, example: str) -> float:
    """Raises:
    ConfigError: unless ``value`` is a number in ``[0, 1)``; ``example`` shows a good one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{key}={value!r} must be a number in [0, 1): e.g. {key}={example}.")
    return float(value)


def check_safety_margin(value: Any, key: str = "memory_safety_margin") -> float:
    """The one check of a safety margin, wherever one comes in (config, CLI, library call).

    Raises:
        ConfigError: unless ``value`` is a number in ``[0, 1)``.
    """
    return check_fraction(key, value, "0.05 keeps 5% of the budget back")


def check_positive_number(key: str, value: Any, fix: str) -> float:
    """Raises:
    ConfigError: unless ``value`` is a finite number above zero (NaN and infinity are not)."""
    # numbers.Real: numpy's floats too (a clip norm read from an array), never bool.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive finite number: {fix}.")
    return float(value)


def check_choice(key: str, value: Any, choices: Sequence[str], fix: str) -> str:
    """Raises:
    ConfigError: unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}: {fix}")
    return value
