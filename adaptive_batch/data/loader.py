"""What the batches are drawn from: a map-style dataset and the data loader options a user
would hand torch's ``DataLoader`` (or that ``DataLoader`` itself), checked before any step.

The batch sampler is ours (it resizes batches between steps), so a ``DataLoader`` given in a
dataset's place gives its dataset, ``collate_fn``, shuffling and worker options, and its
``batch_size`` as the first batch.
"""

import dataclasses
from typing import Any, Callable, Dict, Optional

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from adaptive_batch.errors import ConfigError
from adaptive_batch.validation import check_positive_int

# torch's DataLoader options that do not choose the samples of a batch: passed through as given.
LOADER_KEYS = (
    "num_workers", "pin_memory", "pin_memory_device", "persistent_workers", "prefetch_factor", "timeout",
    "worker_init_fn", "multiprocessing_context", "in_order",
)


@dataclasses.dataclass
class LoaderSettings:
    """The dataset, how its samples become a batch, and the loader's worker options."""

    dataset: Any
    collate_fn: Callable
    shuffle: bool
    batch_size: Optional[int]
    options: Dict[str, Any]


def loader_settings(
    dataset: Any, *, batch_size: Optional[int], collate_fn: Callable, shuffle: bool, options: Dict[str, Any]
) -> LoaderSettings:
    """``dataset`` (or a ``DataLoader``'s settings) with ``options`` of :data:`LOADER_KEYS`.

    Raises:
        ConfigError: for an iterable dataset, a loader whose sampler is its own, or no batch size.
    """
    if isinstance(dataset, DataLoader):
        settings = _from_loader(dataset, batch_size)
        settings.options.update(options)
    else:
        settings = LoaderSettings(dataset, collate_fn, shuffle, batch_size, dict(options))
    if isinstance(settings.dataset, IterableDataset) or not hasattr(settings.dataset, "__getitem__"):
        raise ConfigError(
            f"dataset={type(settings.dataset).__name__}: AdaptiveBatch resizes batches of a map-style dataset (one "
            "with __len__ and __getitem__); wrap the samples in one, e.g. a list or torch's TensorDataset."
        )
    if settings.batch_size is None:
        raise ConfigError("batch_size is missing: pass batch_size=, the batch the first step takes.")
    check_positive_int("batch_size", settings.batch_size)
    _check_options(settings.options)
    return settings


def _check_options(options: Dict[str, Any]) -> None:
    workers = options.get("num_workers", 0)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"num_workers={workers!r} must be an int, 0 (load in this process) or more.")
    needs_workers = [key for key in ("prefetch_factor", "persistent_workers") if options.get(key)]
    if workers == 0 and needs_workers:
        raise ConfigError(
            f"{needs_workers[0]}={options[needs_workers[0]]!r} needs worker processes: set num_workers=1 or more, "
            f"or remove {needs_workers[0]}."
        )


def _from_loader(loader: DataLoader, batch_size: Optional[int]) -> LoaderSettings:
    batches = loader.batch_sampler
    own = batches if batches is not None and type(batches) is not BatchSampler else loader.sampler
    if type(own) not in (RandomSampler, SequentialSampler):
        raise ConfigError(
            f"dataset=DataLoader(sampler={type(own).__name__}): AdaptiveBatch draws the batches itself to resize "
            "them; hand it the loader's dataset (shuffle=True or False) instead of a loader with its own sampler."
        )
    if loader.drop_last:
        raise ConfigError(
            "dataset=DataLoader(drop_last=True): AdaptiveBatch keeps every sample (an epoch's last batch may be "
            "smaller); set drop_last=False."
        )
    options = {key: getattr(loader, key) for key in LOADER_KEYS if hasattr(loader, key)}
    if options.get("num_workers", 0) == 0:
        options = {k: v for k, v in options.items() if k in ("num_workers", "pin_memory", "pin_memory_device")}
    return LoaderSettings(
        loader.dataset, loader.collate_fn, isinstance(own, RandomSampler),
        batch_size if batch_size is not None else loader.batch_size, options,
    )
