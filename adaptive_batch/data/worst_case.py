"""The worst-case batch of a dataset, built from its own samples through its own collate
function: the largest sample repeated, and, where samples differ in size, one of each batch
smaller, so the collate function pads the batch as it pads the real ones. Where the longest
sample of one field is not that of another (a seq2seq sample's input and its target), each
field's longest sample is in the batch, so the collator pads every field to its longest."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.utils.data import IterableDataset

from adaptive_batch.batch_tensors import tensors_of
from adaptive_batch.errors import ConfigError


@dataclass(frozen=True)
class RepeatedSample:
    """``f(b)``: ``sample`` ``b`` times through ``collate``, the last of them ``shorter`` where
    given (a batch the collator pads, as it pads the real ones). Picklable where its parts are,
    so a trial process can make the same batch."""

    sample: Any
    collate: Callable[[List[Any]], Any]
    shorter: Optional[Any] = None
    longest_of_other_fields: Tuple[Any, ...] = ()

    def __call__(self, batch_size: int) -> Any:
        samples = [self.sample] * batch_size
        others = list(self.longest_of_other_fields[: batch_size - 1])
        samples[1 : 1 + len(others)] = others
        if self.shorter is not None and batch_size > 1 and not others:
            samples[-1] = self.shorter
        return self.collate(samples)

    @classmethod
    def longest(cls, dataset: Any, collate: Callable, *, scan_without_input_ids: int = 256) -> "RepeatedSample":
        """The dataset's longest sample, by the sizes of its sequence and tensor fields (strings and
        numbers aside): no batch the collator pads is longer. Where another field's longest sample is
        another one (a seq2seq target longer than its input), it joins each batch, so every field is
        padded to its longest. Where samples differ in length and one sample is longest in every
        field, one of each batch is one token shorter, so the batch is padded: a padded batch takes
        an attention mask, and with it attention's masked path (a Llama's training at 16 x 512
        tokens peaked 40 MiB higher padded than not, and the answer of unpadded trials ran out of
        memory in training). Samples without ``input_ids`` (images, audio) are sized over the first
        ``scan_without_input_ids`` of them, as decoding every one could take minutes.

        Raises:
            ConfigError: when the samples are not mappings of fields, have no sequence or tensor
                field to measure, or are all empty (pass ``make_batch``).
        """
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError(
                f"the training dataset is a {type(dataset).__name__}, read in order: its longest sample cannot be "
                "picked; pass make_batch=f(b) -> a batch of b of your longest samples."
            )
        _refuse_empty(dataset)
        first = _field_sizes(dataset[0])
        count = len(dataset) if "input_ids" in first else min(len(dataset), scan_without_input_ids)
        sizes = [first] + [_field_sizes(dataset[i]) for i in range(1, count)]
        totals = [sum(size.values()) for size in sizes]
        if max(totals) == 0:
            raise ConfigError(
                f"the training samples have no tokens or values (fields {sorted(first)} are empty): there is nothing "
                "to train; drop the empty samples, or pass make_batch=f(b) -> a batch of b of your longest samples."
            )
        longest = max(range(count), key=totals.__getitem__)
        fields = {field for size in sizes for field in size}
        others = {max(range(count), key=lambda i: (sizes[i].get(field, 0), totals[i])) for field in fields} - {longest}
        others = sorted(others, key=lambda i: -totals[i])
        sample = dataset[longest]
        shorter = None
        if not others and min(totals) < totals[longest] and "input_ids" in sample:
            shorter = _one_token_shorter(sample)
        return cls(sample, collate, shorter, tuple(dataset[i] for i in others))

    @classmethod
    def largest(cls, dataset: Any, collate: Callable[[List[Any]], Any], *, scan: int) -> "RepeatedSample":
        """The largest of the first ``scan`` samples by the elements of its collated tensors, with
        the next largest as the smaller one of each batch (any sample structure: no field is cut)."""
        def elements(i: int) -> int:
            return sum(t.numel() for t in tensors_of(collate([dataset[i]])))

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


def _field_sizes(sample: Any) -> Dict[str, int]:
    """The elements of each sequence or tensor field of ``sample`` (a list of lists counted in
    all); strings, numbers and ``None`` are not sized.

    Raises:
        ConfigError: for a sample that is not a mapping of fields, or has none to size.
    """
    if not isinstance(sample, Mapping):
        raise ConfigError(
            f"the worst-case batch is built from the longest sample's fields, and the samples are "
            f"{type(sample).__name__}s, not mappings of fields: pass make_batch=f(b) -> a batch of b of your longest samples."
        )
    sizes = {key: _elements(value) for key, value in sample.items() if not isinstance(value, (str, bytes))}
    sizes = {key: size for key, size in sizes.items() if size is not None}
    if not sizes:
        raise ConfigError(
            f"the worst-case batch is built from the longest sample's fields, and the samples' fields {sorted(sample)} "
            "hold no sequence or tensor: pass make_batch=f(b) -> a batch of b of your longest samples."
        )
    return sizes


def _elements(value: Any) -> Optional[int]:
    """The elements of a tensor, an array or a (nested) list; ``None`` for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if hasattr(value, "shape") and hasattr(value, "size") and isinstance(value.size, int):  # a NumPy array
        return value.size
    if isinstance(value, (list, tuple)):
        if value and (isinstance(value[0], (list, tuple)) or hasattr(value[0], "shape")):  # nested
            return sum(_elements(item) or 0 for item in value)
        return len(value)
    return None


def _refuse_empty(samples: Any) -> None:
    if not len(samples):
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
