"""One capture of every random number generator a training step may draw from.

The probe puts it back after its trial steps, and a step checkpoint stores it so that a resumed
run draws what the uninterrupted one would have. Everything is kept as lists, numbers and
tensors, so ``torch.load(..., weights_only=True)`` reads it back.
"""

import random
from typing import Any, Dict

import torch

from adaptive_batch.errors import ConfigError

try:  # numpy is optional for the core; torchtune's data stack brings it.
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch's usual dependencies
    np = None

# The generators a state holds; a state without one of them was written by an older version.
REQUIRED = ("python", "torch", "numpy")


def rng_state() -> Dict[str, Any]:
    """Python's, NumPy's, torch's CPU and (once initialised) CUDA generators."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if np is not None:
        name, key, pos, has_gauss, cached = np.random.get_state()
        # uint32 words as int64: a tensor loads under weights_only where a NumPy array does not
        state["numpy"] = [name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restores what :func:`rng_state` returned.

    Raises:
        ConfigError: for a state that lacks a generator (written before NumPy's was kept), since
            a run restored from it would draw other numbers than the one that wrote it.
    """
    missing = [name for name in REQUIRED if name not in state and (name != "numpy" or np is not None)]
    if missing:
        raise ConfigError(
            f"the saved random state has no {', '.join(missing)} generator: it was written by an older "
            "adaptive-batch and cannot resume exactly; resume from the epoch checkpoint or start a new output_dir."
        )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if np is not None:
        name, key, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator for ``epoch``'s shuffle, seeded with ``seed + epoch``: the same order for the
    epoch in any run, resumed or not (the global RNG a sampler would otherwise draw from is the
    checkpoint's step's, or not kept at all)."""
    return torch.Generator().manual_seed((seed + epoch) % 2**63)
