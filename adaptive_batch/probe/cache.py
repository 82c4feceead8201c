"""A cache of probe results, keyed by everything that changes a step's memory.

The key hashes the model config, dtype, optimizer, loss, sequence length, activation
checkpointing, device name, memory budget, world size and library versions (whatever the
caller passes as ``fields``). A re-run with the same key reuses the result instead of probing.
An entry that cannot be read, whose stored fields differ from the key's, or whose values are
out of range or disagree with the key (a batch of 0, a batch over the cap, another budget or
sequence length, a found size no fitting trial backs) is ignored with a warning: never trusted.
"""

import hashlib
from importlib import metadata
import json
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from adaptive_batch.batch_tensors import tensors_of
from adaptive_batch.identity import code_of, digest
from adaptive_batch.files import atomic_write
import adaptive_batch.logs as logs
from adaptive_batch.probe.report import ProbeReport

CACHE_FORMAT = 1


def library_versions() -> Dict[str, str]:
    """Versions that change kernels or the probe: torch, torchtune, adaptive-batch."""
    versions = {}
    for name in ("torch", "torchtune", "adaptive-batch"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def step_fields(model: Any, optimizer: Any, batch: Any, functions: Tuple[Callable, ...]) -> Dict[str, str]:
    """What a plain loop's step is made of, as far as it can be seen, for the cache's key, the
    same in every process: the model's modules (class, settings as their ``extra_repr`` shows them:
    a convolution's stride; and the code of their classes' ``forward``) and its parameters and
    buffers (name, shape, dtype, trainable), the optimizer's class and the settings that change its state's size (a number
    counts as on or off: an LR sweep probes once), the worst-case batch's tensors (shape, dtype)
    and the step functions' code. A memory change none of them shows (autocast switched by an
    environment variable, an attention kernel chosen by a config) is not seen: ``probe_cache=False``
    there."""
    tensors = [(name, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    # A stride, a pooling size or a forward changed beside the same parameters changes the memory:
    # a conv net of stride 4 once read back the answer of stride 1, a ninth of what fit.
    modules = [(type(m).__qualname__, m.extra_repr()) for m in model.modules()]
    forwards = [code_of(cls.forward) for cls in dict.fromkeys(type(m) for m in model.modules())]
    settings = None if optimizer is None else (type(optimizer).__qualname__, [
        {k: _on_or_off(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    shapes = [(tuple(t.shape), str(t.dtype)) for t in tensors_of(batch)]
    return {"model": f"{type(model).__qualname__}:{digest([modules, forwards, tensors])}", "optimizer": digest(settings),
            "batch": digest(shapes), "code": digest([code_of(fn) for fn in functions])}


def _on_or_off(value: Any) -> Any:
    """A setting as it changes an optimizer's state: a number by whether it is 0."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value != 0
    if isinstance(value, (tuple, list)):
        return [_on_or_off(v) for v in value]
    return value if isinstance(value, (bool, str, type(None))) else type(value).__qualname__


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/adaptive-batch/probe`` (``~/.cache`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "adaptive-batch", "probe")


def cache_key(fields: Dict[str, Any]) -> str:
    """The hash of ``fields`` (JSON with sorted keys)."""
    canonical = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def report_problem(report: Any, fields: Dict[str, Any]) -> Optional[str]:
    """What makes a cached report unusable for ``fields``, or ``None`` when it is sound."""
    if not isinstance(report, dict):
        return "the report is not an object"
    found, batch = report.get("max_batch_size"), report.get("batch_size")
    if not _whole(found) or found < 1 or not _whole(batch) or batch < 1:
        return f"max_batch_size={found!r} and batch_size={batch!r} must be integers of at least 1"
    if batch > found:
        return f"batch_size={batch} is larger than max_batch_size={found}"
    cap = fields.get("batch_size_cap")
    if _whole(cap) and found > cap:
        return f"max_batch_size={found} is over the cap of {cap}"
    for name in ("budget_bytes", "seq_len"):
        if name in fields and report.get(name) != fields[name]:
            return f"{name}={report.get(name)!r} differs from the key's {fields[name]!r}"
    trials = report.get("trials")
    fitting = [
        t for t in (trials if isinstance(trials, list) else [])
        if isinstance(t, dict) and t.get("batch_size") == found and t.get("fits") is True
    ]
    if not fitting:
        return f"no fitting trial at max_batch_size={found}"
    budget, peak = report.get("budget_bytes"), fitting[-1].get("peak_bytes")
    # A trial fits when its peak is within the budget: an entry claiming otherwise was not written by a probe.
    if not _whole(peak) or not _whole(budget) or peak > budget:
        return f"its fitting trial at max_batch_size={found} claims a peak of {peak!r} bytes against a budget of {budget!r}"
    return None


class ProbeCache:
    """Probe results on disk, one JSON file a key.

    An entry that cannot be used (unreadable, stale, invalid) is ignored with a line (INFO: the
    probe runs again, as if nothing were cached).

    Args:
        directory: where entries live (created on first store).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path(self, fields: Dict[str, Any]) -> str:
        return os.path.join(self.directory, f"probe_{cache_key(fields)}.json")

    def load(self, fields: Dict[str, Any]) -> Optional[ProbeReport]:
        """The cached report for ``fields``, or ``None`` (missing, corrupt or stale)."""
        path = self.path(fields)
        if not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                entry = json.load(f)
            stored = entry["fields"]
            report = entry["report"]
            stale = entry.get("format") != CACHE_FORMAT or json.loads(json.dumps(fields, default=str)) != stored
        except (OSError, ValueError, KeyError, TypeError) as e:
            logs.info(f"probe cache: ignoring unreadable entry {path} ({type(e).__name__}: {e}); probing again.")
            return None
        if stale:
            logs.info(f"probe cache: ignoring stale entry {path} (its fields or format differ); probing again.")
            return None
        problem = report_problem(report, fields)
        if problem is None:
            try:
                return ProbeReport.from_dict(report)
            except ValueError as e:
                problem = str(e)
        logs.info(f"probe cache: ignoring invalid entry {path} ({problem}); probing again.")
        return None

    def store(self, fields: Dict[str, Any], report: ProbeReport) -> str:
        """Writes the entry atomically and returns its path."""
        entry = {"format": CACHE_FORMAT, "fields": fields, "report": report.to_dict()}
        return atomic_write(self.path(fields), lambda f: json.dump(entry, f, indent=2, default=str), text=True)
