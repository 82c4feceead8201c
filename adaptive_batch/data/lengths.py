"""Token length of every sample, computed once per dataset and tokenizer and cached on disk.

A cached file is used only when it is a list of positive integers, one per sample, and a
spot check of some samples (first, last, and evenly spread ones) tokenizes to the stored
lengths; otherwise it is recomputed with a warning. Batches are cut from these lengths, so a
wrong file would silently break the token budget.
"""

import hashlib
import json
import os
from typing import Any, Callable, List, Optional, Sequence

from adaptive_batch.files import atomic_write
import adaptive_batch.logs as logs


def _fingerprint(dataset: Sequence[Any], key: Any, input_key: str) -> str:
    # The config of dataset and tokenizer, the size, and the tokens of the first and last
    # samples: a changed file, tokenizer or filter gives another key.
    probe = [list(dataset[0][input_key]), list(dataset[len(dataset) - 1][input_key])] if len(dataset) else []
    text = json.dumps({"key": key, "size": len(dataset), "probe": probe}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sample_lengths(
    dataset: Sequence[Any],
    *,
    input_key: str,
    cache_dir: Optional[str] = None,
    key: Any = None,
    log: Optional[Callable[[str], None]] = None,
    warn: Optional[Callable[[str], None]] = None,
) -> List[int]:
    """``len(dataset[i][input_key])`` for every sample, read from the cache when it is there.

    Args:
        dataset: a map-style dataset of dict samples.
        input_key: the samples' token list (torchtune: ``"tokens"``).
        cache_dir: where ``seqlen_<key>.json`` files go; ``None`` disables the cache.
        key: anything JSON-serialisable that identifies the dataset and tokenizer (their
            config); it is hashed with the dataset's size and first and last samples.
        log: takes the line saying whether the cache was used (``None``: the ``adaptive_batch``
            logger).
        warn: takes the line when a cached file is ignored (``log`` when ``None``, else the
            logger's warnings).

    Returns:
        The lengths, in dataset order.
    """
    with logs.lines_to(log, warn):
        path = None
        if cache_dir is not None:
            path = os.path.join(cache_dir, f"seqlen_{_fingerprint(dataset, key, input_key)}.json")
            if os.path.exists(path):
                cached, problem = _read_lengths(path, dataset, input_key)
                if cached is not None:
                    logs.info(f"sample lengths read from {path}")
                    return cached
                logs.warning(f"sample length cache {path} ignored ({problem}); computing the lengths again.")
        lengths = [len(dataset[i][input_key]) for i in range(len(dataset))]
        if path is not None:
            atomic_write(path, lambda f: json.dump(lengths, f), text=True)
            logs.info(f"sample lengths computed for {len(lengths)} samples and cached in {path}")
        return lengths


SPOT_CHECKS = 16


def _read_lengths(path: str, dataset: Sequence[Any], input_key: str) -> "tuple[Optional[List[int]], str]":
    """The cached lengths if they are sound for ``dataset``, else ``None`` and why not."""
    try:
        with open(path) as f:
            lengths = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"unreadable: {type(e).__name__}"
    if not isinstance(lengths, list) or len(lengths) != len(dataset):
        size = len(lengths) if isinstance(lengths, list) else type(lengths).__name__
        return None, f"{size} lengths for {len(dataset)} samples"
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths):
        return None, "not all lengths are positive integers"
    n = len(dataset)
    for i in sorted({0, n - 1, *(k * n // SPOT_CHECKS for k in range(SPOT_CHECKS))}):
        actual = len(dataset[i][input_key])
        if lengths[i] != actual:
            return None, f"sample {i} has {actual} tokens, the file says {lengths[i]}"
    return lengths, ""
