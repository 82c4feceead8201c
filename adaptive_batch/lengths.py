"""Token length of every sample, computed once per dataset and tokenizer and cached on disk."""

import hashlib
import json
import os
import tempfile
from typing import Any, Callable, List, Optional, Sequence


def _fingerprint(dataset: Sequence[Any], key: Any) -> str:
    # The config of dataset and tokenizer, the size, and the tokens of the first and last
    # samples: a changed file, tokenizer or filter gives another key.
    probe = [list(dataset[0]["tokens"]), list(dataset[len(dataset) - 1]["tokens"])] if len(dataset) else []
    text = json.dumps({"key": key, "size": len(dataset), "probe": probe}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sample_lengths(
    dataset: Sequence[Any],
    *,
    cache_dir: Optional[str] = None,
    key: Any = None,
    log: Optional[Callable[[str], None]] = None,
) -> List[int]:
    """``len(dataset[i]["tokens"])`` for every sample, read from the cache when it is there.

    Args:
        dataset: a map-style dataset of ``{"tokens": [...]}`` samples.
        cache_dir: where ``seqlen_<key>.json`` files go; ``None`` disables the cache.
        key: anything JSON-serialisable that identifies the dataset and tokenizer (their
            config); it is hashed with the dataset's size and first and last samples.
        log: called with one line saying whether the cache was used.

    Returns:
        The lengths, in dataset order.
    """
    path = None
    if cache_dir is not None:
        path = os.path.join(cache_dir, f"seqlen_{_fingerprint(dataset, key)}.json")
        try:
            with open(path) as f:
                lengths = json.load(f)
            if isinstance(lengths, list) and len(lengths) == len(dataset):
                if log:
                    log(f"sample lengths read from {path}")
                return lengths
        except (OSError, ValueError):
            pass
    lengths = [len(dataset[i]["tokens"]) for i in range(len(dataset))]
    if path is not None:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".seqlen_", suffix=".json", dir=cache_dir)
        with os.fdopen(fd, "w") as f:
            json.dump(lengths, f)
        os.replace(tmp, path)
        if log:
            log(f"sample lengths computed for {len(lengths)} samples and cached in {path}")
    return lengths
