"""Batches packed to a token budget (``max_tokens``) instead of a fixed sample count.

A batch is padded to its longest sample, so its size in memory is ``samples x longest``. Samples
are taken in the picking order and added to the open batch until that padded size would pass
``max_tokens`` (or the batch holds ``max_batch_size`` samples). Every sample appears exactly once
per epoch. The design follows DeepSpeed's variable batch size (``sequence_picking_order``,
``min_batch_size``, ``max_batch_size``).
"""

from dataclasses import dataclass
import math
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence

import torch
from torch.utils.data import Sampler

from adaptive_batch.errors import ConfigError
from adaptive_batch.validation import check_choice, check_positive_int

PICKING_ORDERS = ("dataloader", "seqlen", "random")
LONG_SAMPLE_POLICIES = ("truncate", "error")


@dataclass(frozen=True, kw_only=True)
class TokenBatchOptions:
    """Token-budget batches (DeepSpeed's variable batch size); they check themselves when built.

    Attributes:
        max_tokens: the padded-token budget of a batch, or ``None`` for fixed-size batches.
        sequence_picking_order: the order samples are packed in: ``"dataloader"`` (dataset
            order, shuffled per epoch with ``shuffle``), ``"seqlen"`` (shortest first: least
            padding) or ``"random"`` (a seeded permutation each epoch).
        min_batch_size: the fewest samples in a full token batch, checked before training
            against the longest sample.
        long_sample_policy: a sample longer than ``max_tokens`` is cut to it (``"truncate"``)
            or stops the run (``"error"``); never dropped.

    Raises:
        ConfigError: for the first bad value.
    """

    max_tokens: Optional[int] = None
    sequence_picking_order: Literal["dataloader", "seqlen", "random"] = "dataloader"
    min_batch_size: int = 1
    long_sample_policy: Literal["truncate", "error"] = "truncate"

    def __post_init__(self) -> None:
        check_positive_int("max_tokens", self.max_tokens, allow_none=True)
        check_choice(
            "sequence_picking_order", self.sequence_picking_order, PICKING_ORDERS, "use dataloader, seqlen or random."
        )
        check_positive_int("min_batch_size", self.min_batch_size)
        check_choice(
            "long_sample_policy",
            self.long_sample_policy,
            LONG_SAMPLE_POLICIES,
            "truncate cuts samples longer than max_tokens, error stops the run.",
        )


def check_token_budget(
    lengths: Sequence[int],
    *,
    max_tokens: Any,
    min_batch_size: Any = 1,
    max_batch_size: Any = None,
    long_sample_policy: str = "truncate",
) -> int:
    """Checks a token budget against the data before training.

    Args:
        lengths: token count of every sample.
        max_tokens: the budget for a batch's padded size.
        min_batch_size: the fewest samples a full batch must hold.
        max_batch_size: the most samples a batch may hold, or ``None``.
        long_sample_policy: ``"truncate"`` samples longer than ``max_tokens`` or ``"error"``.

    Returns:
        How many samples are longer than ``max_tokens`` (truncated when training).

    Raises:
        ValueError: naming the key, the value and the fix, for the first bad setting.
    """
    _check_settings(max_tokens, min_batch_size, max_batch_size, long_sample_policy)
    if not lengths:
        raise ValueError("the dataset is empty: there is nothing to batch by tokens.")
    shortest, longest = min(lengths), max(lengths)
    # The least budget every check below takes, so a fix does not lead to the next error (a
    # budget raised to the shortest sample then could not hold min_batch_size of the longest).
    enough = max(shortest, longest if long_sample_policy == "error" or min_batch_size > 1 else 0,
                 min_batch_size * longest if min_batch_size > 1 else 0)
    if max_tokens < shortest:
        raise ValueError(
            f"max_tokens={max_tokens} is smaller than the shortest sample ({shortest} tokens): "
            f"raise max_tokens to at least {enough}."
        )
    too_long = sum(1 for n in lengths if n > max_tokens)
    if too_long and long_sample_policy == "error":
        raise ValueError(
            f"max_tokens={max_tokens}: {too_long} samples are longer (up to {longest} tokens); "
            f"raise max_tokens to {enough} or set long_sample_policy=truncate."
        )
    capped = min(longest, max_tokens)
    if min_batch_size * capped > max_tokens:
        raise ValueError(
            f"max_tokens={max_tokens} cannot hold min_batch_size={min_batch_size} samples of the "
            f"longest length ({capped} tokens, truncated to the budget): raise max_tokens to {enough} or "
            "lower min_batch_size."
        )
    return too_long


def _check_settings(max_tokens: Any, min_batch_size: Any, max_batch_size: Any, long_sample_policy: str) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be a positive integer, e.g. max_tokens=4096.")
    for key, value in (("min_batch_size", min_batch_size), ("max_batch_size", max_batch_size)):
        if value is None and key == "max_batch_size":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be a positive integer{' or null' if key == 'max_batch_size' else ''}.")
    if max_batch_size is not None and min_batch_size > max_batch_size:
        raise ValueError(
            f"min_batch_size={min_batch_size} is larger than max_batch_size={max_batch_size}: "
            "lower min_batch_size or raise max_batch_size."
        )
    if long_sample_policy not in LONG_SAMPLE_POLICIES:
        raise ValueError(
            f"long_sample_policy={long_sample_policy!r} is not one of {list(LONG_SAMPLE_POLICIES)}."
        )


def pack_by_tokens(
    lengths: Sequence[int],
    order: Sequence[int],
    *,
    max_tokens: int,
    max_batch_size: Optional[int] = None,
) -> List[List[int]]:
    """Greedy packing of sample indices, in ``order``, under a padded-token budget.

    Lengths above ``max_tokens`` count as ``max_tokens`` (they are truncated when collated).
    With :func:`check_token_budget` passed, every batch but the epoch's last holds at least
    ``min_batch_size`` samples.
    """
    batches: List[List[int]] = []
    current: List[int] = []
    longest = 0
    for idx in order:
        n = min(lengths[idx], max_tokens)
        grown = max(longest, n)
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (full or grown * (len(current) + 1) > max_tokens):
            batches.append(current)
            current, grown = [], n
        current.append(idx)
        longest = grown
    if current:
        batches.append(current)
    return batches


class TokenBudgetBatchSampler(Sampler[List[int]]):
    """A stateful batch sampler that packs samples to ``max_tokens``, split across ranks.

    Args:
        lengths: token count of every sample.
        max_tokens: the budget for a batch's padded size (samples x longest).
        picking_order: ``"dataloader"`` (dataset order, shuffled per epoch when ``shuffle``),
            ``"seqlen"`` (packed shortest first, the least padding; with ``shuffle`` the batches
            then come in a seeded random order) or ``"random"`` (a seeded permutation every
            epoch, whatever ``shuffle`` says).
        shuffle: shuffle the dataloader order per epoch (as torchtune's sampler does).
        seed: seed of every shuffle; the epoch is added to it.
        max_batch_size: the most samples in one batch.
        num_replicas: data-parallel world size; every rank gets the same number of batches
            (the list is padded by repeating its first batches, like ``DistributedSampler``).
        rank: this rank.

    Raises:
        ValueError: for an unknown picking order or a bad rank.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens: int,
        picking_order: str = "dataloader",
        shuffle: bool = True,
        seed: int = 0,
        max_batch_size: Optional[int] = None,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if picking_order not in PICKING_ORDERS:
            raise ValueError(
                f"sequence_picking_order={picking_order!r} is not one of {list(PICKING_ORDERS)}."
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas}).")
        self.lengths = list(lengths)
        self.max_tokens = max_tokens
        self.picking_order = picking_order
        self.shuffle = shuffle
        self.seed = seed
        self.max_batch_size = max_batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self._yielded = 0
        self._resume_at = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch's order; a new epoch starts from its first batch."""
        if epoch != self.epoch:
            self._resume_at = 0
        self.epoch = epoch

    def _order(self) -> List[int]:
        n = len(self.lengths)
        if self.picking_order == "seqlen":
            return sorted(range(n), key=lambda i: (self.lengths[i], i))
        if self.picking_order == "random" or self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def batches(self) -> List[List[int]]:
        """This rank's batches for the current epoch."""
        all_batches = pack_by_tokens(
            self.lengths, self._order(), max_tokens=self.max_tokens, max_batch_size=self.max_batch_size
        )
        if self.picking_order == "seqlen" and self.shuffle:
            # Packed by length (little padding), trained in a seeded random order of batches.
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            all_batches = [all_batches[i] for i in torch.randperm(len(all_batches), generator=g).tolist()]
        total = math.ceil(len(all_batches) / self.num_replicas) * self.num_replicas
        padded = all_batches + all_batches[: total - len(all_batches)]
        return padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[List[int]]:
        batches = self.batches()
        start, self._resume_at = self._resume_at, 0
        for i in range(start, len(batches)):
            self._yielded = i + 1
            yield batches[i]

    def __len__(self) -> int:
        return len(self.batches())

    def state_dict(self) -> Dict[str, int]:
        """The epoch and how many of its batches were handed out."""
        return {"epoch": self.epoch, "yielded": self._yielded, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continues after the last batch handed out before ``state`` was taken."""
        self.epoch = state["epoch"]
        self.seed = state["seed"]
        self._resume_at = self._yielded = state["yielded"]


class TokenBudgetExceededError(ConfigError):
    """A token batch holds more padded tokens than ``max_tokens``: the lengths it was cut
    from were not the samples' (e.g. an edited sequence-length cache)."""


def truncating_collate(collate_fn: Any, max_len: int, input_key: str) -> Any:
    """Wraps a collate function so that no sample is longer than ``max_len`` tokens, and no
    batch holds more than ``max_len`` padded tokens.

    Used with ``long_sample_policy: truncate``: a sample longer than ``max_tokens`` keeps the
    first ``max_len`` entries of ``sample[input_key]`` and of every sequence as long as it
    (labels, masks).

    Raises:
        TokenBudgetExceededError: from the returned function, for a batch over the budget.
    """

    def collate(samples: List[Dict[str, Any]]) -> Any:
        cut = [_truncated(s, input_key, max_len) for s in samples]
        padded = len(cut) * max((len(s[input_key]) for s in cut), default=0)
        if padded > max_len:
            raise TokenBudgetExceededError(
                f"a token batch of {len(cut)} samples padded to {padded} tokens is over max_tokens={max_len}: "
                "the sample lengths the batches were cut from are wrong; delete <output_dir>/seqlen_cache "
                "and run again."
            )
        return collate_fn(cut)

    return collate


def _truncated(sample: Dict[str, Any], input_key: str, max_len: int) -> Dict[str, Any]:
    length = len(sample[input_key])
    if length <= max_len:
        return sample
    return {k: (v[:max_len] if hasattr(v, "__len__") and not isinstance(v, str) and len(v) == length else v) for k, v in sample.items()}
