"""What a function runs, the same in every process: for keys and fingerprints that must not
hold a ``repr``'s memory address (a probe cache's key, a checkpoint's growth function)."""

import functools
import hashlib
import json
import types
from typing import Any


def digest(value: Any) -> str:
    """A short hash of ``value`` as canonical JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def code_of(fn: Any) -> Any:
    """What a function runs, the same in every process: its bytecode, names and constants, nested
    code (a lambda, a comprehension) by its own (a ``repr`` holds a memory address); a partial's
    function and arguments; a callable object's ``forward`` or ``__call__``."""
    if isinstance(fn, functools.partial):
        return [code_of(fn.func), repr(fn.args), repr(sorted(fn.keywords.items()))]
    if isinstance(fn, types.CodeType):
        consts = [code_of(c) if isinstance(c, types.CodeType) else repr(c) for c in fn.co_consts]
        return [fn.co_code.hex(), list(fn.co_names), consts]
    code = getattr(fn, "__code__", None)
    if code is not None:
        return code_of(code)
    method = getattr(type(fn), "forward", None) or getattr(type(fn), "__call__", None)
    return [type(fn).__qualname__, code_of(method) if getattr(method, "__code__", None) else None]
