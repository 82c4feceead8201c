"""A batch's tensors, whatever structure holds them: one walk for every place that counts or
keys a batch (a trial's peak, a probe cache's key, a sample's size)."""

import dataclasses
from typing import Any, Iterator, Mapping

import torch


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    """The batch's tensors, depth first in its own order: through mappings of any kind (a
    ``BatchEncoding`` or ``BatchFeature``, which torch's pytree takes for one leaf), dataclasses,
    lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_of(getattr(value, f.name))
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_of(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_of(item)


__all__ = ["tensors_of"]
