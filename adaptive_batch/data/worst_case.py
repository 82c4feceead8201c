"""The worst-case batch of a dataset, built from its own samples through its own collate
function: the largest sample repeated, and, where samples differ in size, one of each batch
smaller, so the collate function pads the batch as it pads the real ones."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils._pytree import tree_leaves

from adaptive_batch.errors import ConfigError


@dataclass(frozen=True)
class RepeatedSample:
    """``f(b)``: ``sample`` ``b`` times through ``collate``, the last of them ``shorter`` where
    given (a batch the collator pads, as it pads the real ones). Picklable where its parts are,
    so a trial process can make the same batch."""

    sample: Any
    collate: Callable[[List[Any]], Any]
    shorter: Optional[Any] = None

    def __call__(self, batch_size: int) -> Any:
        samples = [self.sample] * batch_size
        if self.shorter is not None and batch_size > 1:
            samples[-1] = self.shorter
        return self.collate(samples)

    @classmethod
    def longest(cls, dataset: Any, collate: Callable) -> "RepeatedSample":
        """The dataset's longest sample (by ``input_ids``): no batch the collator pads is longer.
        Where samples differ in length, one of each batch is one token shorter, so the batch is
        padded: a padded batch takes an attention mask, and with it attention's masked path (a
        Llama's training at 16 x 512 tokens peaked 40 MiB higher padded than not, and the answer of
        unpadded trials ran out of memory in training).

        Raises:
            ConfigError: when the samples have no ``input_ids`` to measure (pass ``make_batch``).
        """
        try:
            lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        except (KeyError, TypeError, IndexError) as e:
            raise ConfigError(
                f"the worst-case batch is built from the longest sample's input_ids, and the samples have none ({e!r}): "
                "pass make_batch=f(b) -> a batch of b of your longest samples."
            ) from None
        _refuse_empty(lengths)
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        sample = dataset[longest]
        return cls(sample, collate, None if min(lengths) == lengths[longest] else _one_token_shorter(sample))

    @classmethod
    def largest(cls, dataset: Any, collate: Callable[[List[Any]], Any], *, scan: int) -> "RepeatedSample":
        """The largest of the first ``scan`` samples by the elements of its collated tensors, with
        the next largest as the smaller one of each batch (any sample structure: no field is cut)."""
        def elements(i: int) -> int:
            return sum(t.numel() for t in tree_leaves(collate([dataset[i]])) if isinstance(t, torch.Tensor))

        counts = {i: elements(i) for i in range(min(len(dataset), scan))}
        _refuse_empty(counts)
        largest = max(counts, key=counts.__getitem__)
        smaller = [i for i in counts if counts[i] < counts[largest]]
        shorter = dataset[max(smaller, key=counts.__getitem__)] if smaller else None
        if shorter is not None:
            try:  # a collate_fn that stacks (equal sizes only) never pads: its batches are the largest repeated
                collate([dataset[largest], shorter])
            except Exception:  # noqa: BLE001 - whatever a collate_fn raises for mismatched sizes
                shorter = None
        return cls(dataset[largest], collate, shorter)


def _refuse_empty(sizes: Any) -> None:
    if not sizes:
        raise ConfigError("the training dataset is empty: there is no sample to build the worst-case batch from; "
                          "give the trainer samples, or pass make_batch=f(b) -> a batch of b of your longest samples.")


def _one_token_shorter(sample: Any) -> Optional[Dict[str, Any]]:
    """``sample`` without its last token: every per-token field (a 1-D sequence as long as its
    ``input_ids``: labels, masks, positions; lists, tensors or NumPy arrays) loses its last
    element, the rest is kept. ``None`` where the sample cannot be cut so (no padded trial, as
    before)."""
    length = len(sample["input_ids"])

    def per_token(value: Any) -> bool:
        return (hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict))
                and getattr(value, "ndim", 1) == 1 and len(value) == length)

    try:
        shorter = {key: sample[key][:-1] if per_token(sample[key]) else sample[key] for key in sample.keys()}
    except (AttributeError, TypeError, KeyError):
        return None
    return shorter if len(shorter["input_ids"]) < length else None
