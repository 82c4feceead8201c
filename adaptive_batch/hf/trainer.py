"""Hugging Face's ``Trainer`` with the batch found before training instead of guessed.

``auto_find_batch_size`` halves the batch after each out-of-memory error (tens of failed steps)
and changes the effective batch as it goes. Here one probe (:func:`find_max_batch_size`) finds
the largest per-device batch before the first step, and the user's effective batch
(``per_device_train_batch_size x gradient_accumulation_steps``) is kept exactly: it is trained
in the fewest micro-batches that fit, uneven in one process where it must be
(:mod:`adaptive_batch.hf.micro_batches`), so the LR the user chose stays right. The evaluation
batch gets a forward-only probe. Under several processes (``torchrun``, ``accelerate launch``) each
rank probes its own device before the model is wrapped for data parallelism, and every rank takes
the smallest answer. The answer goes into every checkpoint and a resumed run takes
it from there, so the data position and the schedule stay those of the run that saved it.

It trains in the process it probes, so, as the recipes do, it sets the allocator options its
batch needs to hold from step to step and says so in one line (on CPU glibc's
``M_MMAP_THRESHOLD`` and ``M_ARENA_MAX``, so address space follows live memory; on CUDA
expandable segments): :func:`adaptive_batch.memory.device.prepare_allocator`.
"""

from contextlib import nullcontext
import copy
import functools
import json
import math
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple
import warnings

import torch
from torch import nn
from torch.utils.data import IterableDataset

from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR, IntervalStrategy, SaveStrategy, get_last_checkpoint, has_length,
)
from transformers.utils import is_datasets_available

from adaptive_batch.batch_tensors import tensors_of
from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.data.worst_case import RepeatedSample
from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import BatchSizeTooLargeError, ConfigError
from adaptive_batch.files import atomic_write
import adaptive_batch.logs as logs
from adaptive_batch.hf.micro_batches import (
    InputsHeld,
    describe_micro_batches,
    effective_batch_args,
    label_items,
    loss_reads_item_count,
    scaled_by_the_ranks,
    micro_batch_weight,
    split_effective_batch,
    split_into_micro_batches,
    uneven_allowed,
)
from adaptive_batch.hf.planned_loader import EpochSeededLengthGroupedSampler, cut_as_planned, first_batch_steps, updates_in
from adaptive_batch.hf.refusals import (
    refuse_a_stream,
    refuse_a_trainer_of_stacked_rows,
    refuse_growth_within_epochs_where_batches_are_shared,
    refuse_what_changes_the_batch,
    refuse_what_growth_cannot_follow,
)
from adaptive_batch.hf.run_position import RunPosition, SampleCountedSchedule
from adaptive_batch.hf.trainer_build import TrainerTrialBuild, stop_at_the_loop, why_trials_stay_here
from adaptive_batch.hf.trial_step import (
    a_batch_maker_of_rows, forward_as_accelerate_runs_it, logged_metrics_kept, worst_case_that_collates,
)
from adaptive_batch.identity import digest
from adaptive_batch.memory.budget import IN_PROCESS_CPU_MARGIN
from adaptive_batch.memory.device import address_space_limit, format_bytes, prepare_allocator
from adaptive_batch.memory.oom import is_oom_error
from adaptive_batch.probe.api import find_max_batch_size, needs_two_samples
from adaptive_batch.probe.cache import step_fields
from adaptive_batch.probe.child import TrialBuildError, TrialProcessNotStartedError
from adaptive_batch.probe.service import ProbeOptions
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.rng import rng_state, set_rng_state
from adaptive_batch.run.framework_growth import FrameworkGrowth, growth_settings
from adaptive_batch.schedule.global_batch import check_global_batch, micro_batch_sizes, micro_batches_per_trial
from adaptive_batch.schedule.growth import GrowthDecision, GrowthOptions, same_setting_recorded
from adaptive_batch.schedule.lr_scaling import LRScalingOptions
from adaptive_batch.validation import check_bool, check_callable, check_positive_int

STATE_FILE = "adaptive_batch.json"


class AdaptiveBatchTrainer(Trainer):
    """A ``Trainer`` that probes its per-device batches before training.

    Args:
        *args: ``Trainer``'s.
        max_memory: the budget for a step's peak (bytes, ``"6GiB"``, a fraction of the device),
            or ``None`` for what the device has.
        make_batch: ``f(b) -> `` a worst-case batch of ``b`` samples; by default the longest
            training sample, ``b`` times, through the data collator (one a token shorter, so the
            batch is padded, where the samples differ in length).
        max_batch_size: the largest training micro-batch worth trying (``None``: the effective
            batch, or the training set where the batch grows); the effective batch is kept, in
            more micro-batches where it is lower.
        global_batch_size: the samples of one optimizer step over every rank, in place of
            ``per_device_train_batch_size x gradient_accumulation_steps x world_size``: each rank's
            share trains in the fewest micro-batches that fit (``gradient_accumulation_steps``
            must then be 1).
        probe_eval: also probe ``per_device_eval_batch_size`` with forward passes alone.
        batch_increase_function: ``f(k, current_batch_size) -> increment`` (or its dotted
            path), called at the start of every epoch ``k`` (0-based), or at boundary ``k`` of
            ``batch_increase_interval``, with the effective batch over every rank (each rank
            grows by its share, rounded down, so ranks stay equal): the effective batch grows,
            trained in micro-batches no larger than the probe's answer, never past the answer
            unless the first one already accumulates (is larger than the answer) or
            ``grow_with_accumulation``;
            the LR schedule is then counted in samples (in steps of the first effective batch).
        batch_increase_interval: ``"epoch"``, or ``"<N> steps"`` or ``"<N> samples"`` in one
            process: each optimizer step's batch is then one batch of the loader, cut at the
            size in force, and split into the micro-batches that fit by :meth:`training_step`.
        grow_with_accumulation: growth passes the answer in accumulated micro-batches.
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``: the LR in force is the schedule's LR
            times the rule's factor for the effective batch against ``lr_scaling_reference``
            (default: the effective batch asked for); it is the ``learning_rate`` logged.
        lr_scaling_reference: the batch, in samples, the configured LR was tuned for.
        weight_decay_scaling: ``"timescale"`` keeps AdamW's ``B / (lr x weight_decay)``.
        log: where the batches are reported (``None``: the ``adaptive_batch`` logger).
        **kwargs: ``Trainer``'s.

    Raises:
        ConfigError: for a ``max_memory`` that cannot be parsed, a ``max_batch_size`` under 1, or
            a ``global_batch_size`` under 1, beside an accumulation or not shared evenly among the
            ranks, before any step;
            for ``auto_find_batch_size=True`` or DeepSpeed or FSDP, which change or shard the
            batch the probe measures, before any step; for a bad growth or LR setting, and growth
            beside ``max_steps`` or a dataset without a length.
    """

    def __init__(
        self,
        *args: Any,
        max_memory: Any = None,
        make_batch: Optional[Callable[[int], Any]] = None,
        max_batch_size: Optional[int] = None,
        global_batch_size: Optional[int] = None,
        probe_eval: bool = True,
        batch_increase_function: Any = None,
        batch_increase_interval: str = "epoch",
        grow_with_accumulation: bool = False,
        lr_scaling: str = "none",
        lr_scaling_reference: Optional[float] = None,
        weight_decay_scaling: str = "none",
        log: Optional[Callable[[str], None]] = None,
        **kwargs: Any,
    ) -> None:
        ProbeOptions(max_memory=max_memory)  # a bad value fails here, in one line
        refuse_a_trainer_of_stacked_rows(type(self))
        self._growth = FrameworkGrowth(
            GrowthOptions(batch_increase_function=batch_increase_function, batch_increase_interval=batch_increase_interval,
                          grow_with_accumulation=grow_with_accumulation),
            LRScalingOptions(lr_scaling=lr_scaling, lr_scaling_reference=lr_scaling_reference,
                             weight_decay_scaling=weight_decay_scaling),
            within_epochs=True,
        )
        self.max_batch_size = check_positive_int("max_batch_size", max_batch_size, allow_none=True)
        check_callable("make_batch", make_batch, "lambda b: collator([longest_sample] * b)", allow_none=True)
        check_positive_int("global_batch_size", global_batch_size, allow_none=True)
        check_bool("probe_eval", probe_eval)  # "false" from a config file is truthy
        if self._growth.grows:  # before the Trainer's own line for a stream, which asks for max_steps
            refuse_a_stream(kwargs.get("train_dataset", args[3] if len(args) > 3 else None))
        args, kwargs = _own_training_arguments(args, kwargs)
        super().__init__(*args, **kwargs)
        self._optimizer_passed = self.optimizer is not None  # a trial process cannot make that one again
        # The batch asked for: each train() probes for it again (a hyperparameter search sets only
        # the arguments it searches, over the ones the last probe applied).
        self._asked_batch = (self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps)
        self._asked_eval_batch = self.args.per_device_eval_batch_size  # the probe's bound for evaluation
        if global_batch_size is not None:  # each rank's share, in micro-batches the probe sizes
            self._asked_batch = (check_global_batch(global_batch_size, world_size=self.args.world_size,
                                                    gradient_accumulation_steps=self.args.gradient_accumulation_steps), 1)
        refuse_what_changes_the_batch(self)
        if self._growth.grows:
            refuse_what_growth_cannot_follow(self.args, self.train_dataset)
            if self._growth.within_epochs:
                refuse_growth_within_epochs_where_batches_are_shared(self._growth.growth, uneven_allowed(self))
        self._position = RunPosition()  # the run's epoch and samples, for growth's schedule and resume
        self._resumed_position: Optional[RunPosition] = None
        self._epoch_loader: Optional[tuple] = None  # (effective batch, the loader of its epochs)
        self.max_memory, self._make_batch, self._probe_eval, self._log = max_memory, make_batch, probe_eval, log
        self.adaptive_batch: Optional[Dict[str, int]] = None
        self._settle: Optional[Callable[[], None]] = None  # the probe or the checkpoint's batches, at the loop's start
        self._ranks = RankGroup(self.args.device)
        self._update_rows: list = []  # the rows of each micro-batch of the step being trained
        self._step_items = 0.0  # the labels of the step being trained, which its micro-batches' losses share
        self._loss_func_ignores_count = False  # a compute_loss_func found to return a plain mean
        self._epoch_start_growth: Optional[dict] = None  # growing within epochs: the state a resume replays from
        # First among the callbacks, so the LR it holds at a step's start is what the others read.
        self.callback_handler.callbacks.insert(0, _BatchHooks(self))

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Probes (or, resuming, reads the checkpoint's batches), then trains as ``Trainer`` does.

        The probe runs at the start of ``Trainer``'s own training loop, once ``train()`` has
        made the model what it trains (activation checkpointing, NEFTune, Liger kernels): a
        probe before them measured a model training does not run."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        saved = _read_state(checkpoint) if isinstance(checkpoint, str) else None
        if saved is not None:
            self._refuse_what_changed_since(saved, checkpoint)
        if self._growth.grows:  # a scheduler set since __init__ (a subclass, a search) too
            refuse_what_growth_cannot_follow(self.args, self.train_dataset, self.lr_scheduler)
        # Before the probe, so the trials see the allocator training will have; a resumed run
        # trains the saved batch on the same allocator as the run that probed it. Its warnings
        # are Python warnings, as Trainer's own.
        with logs.lines_to(self._log, warnings.warn):
            prepare_allocator(self.args.device, probing=saved is None, max_memory=self.max_memory)
        if saved is None:
            self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps = self._asked_batch
        self._update_rows = []  # a second train()'s trials are not weighted by the last run's step
        self._settle = (lambda: self._resume_batches(saved, checkpoint)) if saved is not None else (
            lambda: self._apply(self._probe(), "probed"))
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._growth.detach()  # the optimizer's step hooks of this run

    def _inner_training_loop(self, batch_size: Optional[int] = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer``'s loop, on the batches settled at its start (it builds the data loader
        from ``_train_batch_size``, which :meth:`_apply` sets)."""
        stop_at_the_loop(self)  # a trial process's Trainer is made ready up to here, and no further
        settle, self._settle = self._settle, None
        if settle is not None:
            try:
                with logs.lines_to(self._log):
                    settle()
            except BaseException:
                self._undo_what_train_did()
                raise
        # The loop builds its loader at the batch settled: growth's first epoch may keep it.
        effective = None if self.adaptive_batch is None else self.adaptive_batch["effective_batch_size"]
        self._epoch_loader = (effective, None)
        return super()._inner_training_loop(self._train_batch_size, *args, **kwargs)

    def _undo_what_train_did(self) -> None:
        """After a probe that failed (a budget under batch 1, samples it cannot measure): what
        ``train()`` set up before its loop and its loop would have undone, so another ``train()``
        on this trainer starts as the first did (NEFTune's hook, attached twice, would double
        the noise)."""
        handle = getattr(self, "neftune_hook_handle", None)
        if handle is not None:
            from transformers.integrations.neftune import deactivate_neftune

            deactivate_neftune(self.model, handle, self.accelerator)
            del self.neftune_hook_handle
        self.is_in_train = False

    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``, with each training step's batch: the samples of its optimizer step
        over every rank (``batch_size``) and the micro-batch each rank trains it in, so the
        monitors that show the learning rate in force show the batch beside it."""
        if "loss" in logs and self.adaptive_batch is not None:
            samples = self._growth.trained if self._update_rows else self.adaptive_batch["effective_batch_size"]
            micro_batch = max(self._update_rows, default=self.args.per_device_train_batch_size)
            logs = {**logs, "batch_size": samples * self.args.world_size, "micro_batch_size": micro_batch}
        super().log(logs, *args, **kwargs)

    def _probe(self, make_batch: Optional[Callable[[int], Any]] = None) -> Dict[str, Any]:
        """The per-device batches: the largest training micro-batch that fits, the effective
        batch split into the fewest micro-batches no larger (equal ones under several
        processes), and the evaluation batch; on ``make_batch``'s worst case where the caller
        has made it (:meth:`_worst_case_batches`, which scans the data)."""
        args = self.args
        effective = args.per_device_train_batch_size * args.gradient_accumulation_steps
        make_batch = make_batch or self._worst_case_batches()
        state: Dict[str, Any] = {"probed_step": self._probed_step(make_batch)}
        # Evaluation first: the training answer's check is then the last thing run on the heap
        # training gets, and no evaluation trial that runs out of memory comes after it.
        if self._probe_eval and self.eval_dataset is not None and not isinstance(self.eval_dataset, dict):
            state["per_device_eval_batch_size"] = self._evaluation_batch(make_batch)
        build = self._trial_build(make_batch)
        target = self.trial_target(make_batch)
        # The evaluation probe's trials ran here: the in-process margin for the heap they leave.
        margin = IN_PROCESS_CPU_MARGIN if "per_device_eval_batch_size" in state and build is not None else None
        # Growing, the effective batch passes the first one: a micro-batch up to the dataset may train.
        largest = len(self.train_dataset) if self._growth.grows else effective
        probe = functools.partial(find_max_batch_size, target.train_step, make_batch=make_batch, model=self.model,
                                  optimizer=target.optimizer, max_memory=self.max_memory,
                                  max_batch_size=min(largest, self.max_batch_size or largest),
                                  safety_margin=margin)

        def probe_here_or_in_children() -> int:
            try:
                return probe(build=build)
            except (TrialProcessNotStartedError, TrialBuildError) as e:
                logs.info(f"adaptive-batch: {why_trials_stay_here(e)}; the trials run in this process.")
                return probe(build=None)

        with self._forward_as_trained, logged_metrics_kept(self):
            try:
                # Data-parallel ranks train the same micro-batch: every rank takes the smallest rank's.
                found = self._ranks.smallest(probe_here_or_in_children)
            except BatchSizeTooLargeError as e:
                e.args = (e.args[0] + self._inputs_of_a_step(make_batch, effective),)
                raise
        per_device, accumulation = split_effective_batch(effective, found, uneven_allowed=uneven_allowed(self))
        state.update(effective_batch_size=effective, asked_effective_batch_size=effective, max_micro_batch_size=found,
                     per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                     **self._settings())
        return state

    def _worst_case_batches(self) -> Callable[[int], Any]:
        """The batch maker the probe trains: ``make_batch``, or the longest sample collated; samples
        it cannot be made from are refused before any trial."""
        if self._make_batch:
            return a_batch_maker_of_rows(self._make_batch)
        return worst_case_that_collates(RepeatedSample.longest(*self._as_the_loader_takes(self.train_dataset)))

    def _probed_step(self, make_batch: Callable[[int], Any]) -> Dict[str, str]:
        """What the probe's answer holds for, each part by its digest: a resume on another step
        (a collator padding to 128 where it padded to the batch's longest) trained the saved
        micro-batch at 10.3 MiB of a 6 MiB budget."""
        rng = rng_state()  # a collator may draw (masking): the run's draws stay its own
        try:
            fields = step_fields(self.model, None, make_batch(1), ())
        finally:
            set_rng_state(rng)
        args = self.args
        return {
            "the model's modules, parameters or code (a library's upgrade too)": fields["model"],
            "the longest sample's batch": fields["batch"],
            "gradient checkpointing and precision": digest([bool(args.gradient_checkpointing), args.bf16, args.fp16]),
        }

    def _resume_batches(self, saved: Dict[str, Any], checkpoint: str) -> None:
        """The checkpoint's batches; where the step they were probed on has changed since, the same
        effective batch in micro-batches probed again.

        Raises:
            ConfigError: for such a change in a run that grows (its bound is the probe's answer).
        """
        source = f"from the checkpoint {checkpoint}"
        make_batch = self._worst_case_batches()  # scans the data once: the probe below takes it
        was, now = saved.get("probed_step"), self._probed_step(make_batch)
        changed = [part for part in now if was is not None and was.get(part) != now[part]]
        if not changed:
            return self._apply(saved, source)
        if "growth" in saved:
            raise ConfigError(
                f"resume_from_checkpoint={checkpoint}: its batches were probed on another step ({', '.join(changed)} "
                "changed since), and its growth is bounded by that answer; put them back to resume that run, or train "
                "from the start in another output_dir."
            )
        # The probe trains the step asked for, as a run from the start does (not the last split).
        self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps = self._asked_batch
        probed = self._probe(make_batch)
        per_device, accumulation = split_effective_batch(saved["effective_batch_size"], probed["max_micro_batch_size"],
                                                         uneven_allowed=uneven_allowed(self))
        resplit = {key: probed[key] for key in ("probed_step", "max_micro_batch_size", "per_device_eval_batch_size")
                   if key in probed}
        self._apply({**saved, **resplit, "per_device_train_batch_size": per_device,
                     "gradient_accumulation_steps": accumulation},
                    f"{source}, its micro-batches probed again: {', '.join(changed)} changed since")

    def _evaluation_batch(self, make_batch: Callable[[int], Any]) -> int:
        """The largest evaluation batch up to the one asked (a larger one changed ``eval_loss``
        with the budget) that fits beside the optimizer's state, which training holds when it
        evaluates: probed without it, evaluation in training ran at 15.5 MiB of a 12 MiB budget."""
        eval_batch = worst_case_that_collates(
            RepeatedSample.longest(*self._as_the_loader_takes(self.eval_dataset, "evaluation")), "evaluation")
        target = self.trial_target(make_batch)
        with self._forward_as_trained, logged_metrics_kept(self), target.snapshot():
            try:  # a step makes the optimizer's state; the snapshot takes it away after
                try:
                    target.train_step(make_batch(1))
                except ValueError as e:  # BatchNorm trains no batch of 1
                    if not needs_two_samples(e):
                        raise
                    target.train_step(make_batch(2))
            except Exception as e:  # noqa: BLE001 - it does not fit: the training probe says so
                if not is_oom_error(e):
                    raise
            return self._ranks.smallest(lambda: find_max_batch_size(
                self._eval_step, make_batch=eval_batch, model=self.model, optimizer=target.optimizer,
                max_memory=self.max_memory,
                max_batch_size=min(len(self.eval_dataset), self._asked_eval_batch),
            ))

    def _inputs_of_a_step(self, make_batch: Callable[[int], Any], effective: int) -> str:
        """What a step of ``effective`` samples holds of its inputs at a micro-batch of 1, said
        where that is more than the micro-batch's: a budget under batch 1 may be the step's images."""
        held = self._inputs_held(1, effective)
        samples = held.at_peak(1)
        if samples <= 1:
            return ""
        sample = sum(t.numel() * t.element_size() for t in tensors_of(make_batch(1)))
        return (f" Beside it the Trainer's step holds the inputs of {samples} more samples "
                f"({format_bytes(samples * sample)}): the rest of the step's {held.step_rows}, the next step's as "
                "they are fetched, and the one its loader keeps; a smaller effective batch "
                "(per_device_train_batch_size x gradient_accumulation_steps, or global_batch_size) leaves more.")

    def _average_a_loss_that_ignores_the_item_count(self) -> None:
        """A step in several micro-batches is the whole batch's step only where each micro-batch's
        loss is its share of the step's: the Trainer, which infers from the forward's ``**kwargs``
        that the model divides its loss by the step's ``num_items_in_batch``, adds the losses up
        undivided. A loss that ignores the count (BERT's classification head) then made a step of
        4 micro-batches take 4 times the gradient of the batch, its LR in effect following the
        memory budget. Such a loss is divided by the micro-batches instead, as the Trainer divides
        a loss it knows to be a mean; said in one line."""
        if getattr(self, "loss_is_scaled_for_ga", None) is not None or not (
                self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return  # the Trainer divides it already, or a subclass decided
        dataset, collate = self._as_the_loader_takes(self.train_dataset)
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or len(dataset) == 0:
            return  # no sample to try it on (a stream takes make_batch): the Trainer's choice stands
        own, inputs = self._own_compute_loss(), self._prepare_inputs(collate([dataset[0]]))
        with self._forward_as_trained, logged_metrics_kept(self):  # in the precision training runs
            if loss_reads_item_count(self.model, inputs, self.compute_loss_func,
                                     compute_loss=None if own is None else self.compute_loss):
                return
            # An override takes the Trainer's factor of the ranks only where it calls Trainer.compute_loss.
            multiplied = own is None or (self._ranks_factor() > 1 and scaled_by_the_ranks(
                self.model, inputs, self.compute_loss, self._ranks_factor()))
        # As for a model whose forward takes no count: the Trainer divides its loss by the
        # micro-batches and, under several processes, does not multiply it by their number.
        if self.compute_loss_func is not None or own is not None:
            self.loss_is_scaled_for_ga, self._loss_func_ignores_count = False, multiplied
        else:
            self.model_accepts_loss_kwargs = False
        whose = ("compute_loss_func" if self.compute_loss_func is not None else f"{own}.compute_loss" if own is not None
                 else f"{type(self.model).__name__}'s loss")
        logs.info(f"adaptive-batch: {whose} ignores num_items_in_batch, so each micro-batch's loss is weighted by its "
                  "share of the step's labels (the Trainer would add them up undivided).")

    def _own_compute_loss(self) -> Optional[str]:
        """The class of the user's (or TRL's) that overrides ``compute_loss``, if one does (a
        subclass, a mixin before this class, a trainer after it): its loss may ignore
        ``num_items_in_batch`` whatever the model's does (a plain mean)."""
        for cls in type(self).__mro__:
            if cls is Trainer:  # what comes after it is shadowed by it
                return None
            compute_loss = vars(cls).get("compute_loss")
            if compute_loss is not None and cls is not AdaptiveBatchTrainer:
                return getattr(compute_loss, "_owner", cls.__name__)
        return None

    def _as_the_loader_takes(self, dataset: Any, description: str = "training") -> Tuple[Any, Callable]:
        """``dataset`` and the collator as ``Trainer``'s loaders take them: the columns the model's
        forward does not take removed (a ``datasets.Dataset``'s text columns would not collate)."""
        if is_datasets_available():
            import datasets

            if isinstance(dataset, datasets.Dataset):
                return self._remove_unused_columns(dataset, description=description), self.data_collator
        return dataset, self._get_collator_with_removed_columns(self.data_collator, description=description)

    def _settings(self) -> Dict[str, Any]:
        """What decided the batches besides the device: kept in the checkpoint, compared on resume
        (``max_memory`` in one process: ranks may each have their own, and rank 0 saves)."""
        settings: Dict[str, Any] = {"max_batch_size": self.max_batch_size}
        if self.args.world_size == 1:
            settings["max_memory"] = self.max_memory
        settings.update(growth_settings(self._growth.growth, self._growth.lr))
        if self._growth.grows:  # its position and schedule count each rank's samples of this data
            settings["world_size"] = self.args.world_size
            if has_length(self.train_dataset):
                settings["dataset_size"] = len(self.train_dataset)
        return settings

    def _refuse_what_changed_since(self, saved: Dict[str, Any], checkpoint: str) -> None:
        """A resumed run trains the checkpoint's batches: one asked for otherwise would train, and
        restore the data position and schedule of, a batch the user no longer asks for.

        Raises:
            ConfigError: naming the setting, its value in the checkpoint and now, before any step.
        """
        effective = ("effective batch (per_device_train_batch_size x gradient_accumulation_steps, or "
                     "global_batch_size over the ranks)")
        asked = {effective: self._asked_batch[0] * self._asked_batch[1], **self._settings()}
        # Checkpoints written before the settings were kept have the effective batch alone (and
        # before growth, the one asked for); before growth's settings were kept, none grew.
        unset = growth_settings(GrowthOptions(), LRScalingOptions())
        was = {effective: saved.get("asked_effective_batch_size", saved["effective_batch_size"]),
               **{key: saved.get(key, unset[key]) for key in unset},
               **{key: saved[key] for key in asked if key in saved}}
        for key, value in asked.items():
            if key in was and not same_setting_recorded(key, was[key], value):
                raise ConfigError(
                    f"resume_from_checkpoint={checkpoint}: it trained {key}={was[key]!r}, this Trainer asks for "
                    f"{value!r}; put it back to resume that run, or train from the start in another output_dir."
                )

    def _uneven(self) -> bool:
        """Whether the applied micro-batches differ in size (``per_device_train_batch_size`` is
        then the largest of them)."""
        state = self.adaptive_batch
        return state is not None and (
            state["per_device_train_batch_size"] * state["gradient_accumulation_steps"] != state["effective_batch_size"])

    @property
    def _steps_are_loader_batches(self) -> bool:
        """Whether each optimizer step is one batch of the loader (growth within epochs), split
        into micro-batches by :meth:`training_step`."""
        return self._growth.grows and self._growth.within_epochs and self._growth.state is not None

    def get_train_dataloader(self) -> Any:
        """``Trainer``'s loader; where the micro-batches are uneven, its batches of the effective
        size (its sampler and grouping kept), each split into the micro-batches that fit; where
        the batch grows within epochs, batches of the size in force as each is cut."""
        if self._steps_are_loader_batches:
            # Built at the first batch in every run: group_by_length groups by the batch it is
            # built for, and a resume built at the grown one trained another order.
            with effective_batch_args(self, self._asked_batch[0] * self._asked_batch[1]):
                return cut_as_planned(super().get_train_dataloader(), self._growth)
        if not self._uneven():
            return super().get_train_dataloader()
        with effective_batch_args(self, self.adaptive_batch["effective_batch_size"]):
            loader = super().get_train_dataloader()
        return split_into_micro_batches(loader, self.adaptive_batch["per_device_train_batch_size"])

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer``'s sampler; ``group_by_length``'s seeded each epoch, so a resume draws the
        order of its epoch (the RNG it would draw from is restored at the checkpoint's step)."""
        sampler = super()._get_train_sampler(*args, **kwargs)
        if isinstance(sampler, LengthGroupedSampler) and sampler.generator is None:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return EpochSeededLengthGroupedSampler(sampler, seed)
        return sampler

    def get_total_train_batch_size(self, args: Any) -> int:
        """The samples of one optimizer step over every rank (the effective batch where the
        micro-batches are uneven, not the largest of them times their count)."""
        if not (self._uneven() or self._steps_are_loader_batches):
            return super().get_total_train_batch_size(args)
        return self.adaptive_batch["effective_batch_size"] * args.world_size

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, *args: Any, **kwargs: Any) -> Any:
        """``Trainer``'s micro-batches of one optimizer step, their rows and labels remembered for
        the loss (where a step is one batch of the loader, the rows of the micro-batches it splits
        into), and its samples for the LR rule."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        batches, num_items = self._cut_to_the_runs_end(batches, num_items)
        self._update_rows = [BatchLayout().rows(batch) for batch in batches]
        if self._steps_are_loader_batches and batches:
            self._update_rows = micro_batch_sizes(self._update_rows[0], self.adaptive_batch["max_micro_batch_size"])
        # What the micro-batches' losses share, counted where a step has several (a host sync each).
        self._step_items = (sum(label_items(batch, self._shifts_labels) for batch in batches)
                            if len(self._update_rows) > 1 else 0.0)
        self._growth.train_samples(sum(self._update_rows))  # the LR of the step it trains
        if self._growth.grows:  # the schedule's progress: samples, not steps
            self._position.samples_seen += sum(self._update_rows)
        return batches, num_items

    def _cut_to_the_runs_end(self, batches: list, num_items: Any) -> Tuple[list, Any]:
        """A grown step past the last sample of a run of a fraction of an epoch, cut to it: its
        batch was the epoch's (a step of 32 trained 12 samples past a run of 2.5 epochs, at 4
        times the LR). The planned loader cuts its own; several processes or GPUs train the whole step."""
        last = self._last_sample_of_a_fractional_run() if self._growth.grows else None
        if last is None or self._steps_are_loader_batches or self.args.world_size > 1 or self.args.n_gpu > 1:
            return batches, num_items
        left, kept = last - self._position.samples_seen, []
        for batch in batches:  # the Trainer steps after its count of micro-batches: those past the end are empty
            rows = BatchLayout().rows(batch)
            kept.append(batch if rows <= left else BatchLayout().split(batch, [max(left, 0), rows - max(left, 0)])[0])
            left -= rows
        if left >= 0:
            return batches, num_items
        if num_items is not None:  # the kept labels, as the Trainer counts them
            counted = sum(label_items(batch, self._shifts_labels) for batch in kept)
            num_items = torch.as_tensor(counted, dtype=num_items.dtype, device=num_items.device) if isinstance(
                num_items, torch.Tensor) else counted
        return kept, num_items

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """``Trainer``'s step; where an optimizer step is one batch of the loader larger than
        what fits, that batch in the micro-batches that fit, the gradients of all but the last
        kept local (``no_sync``), each loss its share of the step's (the step's
        ``num_items_in_batch``, or its labels' share: :meth:`compute_loss`), the step's loss returned."""
        if BatchLayout().rows(inputs) == 0:  # past a fractional run's last sample: nothing to train
            return torch.zeros((), device=self.args.device)
        sizes = self._update_rows
        # Not model.training: the Trainer's own step puts the model in train mode, after an
        # evaluation or a resume from a model loaded in eval mode (a step trained unsplit there).
        if not (self._steps_are_loader_batches and len(sizes) > 1):
            return super().training_step(model, inputs, num_items_in_batch)
        self.current_gradient_accumulation_steps = len(sizes)
        pieces = BatchLayout().split(inputs, sizes)
        losses = []
        for i, piece in enumerate(pieces):
            local = i < len(pieces) - 1
            with self.accelerator.no_sync(model) if local else nullcontext():
                losses.append(super().training_step(model, piece, num_items_in_batch))
        return torch.stack(losses).sum()

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        """``Trainer``'s loss, weighted as :meth:`_weighed_loss` says (an override of a subclass or
        a mixin is weighted by the wrapper :meth:`__init_subclass__` puts around it)."""
        def trainers() -> Any:
            return super(AdaptiveBatchTrainer, self).compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)

        return trainers() if self._weighing_loss else self._weighed_loss(trainers, model, inputs, num_items_in_batch)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass whose ``compute_loss`` is another's (its own, or a mixin's before this
        class) has it wrapped in :meth:`_weighed_loss`: shadowed, the weighting did not happen
        while the log said it did, and a mixin's mean was added up undivided (3 times the
        batch's gradient at 3 micro-batches)."""
        super().__init_subclass__(**kwargs)
        compute_loss = cls.compute_loss
        if compute_loss is AdaptiveBatchTrainer.compute_loss or getattr(compute_loss, "_weighed", False):
            return
        owner = next((klass for klass in cls.__mro__ if vars(klass).get("compute_loss") is compute_loss), cls)

        @functools.wraps(compute_loss)
        def weighed(self: "AdaptiveBatchTrainer", model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self._weighing_loss:  # reached through an outer override's super(): weighted there
                return compute_loss(self, model, inputs, *args, **kwargs)
            count = kwargs.get("num_items_in_batch", args[1] if len(args) > 1 else None)
            return self._weighed_loss(lambda: compute_loss(self, model, inputs, *args, **kwargs), model, inputs, count)

        weighed._weighed, weighed._owner = True, owner.__name__
        cls.compute_loss = weighed

    _weighing_loss = False  # inside the outermost compute_loss of a step, which weighs it

    def _weighed_loss(self, compute: Callable[[], Any], model: nn.Module, inputs: Any, num_items_in_batch: Any) -> Any:
        """``compute()``'s loss; where a step has several micro-batches and the loss is not
        weighted by the step's tokens, each micro-batch's mean weighted by its labels (rows, where
        it has none), so every label weighs the same as in the whole batch's mean: the Trainer
        weighs micro-batches alike, and a seq2seq step split 3 ways moved its parameters by 1.5e-2."""
        rows = self._update_rows
        shared = model.training and len(rows) > 1
        # Counted before the Trainer takes the labels out for a loss function.
        items = label_items(inputs, self._shifts_labels) if shared else 0.0
        self._weighing_loss = True
        try:
            result = compute()
        finally:
            self._weighing_loss = False
        weight = self._undo_the_ranks_factor(num_items_in_batch)
        if shared and not self._loss_weighted_by_items(num_items_in_batch):
            weight *= micro_batch_weight(items, self._step_items, len(rows))
        if weight == 1.0:
            return result
        return (result[0] * weight, *result[1:]) if isinstance(result, tuple) else result * weight

    def _undo_the_ranks_factor(self, num_items_in_batch: Any) -> float:
        """The Trainer multiplies a ``compute_loss_func``'s loss by the processes, for a loss over
        the tokens of every rank that DDP then averages; one that ignores the count (a mean,
        :meth:`_average_a_loss_that_ignores_the_item_count`) would take that many times its
        gradient: the factor is divided out, as the Trainer figures it."""
        if not (self._loss_func_ignores_count and self.args.average_tokens_across_devices
                and num_items_in_batch is not None):
            return 1.0
        return 1.0 / self._ranks_factor()

    def _ranks_factor(self) -> int:
        """What ``Trainer.compute_loss`` multiplies a loss over every rank's tokens by, as it figures it."""
        return self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu

    @property
    def _shifts_labels(self) -> bool:
        """Whether the model's loss shifts its labels (a causal LM's), as the Trainer counts them,
        or one of the language-model heads the Trainer reads no loss type of that shift theirs
        (:data:`SHIFTING_LM_HEADS`: GPT-2's mean loss, split, was weighted by a label a row too many)."""
        if getattr(self, "_loss_shifts_labels", False):
            return True
        model = getattr(self.model, "module", self.model)
        return getattr(model, "loss_type", None) is None and type(model).__name__ in SHIFTING_LM_HEADS

    def _loss_weighted_by_items(self, num_items_in_batch: Any) -> bool:
        """Whether ``Trainer`` divides the loss by the step's tokens, as it decides it."""
        decided = getattr(self, "loss_is_scaled_for_ga", None)
        if decided is not None:
            return bool(decided)
        return bool((getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
                    or getattr(self, "compute_loss_func", None) is not None)

    def trial_target(self, make_batch: Callable[[int], Any]) -> ProbeTarget:
        """What a trial trains: this Trainer's own step (:meth:`_train_step`) on its model, with
        the optimizer training will use (``Trainer`` keeps the one made here)."""
        optimizer = self.create_optimizer()
        # A second train() finds the optimizer Accelerate wrapped in the first: the hooks go on the torch one.
        return ProbeTarget(self._train_step, make_batch, self.model, getattr(optimizer, "optimizer", optimizer))

    @property
    def _forward_as_trained(self) -> Any:
        return forward_as_accelerate_runs_it(self.accelerator, self.model)

    def _trial_build(self, make_batch: Callable[[int], Any]) -> Optional[TrainerTrialBuild]:
        """The build trials in fresh processes take (under a hard limit in address space on CPU,
        one process), where this Trainer's parts can be sent to one; where not, a line says why."""
        if self.args.device.type != "cpu" or address_space_limit() is None or self._ranks.distributed:
            return None
        found = TrainerTrialBuild.of(self, make_batch)
        if isinstance(found, TrainerTrialBuild):
            return found
        logs.info(f"adaptive-batch: {found}; the trials run in this process.")
        return None

    def _apply(self, state: Dict[str, int], source: str) -> None:
        args = self.args
        effective = state["effective_batch_size"]
        if state["per_device_train_batch_size"] * state["gradient_accumulation_steps"] != effective and (
                not uneven_allowed(self)):
            # A checkpoint of uneven micro-batches resumed where they cannot run (several processes).
            per_device, accumulation = split_effective_batch(effective, state["max_micro_batch_size"],
                                                             uneven_allowed=False)
            state = {**state, "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation}
        per_device, accumulation = state["per_device_train_batch_size"], state["gradient_accumulation_steps"]
        if self._growth.grows and self._growth.within_epochs:  # a step is one batch of the loader
            per_device, accumulation = min(effective, state["max_micro_batch_size"]), 1
        self._take_micro_batches(per_device, accumulation)
        if "per_device_eval_batch_size" in state:  # a checkpoint's from before its bound: at most the one asked
            args.per_device_eval_batch_size = min(state["per_device_eval_batch_size"], self._asked_eval_batch)
        self.adaptive_batch = {k: v for k, v in state.items() if k not in ("growth", "position")}
        self._start_growth(state)
        if state["gradient_accumulation_steps"] > 1 or self._growth.grows:
            self._average_a_loss_that_ignores_the_item_count()
        budget = "the device" if self.max_memory is None else f"max_memory={self.max_memory}"
        evaluation = (f"; evaluation batch {args.per_device_eval_batch_size}" if "per_device_eval_batch_size" in state
                      else "")  # probed, or the checkpoint's
        logs.info(
            f"adaptive-batch ({source}): the effective batch of {state['effective_batch_size']} trains as "
            f"{describe_micro_batches(state['effective_batch_size'], state['per_device_train_batch_size'])} per "
            f"device (the largest that fits {budget}: {state['max_micro_batch_size']}){evaluation}."
        )

    def _last_sample_of_the_run(self) -> Optional[int]:
        """This rank's samples of the whole run, where the dataset has a length."""
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            return None
        return math.ceil(self.args.num_train_epochs * len(self.train_dataset) / self.args.world_size)

    def _last_sample_of_a_fractional_run(self) -> Optional[int]:
        """This rank's samples of a run of a fraction of an epoch (``num_train_epochs=1.5``):
        where it ends, as the Trainer's count of steps ends it at the first batch."""
        epochs = self.args.num_train_epochs
        return None if epochs == int(epochs) else self._last_sample_of_the_run()

    def _samples_per_schedule_step(self, schedule_steps: int) -> float:
        """The samples one step of the schedule stands for: the run's over the schedule's steps,
        so it ends with the last sample (the first batch, where a dataset it does not divide
        left the decay short of its end: 40 samples at 16 ended at 5/6); the first batch where
        the last short batch of each epoch is dropped."""
        first = self._asked_batch[0] * self._asked_batch[1]
        if self.args.dataloader_drop_last or not schedule_steps:
            return float(first)
        run = self._last_sample_of_a_fractional_run() or self.args.num_train_epochs * len(self.train_dataset) / (
            self.args.world_size)
        return run / schedule_steps

    def _start_growth(self, state: Dict[str, Any]) -> None:
        """The growth of the batch settled: from the checkpoint's state where it has one, else
        from the effective batch asked for."""
        if not (self._growth.grows or self._growth.lr.scales):
            return
        self._resumed_position = None
        self._growth.run_samples = self._last_sample_of_the_run()  # the last batch cut to it
        if "growth" in state:
            if state.get("asked_effective_batch_size", 0) > state["max_micro_batch_size"]:
                self._growth.allow_accumulation()
            self._growth.resume(state["growth"], self._settings(), ranks=self.args.world_size)
            self._resumed_position = RunPosition(**state["position"]) if "position" in state else None
            return
        effective, found = state["effective_batch_size"], state["max_micro_batch_size"]
        if effective > found:  # the Trainer accumulates already: growth goes on in micro-batches
            self._growth.allow_accumulation()
        self._growth.start(found, effective, self._settings(), first=effective, ranks=self.args.world_size)

    def _checkpoint_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the batches: the settled ones, and where growth has them
        and the run is."""
        state = dict(self.adaptive_batch)
        if self._growth.state is not None:
            # Growing within epochs, the loader has cut past the step saved: a resume replays
            # the epoch's batches from its start.
            growth = self._epoch_start_growth if self._steps_are_loader_batches else self._growth.state.to_dict()
            state.update(growth=growth, position=self._position.to_dict())
        return state

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer``'s epoch, growing the batch at its start: the loader, its length and the
        epoch's optimizer steps are those of the epoch's own batch."""
        if not self._growth.grows:
            return super()._run_epoch(*args, **kwargs)
        if self._steps_are_loader_batches:
            return self._run_epoch_of_planned_batches(*args, **kwargs)
        epoch = kwargs["epoch"]
        with logs.lines_to(self._log):
            decision = self._growth.grow_at(epoch)
            if decision is not None:
                self._set_effective(decision)
        effective = self.adaptive_batch["effective_batch_size"]
        built_at, loader = self._epoch_loader
        if built_at != effective:
            loader = self.get_train_dataloader()
        elif loader is None:  # the loop's own, built at this batch
            loader = kwargs["train_dataloader"]
        self._epoch_loader = (effective, loader)
        steps = len(loader)
        kwargs.update(train_dataloader=loader, steps_in_epoch=steps,
                      num_update_steps_per_epoch=updates_in(steps, self.args.gradient_accumulation_steps))
        self._mark_epoch_start(epoch, kwargs["num_update_steps_per_epoch"], kwargs)
        return super()._run_epoch(*args, **kwargs)

    def _run_epoch_of_planned_batches(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer``'s epoch where its batches grow as they are cut: its length is the plan's
        from the epoch's start (kept, for a resume to replay the epoch from)."""
        epoch = kwargs["epoch"]
        if self._epoch_loader[1] is None:  # the loop's own, built at the batch in force
            self._epoch_loader = (None, kwargs["train_dataloader"])
        loader = self._epoch_loader[1]
        self._epoch_start_growth = self._growth.state.to_dict()
        steps = len(loader)
        kwargs.update(train_dataloader=loader, steps_in_epoch=steps, num_update_steps_per_epoch=steps)
        self._mark_epoch_start(epoch, steps, kwargs)
        with logs.lines_to(self._log):
            return super()._run_epoch(*args, **kwargs)

    def _mark_epoch_start(self, epoch: int, updates: int, kwargs: Dict[str, Any]) -> None:
        """The position's epoch: where it started, unless a resume goes on with the checkpoint's."""
        resuming = kwargs.get("resume_from_checkpoint") is not None and epoch == kwargs.get("epochs_trained")
        if not (resuming and self._resumed_position is not None and self._resumed_position.epoch == epoch):
            self._position.epoch, self._position.epoch_start_step = epoch, self.state.global_step
        self._position.epoch_updates = updates

    def _take_micro_batches(self, per_device: int, accumulation: int) -> None:
        """The arguments the Trainer builds its loader and steps from, for these micro-batches."""
        self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps = per_device, accumulation
        self._train_batch_size = self.args.train_batch_size

    def _set_effective(self, decision: GrowthDecision) -> None:
        """The grown effective batch, in the fewest micro-batches no larger than the answer."""
        state, effective = self.adaptive_batch, decision.batch_size
        per_device, accumulation = split_effective_batch(effective, state["max_micro_batch_size"],
                                                         uneven_allowed=uneven_allowed(self))
        self._take_micro_batches(per_device, accumulation)
        state.update(effective_batch_size=effective, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=accumulation)
        clamp = f" ({decision.requested} asked; the largest that trains)" if decision.clamped else ""
        ranks = self.args.world_size
        over = f" on each of {ranks} ranks ({effective * ranks} in all)" if ranks > 1 else ""
        logs.info(f"adaptive-batch: epoch {decision.epoch}: the effective batch {decision.previous} -> {effective}"
                  f"{clamp}{over}, trained as {describe_micro_batches(effective, per_device)}; "
                  f"LR x {self._growth.lr_factor_for(effective):.4g}.")

    def _init_training_state(self, max_steps: int, *args: Any, **kwargs: Any) -> Any:
        """``Trainer``'s state; growing, a resumed run starts where the checkpoint's position
        says (the Trainer would divide the global step by an epoch's steps at the first batch),
        and the schedule keeps the length it had when the run started."""
        epochs_trained, steps_in_epoch = super()._init_training_state(max_steps, *args, **kwargs)
        if not self._growth.grows:
            return epochs_trained, steps_in_epoch
        position = self._resumed_position
        if position is None:
            if self._steps_are_loader_batches:  # the loader's length has its growth: count at the first batch
                max_steps = self.state.max_steps = first_batch_steps(self.args, len(self.train_dataset),
                                                                     self._asked_batch[0] * self._asked_batch[1])
            self._position = RunPosition(schedule_steps=max_steps)
            return epochs_trained, steps_in_epoch
        self._position = RunPosition(**position.to_dict())
        self.state.max_steps = position.schedule_steps
        epoch, into = position.resume_point(self.state.global_step, self.args.gradient_accumulation_steps)
        if self._steps_are_loader_batches and epoch > position.epoch:  # the checkpoint's epoch had ended
            self._growth.finish_epoch(len(self.train_dataset), self.args.dataloader_drop_last)
        return epoch, into

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """``Trainer``'s scheduler; growing, counted in samples (steps of the first effective
        batch), over the length it had when the run started; the LR rule's hooks on the
        optimizer, so every step trains at the LR in force."""
        if self._growth.grows:
            num_training_steps = self._position.schedule_steps or num_training_steps
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self._growth.grows and not isinstance(scheduler, SampleCountedSchedule):
            per_step = self._samples_per_schedule_step(num_training_steps)
            self.lr_scheduler = scheduler = SampleCountedSchedule(scheduler, per_step, lambda: self._position.samples_seen)
        if self._growth.state is not None:
            self._growth.detach()
            torch_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # under Accelerate's wrapper
            self._growth.attach_optimizer(torch_optimizer, scheduler, hold_before_step=True)
            self._growth.hold_lr()
        return scheduler

    def _get_learning_rate(self) -> float:
        """The LR the step trained at: the schedule's times the rule's factor for its batch."""
        return super()._get_learning_rate() * self._growth.lr_factor()

    def _train_step(self, batch: Any) -> None:
        """One optimizer step as the Trainer runs it, at the micro-batch of ``batch``: two
        micro-batches through ``training_step`` (its autocast, loss scaling and
        ``accelerator.backward``) with the first one's gradients alive through the second, as
        under accumulation, then clipping, the optimizer step and ``zero_grad``. One micro-batch
        where the effective batch fits in it. Dropping the gradients after every micro-batch found
        16 where a fresh Trainer failed 16 at step 1 and trained 12."""
        effective = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        rows = BatchLayout().rows(batch)
        # The effective batch is per device: the rule's global batch over one rank.
        pieces = [batch] * micro_batches_per_trial(rows, global_batch_size=effective,
                                                   grow_with_accumulation=self.trials_grow_by_accumulation())
        inputs = self._inputs_held(rows, effective)
        # The inputs training holds beside this micro-batch: the step's others and the next one.
        held = BatchLayout().copies(batch, inputs.beside(rows))
        self.current_gradient_accumulation_steps = len(pieces)
        # The step's count where the Trainer passes one (a compute_loss_func may divide by it), this
        # rank's alone: the Trainer's sums it over the ranks (a collective), and ranks probe their
        # own budgets in their own number of trials. The memory is the same.
        items = None
        if isinstance(batch, Mapping) and "labels" in batch and (
                self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            items = torch.tensor(label_items(batch, self._shifts_labels) * len(pieces), device=self.args.device)
        for piece in pieces:
            self.training_step(self.model, piece, items)
        if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
            self._clip_grad_norm(self.model)
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        # The next step's micro-batches, fetched while the loop's list still holds this one's.
        following = BatchLayout().copies(batch, inputs.step_rows)
        del held, following

    def _inputs_held(self, micro_batch: int, effective: int) -> InputsHeld:
        """The inputs a step of this Trainer holds at ``micro_batch`` (:class:`InputsHeld`)."""
        return InputsHeld.at(micro_batch, effective, grows=self._growth.grows,
                             grows_by_accumulation=self.trials_grow_by_accumulation(),
                             prefetched=self.args.device.type == "cpu")

    def trials_grow_by_accumulation(self) -> bool:
        """Whether the run may grow past the answer in micro-batches (``grow_with_accumulation``),
        so every trial runs two, with the first one's gradients alive (a trial process is told)."""
        return bool(getattr(self, "_trials_grow_by_accumulation", False)
                    or (self._growth.grows and self._growth.growth.grow_with_accumulation))

    def _eval_step(self, batch: Any) -> None:
        """One evaluation step as the Trainer's loop runs it: the model in eval mode (the
        evaluation loop sets it; the training trials left it in train mode), ``prediction_step``."""
        self.model.eval()
        self.prediction_step(self.model, batch, prediction_loss_only=bool(self.args.prediction_loss_only))


def _own_training_arguments(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The Trainer's arguments with a copy of the caller's ``TrainingArguments``: the batches
    settled go into the Trainer's, not the caller's (a plain Trainer later built with the same
    object trained 18 samples a step where 16 were asked)."""
    if len(args) > 1 and args[1] is not None:
        return (args[0], copy.copy(args[1]), *args[2:]), kwargs
    if kwargs.get("args") is not None:
        return args, {**kwargs, "args": copy.copy(kwargs["args"])}
    return args, kwargs


# Causal language-model heads whose loss shifts the labels and whose loss_type the Trainer
# cannot read (XLNet's and XLM's LM heads, named alike, do not shift theirs).
SHIFTING_LM_HEADS = frozenset({"GPT2LMHeadModel", "GPT2DoubleHeadsModel", "OpenAIGPTLMHeadModel",
                               "OpenAIGPTDoubleHeadsModel", "CTRLLMHeadModel"})


class _BatchHooks(TrainerCallback):
    """Writes the batches into each checkpoint, beside ``trainer_state.json``; growing, ends a
    run of a fraction of an epoch at its last sample."""

    def __init__(self, trainer: AdaptiveBatchTrainer) -> None:
        self.trainer = trainer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The LR in force from the step's start, where a callback reads the optimizer (here, in
        # on_pre_optimizer_step); the optimizer's post-hook puts the unscaled LR back for the
        # scheduler, which steps next. Callbacks saw the unscaled LR until the update itself.
        self.trainer._growth.hold_lr()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The unscaled LR for the scheduler, which steps next, also where a GradScaler skipped
        # the update (no post-hook of the optimizer's ran then).
        self.trainer._growth.release_lr()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer ends 1.5 epochs by its count of steps at the first batch, which a grown
        # batch never reaches: it trained 2 whole epochs, the last half past its schedule's end.
        trainer, last = self.trainer, self.trainer._last_sample_of_a_fractional_run()
        if trainer._growth.grows and last is not None and trainer._position.samples_seen >= last:
            # As the Trainer ends a run at max_steps: its last evaluation and save too.
            control.should_training_stop = True
            if args.eval_strategy == IntervalStrategy.STEPS and state.global_step % state.eval_steps != 0:
                control.should_evaluate = True
            if args.save_strategy == SaveStrategy.STEPS:
                control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if self.trainer.adaptive_batch is not None and os.path.isdir(folder) and state.is_world_process_zero:
            # Written whole, as the checkpoint's other files: a resume never reads half of it.
            state = self.trainer._checkpoint_state()
            atomic_write(os.path.join(folder, STATE_FILE), lambda f: json.dump(state, f, indent=2), text=True)


def _read_state(checkpoint: str) -> Optional[Dict[str, int]]:
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
