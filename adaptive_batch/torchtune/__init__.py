"""torchtune integration: the embedded tokenizer and data, random-init checkpoints, the config
adapter, the planner for configs, and where the recipes live.

Importing :mod:`adaptive_batch` does not import this sub-package (nor torchtune); recipes and
the ``adaptive-batch`` command do. A recipe imports :mod:`adaptive_batch` and this package alone:
the library's pieces a recipe runs beyond the public face (the probe's target and worst-case
batch, stop signals, step-checkpoint keys, the output-dir lock, fault points) are named here too.
"""

from adaptive_batch.data.lengths import sample_lengths
from adaptive_batch.distributed import exit_past_teardown, rank_max_memory
from adaptive_batch.faults import fault_point
from adaptive_batch.files import OutputDirLock, remove_partial_writes
from adaptive_batch.memory.device import device_capacity
from adaptive_batch.memory.tracker import peak_rss_bytes, reset_peak_rss
from adaptive_batch.probe.report import ProbeReport
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.trials import worst_case_text_batch
from adaptive_batch.run.lr_coupling import ParamGroupsOf
from adaptive_batch.run.signals import StopAtOnce, StopSignals
from adaptive_batch.run.state import RNG_KEY
from adaptive_batch.run.step_checkpoints import DIRNAME as STEP_CHECKPOINTS_DIRNAME
from adaptive_batch.run.step_checkpoints import LR_SCHEDULER_KEY
from adaptive_batch.validation import check_bool, check_known_keys

from adaptive_batch.torchtune.checkpoint import (
    UnreadableEpochState,
    claim_output_dir,
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
    check_command_line,
    check_profiler,
    check_run_settings,
    check_stock_recipe_options,
    norm_layer_noise_scale,
    check_writable_dir,
    check_writable_file,
)
from adaptive_batch.torchtune.config import (
    TORCHTUNE_KEYS,
    adaptive_options,
    build,
    load_config,
    recipe_keys,
    trained_settings,
)
from adaptive_batch.torchtune.data import pydoc_paragraphs, pydoc_text_dataset
from adaptive_batch.torchtune.loss import next_token_loss
from adaptive_batch.torchtune.planning import ConfigFirstGuess
from adaptive_batch.torchtune.tokenizer import ByteTokenizer, byte_tokenizer
from adaptive_batch.torchtune.trial_build import RecipeTrialBuild

__all__ = [
    "ConfigFirstGuess",
    # the library's pieces a recipe runs
    "LR_SCHEDULER_KEY",
    "OutputDirLock",
    "ParamGroupsOf",
    "ProbeReport",
    "ProbeTarget",
    "RNG_KEY",
    "STEP_CHECKPOINTS_DIRNAME",
    "StopAtOnce",
    "StopSignals",
    "check_bool",
    "check_known_keys",
    "device_capacity",
    "exit_past_teardown",
    "fault_point",
    "peak_rss_bytes",
    "rank_max_memory",
    "remove_partial_writes",
    "reset_peak_rss",
    "sample_lengths",
    "worst_case_text_batch",
    # torchtune glue
    "ByteTokenizer",
    "UnreadableEpochState",
    "RESUME_AUTO",
    "RecipeTrialBuild",
    "TORCHTUNE_KEYS",
    "adaptive_options",
    "build",
    "check_command_line",
    "claim_output_dir",
    "byte_tokenizer",
    "check_profiler",
    "check_run_settings",
    "check_writable_dir",
    "check_writable_file",
    "check_stock_recipe_options",
    "norm_layer_noise_scale",
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
