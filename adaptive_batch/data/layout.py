"""Where a batch's samples lie, whatever its structure: its size, and its split into micro-batches.

A collated batch may be a tensor, a dict (torchtune's ``{"tokens", "labels"}``, Hugging Face's
``input_ids``/``attention_mask``/``labels`` or its ``BatchEncoding``), a tuple or list
(``TensorDataset``), a namedtuple or a dataclass, nested in any way. The batch dimension is
named once (``batch_dim``, 0 by default); the batch size is read from the first tensor that has
it, or from ``batch_size_of`` when the caller says. Splitting cuts every tensor whose batch
dimension holds the batch's rows and shares everything else (a scale, a mask of another shape,
strings) with every piece.
"""

from collections.abc import Mapping, MutableMapping
import copy
import dataclasses
from typing import Any, Callable, List, Optional

import torch

from adaptive_batch.batch_tensors import tensors_of


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How to find a batch's samples.

    Args:
        batch_dim: the dimension of each per-sample tensor that indexes the samples.
        batch_size_of: ``f(batch) -> samples``, when the first tensor along ``batch_dim`` is
            not the batch size (``None``: it is).
    """

    batch_dim: int = 0
    batch_size_of: Optional[Callable[[Any], int]] = None

    def __post_init__(self) -> None:
        if isinstance(self.batch_dim, bool) or not isinstance(self.batch_dim, int) or self.batch_dim < 0:
            raise ValueError(f"batch_dim={self.batch_dim!r} must be a dimension index: 0 or more.")

    def rows(self, batch: Any) -> int:
        """The batch's samples.

        Raises:
            ValueError: when no tensor of the batch has a dimension ``batch_dim`` and no
                ``batch_size_of`` was given.
        """
        if self.batch_size_of is not None:
            return int(self.batch_size_of(batch))
        for leaf in tensors_of(batch):
            if leaf.dim() > self.batch_dim:
                return int(leaf.shape[self.batch_dim])
        raise ValueError(
            f"no tensor of the batch ({type(batch).__name__}) has a dimension {self.batch_dim} to count samples "
            "along: name it with batch_dim=, or pass batch_size_of=f(batch) -> samples."
        )

    def split(self, batch: Any, sizes: List[int]) -> List[Any]:
        """``batch`` cut into pieces of ``sizes`` samples, each of the batch's own structure.

        Raises:
            ValueError: if no tensor has ``sum(sizes)`` entries along ``batch_dim``.
        """
        rows = sum(sizes)
        if not any(self._has_rows(leaf, rows) for leaf in tensors_of(batch)):
            raise ValueError(
                f"micro-batch sizes {sizes} add up to {rows}, and no tensor of the batch has {rows} entries "
                f"along batch_dim={self.batch_dim}."
            )
        return self._split(batch, sizes, rows)

    def copies(self, batch: Any, rows: int) -> List[torch.Tensor]:
        """Copies of ``rows`` samples of each of the batch's per-sample tensors (the whole batch as
        often as it fits, then its first samples): memory that holds what more samples of its
        inputs hold. Nothing for ``rows`` of 0 or less.

        Raises:
            ValueError: as :meth:`rows`.
        """
        size = self.rows(batch)
        held = []
        for leaf in tensors_of(batch):
            if not self._has_rows(leaf, size):
                continue  # shared by every sample (a scale, a mask of another shape): held once
            left = rows
            while left > 0:
                held.append(leaf.narrow(self.batch_dim, 0, min(left, size)).clone())
                left -= size
        return held

    def _has_rows(self, value: torch.Tensor, rows: int) -> bool:
        return value.dim() > self.batch_dim and value.shape[self.batch_dim] == rows

    def _split(self, value: Any, sizes: List[int], rows: int) -> List[Any]:
        count = len(sizes)
        if isinstance(value, torch.Tensor):
            if self._has_rows(value, rows):
                return list(torch.split(value, sizes, dim=self.batch_dim))
            return [value] * count
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = [f.name for f in dataclasses.fields(value) if f.init]
            parts = {name: self._split(getattr(value, name), sizes, rows) for name in fields}
            return [dataclasses.replace(value, **{name: p[i] for name, p in parts.items()}) for i in range(count)]
        if isinstance(value, Mapping):
            parts = {key: self._split(item, sizes, rows) for key, item in value.items()}
            return [_same_mapping(value, {key: p[i] for key, p in parts.items()}) for i in range(count)]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            parts = [self._split(item, sizes, rows) for item in value]
            return [type(value)(*(p[i] for p in parts)) for i in range(count)]
        if isinstance(value, (list, tuple)):
            parts = [self._split(item, sizes, rows) for item in value]
            return [type(value)(p[i] for p in parts) for i in range(count)]
        return [value] * count


def _same_mapping(original: Mapping, items: dict) -> Mapping:
    """``items`` in a mapping of ``original``'s type (dict, OrderedDict, defaultdict, a
    ``BatchEncoding``), its other attributes kept."""
    if isinstance(original, MutableMapping):
        piece = copy.copy(original)
        piece.clear()
        piece.update(items)
        return piece
    return type(original)(items)
