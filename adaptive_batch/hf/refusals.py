"""What ``AdaptiveBatchTrainer`` cannot follow, refused in one line before any work: settings that
would make the probe's answer not training's batch, and what growth cannot count or cut."""

from typing import Any

from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import IterableDataset
from transformers import Trainer

from adaptive_batch.errors import ConfigError
from adaptive_batch.hf.run_position import SampleCountedSchedule
from adaptive_batch.schedule.growth import GrowthOptions


def refuse_a_trainer_of_stacked_rows(trainer_class: type) -> None:
    """TRL's trainers other than SFT stack each sample's rows in a batch.

    Raises:
        ConfigError: for one of them (DPO, reward modelling, GRPO, ...) in ``trainer_class``.
    """
    stacked = next((cls.__name__ for cls in trainer_class.__mro__ if cls.__module__.startswith("trl.")
                    and cls.__name__.endswith("Trainer") and cls.__name__ not in ("SFTTrainer", "_BaseTrainer")), None)
    if stacked is not None:
        raise ConfigError(
            f"{stacked} with AdaptiveBatchTrainer: its batches stack each sample's rows (chosen and rejected, or a "
            "prompt's completions), which the probe's batches, the micro-batch split and the LR rule would count as "
            "samples; AdaptiveBatchTrainer composes with TRL's SFTTrainer. Train with the plain trainer."
        )


def refuse_what_changes_the_batch(trainer: Trainer) -> None:
    """What would make the probe's answer not the batch training runs, refused in one line.

    Raises:
        ConfigError: for ``auto_find_batch_size=True``, DeepSpeed or FSDP.
    """
    if trainer.args.auto_find_batch_size:
        raise ConfigError(
            "auto_find_batch_size=True with AdaptiveBatchTrainer: Trainer's own search would shrink the probed "
            "batch by 0.9 after each out-of-memory error and change the effective batch; set "
            "auto_find_batch_size=False (the probe finds the batch before the first step)."
        )
    fsdp = trainer.is_fsdp_enabled or getattr(trainer, "is_fsdp_xla_enabled", False)
    for name, enabled in (("deepspeed", trainer.is_deepspeed_enabled), ("fsdp", fsdp)):
        if enabled:
            raise ConfigError(
                f"{name} with AdaptiveBatchTrainer: the probe's trials run one process's step on the whole "
                f"model, not {name}'s sharded one, so its answer would not be training's; remove {name} from "
                "TrainingArguments (plain data parallelism under torchrun takes the smallest rank's answer)."
            )


def refuse_what_growth_cannot_follow(args: Any, train_dataset: Any, lr_scheduler: Any = None) -> None:
    """What growth cannot be decided or counted with, refused in one line.

    Raises:
        ConfigError: for ``max_steps`` (an epoch takes fewer steps as the batch grows), a
            dataset without a length, TRL's ``padding_free`` or ``packing`` (a row holds many
            samples), or a schedule that cannot be counted in samples (a ``LambdaLR``'s can:
            every ``lr_scheduler_type`` but ``reduce_lr_on_plateau``).
    """
    if str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "reduce_lr_on_plateau" or (
            lr_scheduler is not None and not isinstance(lr_scheduler, (LambdaLR, SampleCountedSchedule))):
        name = type(lr_scheduler).__name__ if lr_scheduler is not None else "ReduceLROnPlateau"
        raise ConfigError(
            f"lr_scheduler_type with batch_increase_function: {name} is not a LambdaLR, so it cannot be counted in "
            "samples as the batch grows; use one of the Trainer's LambdaLR schedules (linear, cosine, constant, ...)."
        )
    refuse_a_stream(train_dataset)
    for key in ("padding_free", "packing"):  # TRL packs for padding-free batches on its own
        if getattr(args, key, False):
            raise ConfigError(
                f"{key}=True with batch_increase_function: a {key.replace('_', '-')} batch is one row of many "
                f"samples, so the batch could not be counted, cut or split by samples; set {key}=False to grow the "
                "batch."
            )
    if args.max_steps and args.max_steps > 0:
        raise ConfigError(
            f"max_steps={args.max_steps} with batch_increase_function: as the batch grows an epoch takes fewer "
            "steps, so a count of steps would not be the run's length; set num_train_epochs and max_steps=-1 "
            "(the default)."
        )


def refuse_a_stream(train_dataset: Any) -> None:
    """Growth needs epochs of known length.

    Raises:
        ConfigError: for an ``IterableDataset``.
    """
    if isinstance(train_dataset, IterableDataset):
        raise ConfigError(
            "batch_increase_function with an IterableDataset: an epoch of unknown length has no start to grow at, "
            "and no length to count the schedule over; give the Trainer a dataset with a length (a datasets.Dataset, "
            "a list), or train without batch_increase_function."
        )


def refuse_growth_within_epochs_where_batches_are_shared(growth: GrowthOptions, one_process: bool) -> None:
    """Growth within epochs needs each step's batch whole in one process (several processes,
    ``DataParallel`` and ``batch_rebalance`` share each batch out by count).

    Raises:
        ConfigError: where the batches are shared out.
    """
    if not one_process:
        raise ConfigError(
            f"batch_increase_interval='{growth.batch_increase_interval}' with several processes (or several GPUs in "
            "one, or train_sampling_strategy='batch_rebalance'): the batches are shared out by count, so a batch "
            "cut at a new size mid-epoch would not be one rank's step; set batch_increase_interval='epoch' there."
        )


__all__ = ["refuse_a_stream", "refuse_a_trainer_of_stacked_rows",
           "refuse_growth_within_epochs_where_batches_are_shared", "refuse_what_changes_the_batch",
           "refuse_what_growth_cannot_follow"]
