"""A seeded random initialisation written as a checkpoint, for runs that have no weights.

The recipe then loads it through the config's real checkpointer, so the same code path serves
users with weights and the embedded default without them.
"""

import os
import tempfile
from typing import Callable, Optional

import torch
from torch import nn


def initial_checkpoint_filename(seed: int) -> str:
    """File name of the random initialisation for ``seed``."""
    return f"random_init_seed{seed}.pt"


def write_random_init_checkpoint(
    build_model: Callable[[], nn.Module],
    checkpoint_dir: str,
    seed: int,
    keep: Optional[Callable[[str], bool]] = None,
) -> str:
    """Builds the model with its default init under ``seed`` and saves its state dict.

    The global RNG is left as it was. An existing file for the same seed is reused. The file is
    written to a temporary name first, so an interrupted run never leaves a partial checkpoint.

    Args:
        build_model: returns the model (on the CPU) with its default initialisation.
        checkpoint_dir: where the file goes.
        seed: the seed of the initialisation.
        keep: which state-dict keys to write (e.g. the base model's, not LoRA adapters');
            all when ``None``.

    Returns:
        The file name inside ``checkpoint_dir``.

    Raises:
        ValueError: if ``seed`` is not an integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(
            f"seed={seed!r}: a random initialisation needs an integer seed; set seed to an "
            "integer or give checkpointer.checkpoint_files."
        )
    filename = initial_checkpoint_filename(seed)
    path = os.path.join(checkpoint_dir, filename)
    if os.path.exists(path):
        return filename
    os.makedirs(checkpoint_dir, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state_dict = build_model().state_dict()
    if keep is not None:
        state_dict = {k: v for k, v in state_dict.items() if keep(k)}
    fd, tmp = tempfile.mkstemp(prefix=".init_", suffix=".pt", dir=checkpoint_dir)
    os.close(fd)
    torch.save(state_dict, tmp)
    os.replace(tmp, path)
    return filename


def epoch_checkpoint_step(
    output_dir: str, recipe_checkpoint: Optional[str] = None, warn: Callable[[str], None] = print
) -> int:
    """The global step of the recipe state an epoch-end checkpoint left, or -1 when there is
    none (or it cannot be read, which ``warn`` reports): what a step checkpoint must be at
    least as new as to be resumed from."""
    from torchtune.training.checkpointing._utils import get_recipe_checkpoint_path

    from adaptive_batch.data.samplers import BATCH_STATE_KEY

    try:
        path = get_recipe_checkpoint_path(output_dir, recipe_checkpoint, should_load_recipe_state=True)
    except ValueError:  # no recipe state yet
        return -1
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torchtune writes it in place: a crash mid-write leaves it cut short
        warn(f"The epoch recipe state {path} cannot be read ({type(e).__name__}); looking to step checkpoints.")
        return -1
    return int(state.get(BATCH_STATE_KEY, {}).get("global_step", -1))
