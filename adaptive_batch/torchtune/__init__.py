"""torchtune integration: the embedded tokenizer and data, random-init checkpoints, the config
adapter, the planner for configs, and where the recipes live.

Importing :mod:`adaptive_batch` does not import this sub-package (nor torchtune); recipes and
the ``adaptive-batch`` command do.
"""

from adaptive_batch.torchtune.checkpoint import (
    UnreadableEpochState,
    epoch_checkpoint_step,
    epoch_weight_files,
    finished_run,
    forget_finished_run,
    initial_checkpoint_filename,
    recover_epoch_checkpoint,
    save_epoch_checkpoint,
    saved_checkpoints,
    write_random_init_checkpoint,
)
from adaptive_batch.torchtune.checks import (
    RESUME_AUTO,
    build,
    check_run_settings,
    check_writable_dir,
    check_writable_file,
)
from adaptive_batch.torchtune.config import (
    TORCHTUNE_KEYS,
    adaptive_options,
    check_command_line,
    check_profiler,
    check_stock_recipe_options,
    load_config,
    recipe_keys,
    trained_settings,
)
from adaptive_batch.torchtune.data import pydoc_paragraphs, pydoc_text_dataset
from adaptive_batch.torchtune.loss import next_token_loss
from adaptive_batch.torchtune.tokenizer import ByteTokenizer, byte_tokenizer
from adaptive_batch.torchtune.trial_build import RecipeTrialBuild

__all__ = [
    "ByteTokenizer",
    "UnreadableEpochState",
    "RESUME_AUTO",
    "RecipeTrialBuild",
    "TORCHTUNE_KEYS",
    "adaptive_options",
    "build",
    "check_command_line",
    "byte_tokenizer",
    "check_profiler",
    "check_run_settings",
    "check_writable_dir",
    "check_writable_file",
    "check_stock_recipe_options",
    "epoch_checkpoint_step",
    "epoch_weight_files",
    "finished_run",
    "forget_finished_run",
    "initial_checkpoint_filename",
    "load_config",
    "next_token_loss",
    "pydoc_paragraphs",
    "pydoc_text_dataset",
    "recipe_keys",
    "recover_epoch_checkpoint",
    "save_epoch_checkpoint",
    "saved_checkpoints",
    "trained_settings",
    "write_random_init_checkpoint",
]
