"""The run's checkpoints in torchtune's layout, written so that none is ever half there.

- A seeded random initialisation written as a checkpoint, for runs that have no weights: the
  recipe loads it through the config's real checkpointer, so the same code path serves users
  with weights and the embedded default without them.
- Epoch checkpoints: torchtune 0.6.1's checkpointers write ``epoch_<N>/`` and
  ``recipe_state/recipe_state.pt`` in place, so a crash or a full disk mid-save leaves a cut
  file under its final name. :func:`save_epoch_checkpoint` has the checkpointer write into a
  staging directory, flushes it, marks it complete and only then moves each file into place
  (the recipe state last); :func:`recover_epoch_checkpoint`, at the next start, finishes a
  move that a crash interrupted, or removes a staging directory that was never completed.
"""

import hashlib
import json
import os
from pathlib import Path
import shutil
from typing import Any, Callable, Dict, List, Mapping, Optional

from omegaconf import OmegaConf
import torch
from torch import nn

from adaptive_batch.errors import CheckpointWriteError, ConfigError
from adaptive_batch.faults import fault_point
from adaptive_batch.files import (
    atomic_write, fsync_directory, fsync_tree, remove_partial_writes, walk_files, write_failure_cause,
)
import adaptive_batch.logs as logs
from adaptive_batch.memory.oom import first_line
from adaptive_batch.run.step_checkpoints import DIRNAME, StepCheckpoints

STAGING_DIRNAME = ".epoch_checkpoint_writing"
COMPLETE_MARK = "COMPLETE"
RECIPE_STATE_FILE = os.path.join("recipe_state", "recipe_state.pt")
# Written with the last epoch's checkpoint, which keeps no recipe state: without it a resume
# would read the epoch before's and train the finished run's last epoch again.
FINISHED_FILE = "run_finished.json"


def initial_checkpoint_filename(seed: int, model_config: Mapping[str, Any]) -> str:
    """File name of the random initialisation of the model ``model_config`` describes, for
    ``seed``: another model shape in the same directory gets a file of its own."""
    digest = hashlib.sha256(json.dumps(model_config, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"random_init_seed{seed}_{digest}.pt"


def write_random_init_checkpoint(
    build_model: Callable[[], nn.Module],
    checkpoint_dir: str,
    seed: int,
    *,
    model_config: Mapping[str, Any],
    keep: Optional[Callable[[str], bool]] = None,
) -> str:
    """Builds the model with its default init under ``seed`` and saves its state dict.

    The global RNG is left as it was. An existing file for the same seed and model is reused.
    The file is written atomically, so an interrupted run never leaves a partial checkpoint.

    Args:
        build_model: returns the model (on the CPU) with its default initialisation.
        checkpoint_dir: where the file goes.
        seed: the seed of the initialisation.
        model_config: what builds the model (the config's ``model`` node as plain values),
            part of the file name.
        keep: which state-dict keys to write (e.g. the base model's, not LoRA adapters');
            all when ``None``.

    Returns:
        The file name inside ``checkpoint_dir``.

    Raises:
        ValueError: if ``seed`` is not an integer.
        CheckpointWriteError: when the file cannot be written.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(
            f"seed={seed!r}: a random initialisation needs an integer seed; set seed to an "
            "integer or give checkpointer.checkpoint_files."
        )
    filename = initial_checkpoint_filename(seed, model_config)
    path = os.path.join(checkpoint_dir, filename)
    if os.path.exists(path):
        return filename
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state_dict = build_model().state_dict()
    if keep is not None:
        state_dict = {k: v for k, v in state_dict.items() if keep(k)}
    atomic_write(path, lambda f: torch.save(state_dict, f))
    return filename


def save_epoch_checkpoint(
    checkpointer: Any, state_dict: Dict[str, Any], *, epoch: int, intermediate_checkpoint: bool, adapter_only: bool = False
) -> List[str]:
    """Has torchtune's ``checkpointer`` save an epoch checkpoint, complete or not at all.

    Args:
        checkpointer: a torchtune 0.6.1 checkpointer (it writes under its ``_output_dir``).
        state_dict: what the recipe hands ``checkpointer.save_checkpoint``.
        epoch: the epoch it ends.
        intermediate_checkpoint: whether the recipe state is saved too (not after the last epoch).
        adapter_only: whether a LoRA run saves its adapters alone (torchtune's option).

    Returns:
        The files written, relative to the output directory.

    Raises:
        CheckpointWriteError: when a file cannot be written; nothing of this checkpoint is left
            and the earlier ones are as they were.
    """
    output_dir = Path(checkpointer._output_dir)
    staging = output_dir / STAGING_DIRNAME
    shutil.rmtree(staging, ignore_errors=True)
    # torchtune 0.6.1 has no hook for where files go; its save writes under _output_dir alone.
    checkpointer._output_dir = staging
    try:
        staging.mkdir(parents=True)
        checkpointer.save_checkpoint(
            state_dict, epoch=epoch, intermediate_checkpoint=intermediate_checkpoint, adapter_only=adapter_only
        )
        if not intermediate_checkpoint:
            atomic_write(str(staging / FINISHED_FILE), lambda f: json.dump({"epochs": epoch + 1}, f), text=True)
        fsync_tree(str(staging))
        fault_point("epoch_staged")
        atomic_write(str(staging / COMPLETE_MARK), lambda f: None)
    except (OSError, RuntimeError) as e:
        cause = write_failure_cause(str(staging), e) if staging.is_dir() else e
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointWriteError.from_error(str(output_dir / f"epoch_{epoch}"), cause) from e
    finally:
        checkpointer._output_dir = output_dir
    return _move_into_place(str(staging), str(output_dir))


def recover_epoch_checkpoint(output_dir: str, log: Optional[Callable[[str], None]] = None) -> None:
    """Finishes moving an epoch checkpoint an interrupted run had completed, or removes one it
    had not (the checkpoints before it are then the newest); says which to ``log`` (``None``:
    the ``adaptive_batch`` logger)."""
    staging = os.path.join(output_dir, STAGING_DIRNAME)
    if not os.path.isdir(staging):
        return
    with logs.lines_to(log):
        if os.path.exists(os.path.join(staging, COMPLETE_MARK)):
            moved = _move_into_place(staging, output_dir)
            logs.info(f"Finished saving the epoch checkpoint an interrupted run had written ({', '.join(moved) or 'moved'}).")
        else:
            shutil.rmtree(staging)
            logs.info(f"Removed an epoch checkpoint an interrupted run left half-written ({staging}).")


def _move_into_place(staging: str, output_dir: str) -> List[str]:
    """Moves every file of a completed ``staging`` into ``output_dir`` (the recipe state last,
    so it never names an epoch whose weights are not there) and removes ``staging``. Each
    move is one rename; rerun after a crash, it moves what is left. The mark of a finished run
    comes after everything else."""
    files = [f for f in walk_files(staging) if f != COMPLETE_MARK]
    files.sort(key=lambda f: (f == FINISHED_FILE, f == RECIPE_STATE_FILE))
    for name in files:
        if name == RECIPE_STATE_FILE:
            fault_point("epoch_committing")
        target = os.path.join(output_dir, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(os.path.join(staging, name), target)
        fsync_directory(os.path.dirname(target))
    shutil.rmtree(staging)
    fsync_directory(output_dir)
    return files


def finished_run(output_dir: str, epochs: int) -> Optional[str]:
    """What a resume of ``output_dir`` says when the run there finished ``epochs`` (or more)
    and there is nothing to train; ``None`` when it has not finished.

    Raises:
        ConfigError: when it finished fewer than ``epochs`` (its last checkpoint keeps no
            optimizer state to go on from), or its mark cannot be read.
    """
    path = os.path.join(output_dir, FINISHED_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            done = int(json.load(f)["epochs"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"resume_from_checkpoint: {path} cannot be read ({type(e).__name__}: {e}); it marks a finished run. Delete "
            "it to resume from the last intermediate epoch checkpoint, or set resume_from_checkpoint=False to start afresh."
        ) from None
    final = os.path.join(output_dir, f"epoch_{done - 1}")
    if done < epochs:
        raise ConfigError(
            f"epochs={epochs}: the run in {output_dir} finished at {done} epochs, and its last checkpoint keeps no "
            f"optimizer state to go on from. Set epochs={done} (nothing to train), or train further in a new run: "
            f"checkpointer.checkpoint_dir={final} and another output_dir."
        )
    return (
        f"The run in {output_dir} finished its {done} epochs ({final} holds its final weights): nothing to train or "
        "save. To train it again, set resume_from_checkpoint=False (that replaces them) or use another output_dir."
    )


def forget_finished_run(output_dir: str) -> None:
    """Removes the mark of a finished run from ``output_dir``: a run is training there again."""
    path = os.path.join(output_dir, FINISHED_FILE)
    if os.path.exists(path):
        os.remove(path)
        fsync_directory(output_dir)


def claim_output_dir(output_dir: str, checkpoint_dir: str, step_checkpoints: StepCheckpoints, ranks: Any,
                     log: Optional[Callable[[str], None]] = None) -> None:
    """Makes ``output_dir`` this run's: the main rank forgets a finished run there, removes what an
    interrupted one left half-written (``checkpoint_dir``'s and the step checkpoints' too) and
    finishes moving its epoch checkpoint; then every rank waits for it (``ranks.decide_on_main``, which stops every rank
    together when the cleanup fails), so
    no rank's own write under ``output_dir`` (the dataset file) is taken for an interrupted run's
    and removed mid-write, as a rank's was before.

    Args:
        output_dir: the run's output directory.
        checkpoint_dir: the checkpointer's output directory.
        step_checkpoints: the run's step checkpoints.
        ranks: the run's :class:`~adaptive_batch.distributed.RankGroup`.

    Raises:
        OSError, CheckpointWriteError: on every rank, when the main rank's cleanup fails.
        log: takes each line (``None``: the ``adaptive_batch`` logger).
    """
    def clean() -> None:
        with logs.lines_to(log):
            forget_finished_run(checkpoint_dir)
            remove_partial_writes(output_dir)
            step_checkpoints.remove_partial_writes()
            recover_epoch_checkpoint(checkpoint_dir)

    # A collective every rank reaches, which also carries the main rank's failure to the others
    # (a barrier would leave them waiting for a rank that stopped).
    ranks.decide_on_main(clean, errors=(OSError, CheckpointWriteError))


def saved_checkpoints(output_dir: str) -> str:
    """What ``output_dir`` holds to resume from, as a sentence for a run that stopped."""
    epochs = sorted(
        (int(name.split("_")[1]), name) for name in os.listdir(output_dir)
        if name.startswith("epoch_") and name.split("_")[1].isdigit()
    ) if os.path.isdir(output_dir) else []
    steps = StepCheckpoints(os.path.join(output_dir, DIRNAME)).saved()
    kept = [os.path.join(output_dir, epochs[-1][1])] if epochs else []
    kept += [path for _, path in steps[-1:]]
    if not kept:
        return "No checkpoint was kept yet: free space and start the run again."
    return f"Kept: {', '.join(kept)}; free space and resume with resume_from_checkpoint=True."


class UnreadableEpochState(ConfigError):
    """The recipe state of the last epoch checkpoint cannot be read (a file cut short by a
    torchtune without the staged save, a disk error): a resume can go on only from a newer step
    checkpoint; without one it must not start the run afresh over the epoch checkpoints."""

    def __init__(self, path: str, error: BaseException) -> None:
        self.path, self.reason = path, f"{type(error).__name__}: {first_line(error)}"
        super().__init__(
            f"resume_from_checkpoint: the epoch recipe state {path} cannot be read ({self.reason}) and no step "
            "checkpoint is newer: restore the file to resume, or set resume_from_checkpoint=False to start afresh "
            "(which replaces the epoch checkpoints)."
        )


def epoch_checkpoint_step(output_dir: str, recipe_checkpoint: Optional[str] = None) -> int:
    """The global step of the recipe state an epoch-end checkpoint left, or -1 when there is
    none: what a step checkpoint must be newer than to be resumed from.

    Raises:
        UnreadableEpochState: when there is one and it cannot be read.
    """
    from torchtune.training.checkpointing._utils import get_recipe_checkpoint_path

    from adaptive_batch.run.progress import BATCH_STATE_KEY

    try:
        path = get_recipe_checkpoint_path(output_dir, recipe_checkpoint, should_load_recipe_state=True)
    except ValueError:  # no recipe state yet
        return -1
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # one a torchtune without the staged save cut short
        raise UnreadableEpochState(str(path), e) from None
    return int(state.get(BATCH_STATE_KEY, {}).get("global_step", -1))


# What torchtune's checkpointers save weights as; the other files of an epoch are copied configs.
_WEIGHT_SUFFIXES = (".bin", ".safetensors", ".pt", ".pth")


def epoch_weight_files(output_dir: str, recipe_checkpoint: Optional[str], checkpoint_files: Any) -> List[str]:
    """The ``checkpoint_files`` that resume a full finetune from its epoch checkpoint: the
    weights of the epoch the recipe state ends (relative to ``output_dir``, as torchtune 0.6.1
    reads them when resuming), whatever the config named.

    torchtune 0.6.1 resumes from the files the config names, read from ``output_dir``: a config
    naming the starting weights (or none, for a random initialisation) fails there, and one
    naming an older epoch's files would pair those weights with the newer recipe state.

    Raises:
        ConfigError: when the config names files of another epoch than the recipe state's.
    """
    from torchtune import training
    from torchtune.training.checkpointing._utils import get_recipe_checkpoint_path

    path = get_recipe_checkpoint_path(output_dir, recipe_checkpoint, should_load_recipe_state=True)
    epoch = int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)[training.EPOCHS_KEY]) - 1
    folder = f"epoch_{epoch}"
    names = sorted(
        name for name in os.listdir(os.path.join(output_dir, folder))
        if name.endswith(_WEIGHT_SUFFIXES) and not name.startswith("adapter_model")
    )
    files = [f"{folder}/{name}" for name in names]
    if OmegaConf.is_config(checkpoint_files):
        checkpoint_files = OmegaConf.to_container(checkpoint_files)
    named = [str(f) for f in checkpoint_files] if isinstance(checkpoint_files, list) else []
    other = [f for f in named if os.path.exists(os.path.join(output_dir, f)) and f not in files]
    if other:
        raise ConfigError(
            f"resume_from_checkpoint: checkpointer.checkpoint_files={named} are not the weights of {folder}, the epoch "
            f"the recipe state in {output_dir} ends: set checkpoint_files={files}, or leave it as it was at the start."
        )
    return files
