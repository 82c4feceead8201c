"""Lightning's ``BatchSizeFinder`` replaced by the probe: real training steps of the module's own
``training_step``, a memory-delta estimate, and a search with real out-of-memory trials.

``BatchSizeFinder`` doubles (or bisects) the batch by running the fit loop until a step fails;
in our peer table it lands at 0.57-0.86x of the largest batch that trains. Here the trials run
training's own step at the worst-case batch (the module's ``training_step`` under the trainer's
precision context, its ``backward`` hook through the strategy, clipping, the optimizer step;
two micro-batches with the first one's gradients alive where the trainer accumulates; the
module's own steps under manual optimization), the model, optimizer, scheduler and RNG are put
back afterwards, and the answer is written where Lightning reads the batch size
(``batch_arg_name`` on the module, its ``hparams`` or the datamodule, as ``BatchSizeFinder``
does) before the fit loop builds its dataloader.
"""

from dataclasses import dataclass
import functools
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.exceptions import _TunerExitException
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from adaptive_batch.data.worst_case import RepeatedSample
from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import ConfigError
from adaptive_batch.lightning.fit_trials import (
    batches_the_loop_prefetches, training_step_of, trials_leave_no_trace, trials_on_this_rank_alone,
)
import adaptive_batch.logs as logs
from adaptive_batch.probe.api import find_max_batch_size
from adaptive_batch.probe.service import ProbeOptions
from adaptive_batch.probe.target import MAKE_BATCH_EXAMPLE
from adaptive_batch.rng import epoch_generator, rng_state, set_rng_state
from adaptive_batch.run.framework_growth import FrameworkGrowth, growth_settings
from adaptive_batch.schedule.global_batch import check_global_batch, equal_micro_batches
from adaptive_batch.schedule.growth import GrowthOptions, function_name
from adaptive_batch.schedule.lr_scaling import LRScalingOptions
from adaptive_batch.validation import check_bool, check_callable, check_positive_int

# Samples looked at for the worst case when no make_batch is given: the largest of them,
# by the elements of its collated tensors, stands for every batch (padding collators pad to it).
WORST_CASE_SCAN = 256


@dataclass(frozen=True)
class FitBatch:
    """One optimizer step's samples as the loader's batch and Lightning's accumulation.

    Attributes:
        effective: the samples of one optimizer step (the batch that grows).
        micro_batch: the loader's batch size.
        accumulate: ``accumulate_grad_batches``.
    """

    effective: int
    micro_batch: int
    accumulate: int

    @classmethod
    def of(cls, effective: int, found: int) -> "FitBatch":
        """Whole where it fits, else the fewest equal micro-batches that fit (Lightning
        accumulates by count)."""
        if effective <= found:
            return cls(effective, effective, 1)
        return cls(effective, *equal_micro_batches(effective, found))


class AdaptiveBatchFinder(Callback):
    """Finds the largest batch that trains at fit start and sets it where Lightning reads it;
    with ``batch_increase_function``, grows the batch at each epoch's start up to it, the LR
    following by ``lr_scaling``.

    Args:
        max_memory: the budget for a step's peak (bytes, ``"6GiB"``, a fraction of the device), or
            ``None`` for what the device has.
        batch_arg_name: the attribute that holds the batch size, looked up as Lightning does
            (the module, its ``hparams``, the datamodule).
        make_batch: ``f(batch_size)`` returning the worst-case batch, collated, on the CPU;
            ``None``: the largest of the first :data:`WORST_CASE_SCAN` training samples repeated.
        max_batch_size: the largest size worth trying; ``None``: the training set's size.
        global_batch_size: the samples of one optimizer step over every rank, each rank's share
            trained as the fewest equal micro-batches that fit (``batch_arg_name`` set to the
            micro-batch, the trainer's ``accumulate_grad_batches`` to their count), so the step
            and its LR stay yours.
        batch_increase_function: ``f(epoch, current_batch_size) -> increment`` (or its dotted
            path), called at the start of every epoch (0-based) with the samples of one
            optimizer step over every rank; the fit then starts at the configured batch (or
            ``global_batch_size``) and grows, never past the answer unless it accumulates.
        batch_increase_interval: ``"epoch"``, the only interval Lightning's fit loop can grow at
            (it builds an epoch's dataloader at the epoch's start); others are refused.
        grow_with_accumulation: growth passes the answer in accumulated micro-batches.
        lr_scaling: ``"none"``, ``"linear"`` or ``"sqrt"``: the LR in force is the schedule's (or
            the configured) LR times the rule's factor for the step's batch against
            ``lr_scaling_reference`` (default: the configured batch, ``batch_arg_name`` x
            ``accumulate_grad_batches`` on every rank, or ``global_batch_size``).
        lr_scaling_reference: the batch, in samples, the configured LR was tuned for.
        weight_decay_scaling: ``"timescale"`` keeps AdamW's ``B / (lr x weight_decay)``.
        stop_after: stop the fit once the batch is found (the tuner function sets it).

    Attributes:
        optimal_batch_size: the answer, once found (``None`` before); under several processes,
            the smallest rank's, which every rank trains.

    Raises:
        ConfigError: for a bad ``max_memory``, growth or LR setting, here; at fit start, before any
            trial, for a batch size Lightning cannot find, a strategy that shards the model on
            several processes, several optimizers or
            an ``accumulate_grad_batches`` beside ``global_batch_size`` or growth, several
            training dataloaders, an iterable dataset without ``make_batch``, or
            ``BatchSizeFinder`` beside it; for a resumed fit whose settings differ from the
            checkpoint's; after the probe, for a ``train_dataloader`` that does not build its
            batches at the batch size set.
    """

    def __init__(self, *, max_memory: Any = None, batch_arg_name: str = "batch_size",
                 make_batch: Optional[Callable[[int], Any]] = None, max_batch_size: Optional[int] = None,
                 global_batch_size: Optional[int] = None, batch_increase_function: Any = None,
                 batch_increase_interval: str = "epoch", grow_with_accumulation: bool = False, lr_scaling: str = "none",
                 lr_scaling_reference: Optional[float] = None, weight_decay_scaling: str = "none",
                 stop_after: bool = False, log: Optional[Callable[[str], None]] = None) -> None:
        ProbeOptions(max_memory=max_memory)  # a bad value fails here, in one line
        self.global_batch_size = check_positive_int("global_batch_size", global_batch_size, allow_none=True)
        check_positive_int("max_batch_size", max_batch_size, allow_none=True)
        check_callable("make_batch", make_batch, MAKE_BATCH_EXAMPLE, allow_none=True)
        check_callable("log", log, "print, or a logger's info", allow_none=True)
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ConfigError(f"batch_arg_name={batch_arg_name!r} must name the attribute your train_dataloader reads "
                              "its batch size from, e.g. batch_arg_name='batch_size'.")
        self.max_memory, self.batch_arg_name, self.make_batch = max_memory, batch_arg_name, make_batch
        self.max_batch_size, self.stop_after, self._log = max_batch_size, check_bool("stop_after", stop_after), log
        self.batch = FrameworkGrowth(
            GrowthOptions(batch_increase_function=batch_increase_function, batch_increase_interval=batch_increase_interval,
                          grow_with_accumulation=grow_with_accumulation),
            LRScalingOptions(lr_scaling=lr_scaling, lr_scaling_reference=lr_scaling_reference,
                             weight_decay_scaling=weight_decay_scaling),
            accumulates=self.global_batch_size is not None,
        )
        self.optimal_batch_size: Optional[int] = None
        self._micro_batches_in_step = 0  # since the last optimizer step
        self._checkpoint_state: Optional[Dict[str, Any]] = None
        self._world_size, self._rank_share = 1, global_batch_size  # set for each fit in setup

    def state_dict(self) -> Dict[str, Any]:
        return {} if self.batch.state is None else self.batch.state.to_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._checkpoint_state = dict(state_dict) or None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # before any other callback's work and the model's move to its device
            self._refuse_what_it_cannot_probe(trainer, pl_module)
            # Each rank's share of a global batch (the batch of Lightning's loader is one rank's).
            self._world_size = trainer.world_size
            self._rank_share = None if self.global_batch_size is None else check_global_batch(
                self.global_batch_size, world_size=trainer.world_size, gradient_accumulation_steps=1)
            # First among the callbacks, as Lightning puts its own tuner callbacks, so the LR in
            # force is set before a monitor reads it. Moved in place: the hook loop over the list
            # goes on at the next index, which still holds the next callback.
            trainer.callbacks.remove(self)
            trainer.callbacks.insert(0, self)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._micro_batches_in_step = 0
        with logs.lines_to(self._log):
            if len(trainer.optimizers) > 1:
                raise ConfigError(f"{len(trainer.optimizers)} optimizers: AdaptiveBatchFinder puts back one after its "
                                  "trials; use one optimizer, or probe with adaptive_batch.find_max_batch_size.")
            self.batch.detach()  # hooks of a fit that ended in an error stay out of this one's trials
            previous = lightning_getattr(pl_module, self.batch_arg_name)
            if self._checkpoint_state is not None:
                effective = self.batch.resume(self._checkpoint_state, self._settings(), ranks=self._world_size)
                batch = FitBatch.of(effective, self.batch.state.found)
                self._checkpoint_state = None  # a later fit of this callback without a checkpoint probes
                self.optimal_batch_size = self.batch.state.found
                # Set only: the loop builds the loader after restoring its state, and loads the
                # position a resumable loader saved into it (one built here would miss it).
                self._set_batch(trainer, pl_module, batch, build=False)
                logs.info(f"adaptive-batch: resumed at the checkpoint's batch of {batch.effective} "
                          f"({batch.accumulate} x {batch.micro_batch}); no probe.")
            else:
                self._probe_and_start(trainer, pl_module, previous)
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            schedulers = trainer.lr_scheduler_configs
            self.batch.attach_optimizer(optimizer, schedulers[0].scheduler if schedulers else None,
                                        hold_before_step=True)
            self.batch.hold_lr()
        if self.stop_after:
            self.batch.release_lr()
            self.batch.detach()  # no fit follows in this call to run the hooks
            raise _TunerExitException()

    def _probe_and_start(self, trainer: Trainer, pl_module: LightningModule, previous: int) -> None:
        # Building the fit loop's dataloaders draws from the RNG: the loop built once, as a
        # run without the probe builds it, draws the same (and so shuffles the same).
        before = rng_state()
        loader = _train_loader(trainer)
        make_batch = self.make_batch or _worst_case_batch(loader)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        schedulers = trainer.lr_scheduler_configs
        share = self._rank_share
        probe = functools.partial(
            find_max_batch_size,
            training_step_of(trainer, pl_module, optimizer, share,
                             grow_with_accumulation=(self.batch.grows and self.batch.accumulates)
                             or _a_scheduler_accumulates(trainer),
                             prefetched=batches_the_loop_prefetches(trainer, pl_module)),
            # As the loop hands a batch over: the precision's input dtype, then the device.
            make_batch=lambda b: trainer.strategy.batch_to_device(trainer.precision_plugin.convert_input(make_batch(b))),
            model=pl_module, optimizer=optimizer, max_memory=self.max_memory, device=pl_module.device,
            lr_scheduler=schedulers[0].scheduler if schedulers else None,
            # Growing, the batch passes the first one: any micro-batch up to the dataset may train.
            max_batch_size=_smallest(self.max_batch_size or _dataset_size(loader), None if self.batch.grows else share),
        )
        own: Dict[str, int] = {}  # this rank's answer, beside the one every rank takes

        def probe_this_rank() -> int:
            own["found"] = probe()
            return own["found"]

        with trials_leave_no_trace(trainer), trials_on_this_rank_alone(trainer):
            # Data-parallel ranks train the same micro-batch: every rank takes the smallest rank's.
            found = RankGroup(pl_module.device).smallest(probe_this_rank)
        self.optimal_batch_size = found
        accumulate = int(trainer.accumulate_grad_batches)  # the user's, where neither growth nor a global batch set it
        configured = share or previous * accumulate
        first = share or (None if self.batch.grows else found * accumulate)
        batch = FitBatch.of(self.batch.start(found, configured, self._settings(), first=first, ranks=self._world_size),
                            found)
        set_rng_state(before)
        self._set_batch(trainer, pl_module, batch)
        trainer._logger_connector.reset_results()  # what the trials' self.log() said is no epoch's
        within = "the device" if self.max_memory is None else f"max_memory={self.max_memory}"
        if trainer.world_size > 1:
            within += f" on every rank (this one alone: {own['found']})"
        if batch.accumulate == 1 and self.global_batch_size is None:
            logs.info(f"adaptive-batch: {self.batch_arg_name}={batch.micro_batch} (was {previous}); the largest that "
                      f"trains within {within} is {found}.")
        else:
            what = f"the batch={batch.effective}" if share is None else f"global_batch_size={self.global_batch_size}"
            where = f" on each of {trainer.world_size} ranks" if trainer.world_size > 1 else ""
            logs.info(f"adaptive-batch: {what} trains as {batch.accumulate} x {batch.micro_batch}{where} "
                      f"({self.batch_arg_name}={batch.micro_batch}, was {previous}; "
                      f"accumulate_grad_batches={batch.accumulate}); the largest that trains within {within} is {found}.")

    def _set_batch(self, trainer: Trainer, pl_module: LightningModule, batch: FitBatch, *, build: bool = True) -> None:
        """Sets the loader's batch size and Lightning's accumulation, and rebuilds the loader
        (or, with ``build=False``, leaves it for the loop to build)."""
        lightning_setattr(pl_module, self.batch_arg_name, batch.micro_batch)
        if self.batch.grows or self.global_batch_size is not None:
            trainer.accumulate_grad_batches = batch.accumulate
        if build:
            _rebuild_train_loader(trainer, self.batch_arg_name, batch.micro_batch)
        else:
            trainer.fit_loop._combined_loader = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A fit resumed from a checkpoint taken at an epoch's last batch starts the next epoch as a
        # restart, without on_train_epoch_start: that epoch's growth is decided here. The loop
        # made the epoch's iterator when it built its loader and, restarting, makes none again:
        # the rebuilt loader's is made here, from its seeded shuffle.
        if self.batch.state is not None and trainer.current_epoch > self.batch.state.decided_boundary:
            if self._grow_at_epoch_start(trainer, pl_module):
                iter(trainer.fit_loop._data_fetcher)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._grow_at_epoch_start(trainer, pl_module)

    def _grow_at_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """The epoch's growth; whether the batch changed (and the loader was built again)."""
        with logs.lines_to(self._log):
            decision = self.batch.grow_at(trainer.current_epoch)
            if decision is None:
                return False
            batch = FitBatch.of(decision.batch_size, self.batch.state.found)
            clamp = f" ({decision.requested} asked; the largest that trains)" if decision.clamped else ""
            logs.info(f"adaptive-batch: epoch {decision.epoch}: batch {decision.previous} -> {batch.effective}{clamp}, "
                      f"trained as {batch.accumulate} x {batch.micro_batch}.{_small_split(batch, self.batch.state.found)}")
            self._set_batch(trainer, pl_module, batch)
            # The loop set the epoch on the loader it built before this hook; the new one needs it too.
            for loader in trainer.fit_loop._combined_loader.flattened:
                _set_sampler_epoch(loader, decision.epoch)
                _seed_the_shuffle(loader, decision.epoch)
            return True

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch.hold_lr()  # the LR in force, where a monitor reads it
        self._micro_batches_in_step += 1

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Unscaled until the step itself (whose hooks scale it and put it back): a step a
        # GradScaler skips leaves it unscaled for the scheduler, which a chainable one multiplies.
        # Inside the step (Lightning runs its closure there) the scaled LR stays: released here,
        # every update took the configured LR while every monitor showed the scaled one.
        self.batch.release_lr_before_the_step()
        taken, self._micro_batches_in_step = self._micro_batches_in_step, 0
        if pl_module.automatic_optimization:  # a manual loop steps when it likes: nothing to re-weigh
            self._weigh_a_short_step(trainer, optimizer, taken)

    def _weigh_a_short_step(self, trainer: Trainer, optimizer: Any, taken: int) -> None:
        """An epoch's last step of fewer micro-batches than the accumulation this callback set:
        Lightning divided each micro-batch's loss by the full count, so its gradients are scaled to
        the micro-batches it had (a plain fit's last step at the batch is a mean over its samples;
        its micro-batches weigh alike, so a short last micro-batch weighs as a full one)."""
        accumulate = int(trainer.accumulate_grad_batches)
        if not (self.batch.grows or self.global_batch_size is not None) or not 0 < taken < accumulate:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(accumulate / taken)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.batch.state is not None:
            samples = self.batch.state.effective * self._world_size  # of the optimizer step, over every rank
            pl_module.log("batch_size", float(samples), on_step=True, on_epoch=False, batch_size=self.batch.state.effective)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.batch.detach()
        self._checkpoint_state = None  # validate(ckpt_path=...) loads it too; a later fit probes

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.batch.release_lr()
        self.batch.detach()

    def _settings(self) -> Dict[str, Any]:
        return dict(max_memory=self.max_memory, max_batch_size=self.max_batch_size,
                    global_batch_size=self.global_batch_size, world_size=self._world_size,
                    **growth_settings(self.batch.growth, self.batch.lr))

    def _refuse_what_it_cannot_probe(self, trainer: Trainer, pl_module: LightningModule) -> None:
        name = self.batch_arg_name
        accumulate = int(trainer.accumulate_grad_batches)
        owner = ("global_batch_size" if self.global_batch_size is not None
                 else "batch_increase_function" if self.batch.grows else None)
        if owner is not None and accumulate != 1:
            value = (self.global_batch_size if owner == "global_batch_size"
                     else function_name(self.batch.growth.batch_increase_function))
            raise ConfigError(
                f"accumulate_grad_batches={accumulate} with {owner}={value}: the accumulation "
                "follows from the batch and the micro-batch that fits; set accumulate_grad_batches=1 (the default)."
            )
        if not lightning_hasattr(pl_module, name):
            raise ConfigError(
                f"batch_arg_name={name!r}: neither the LightningModule, its hparams nor the datamodule has it; "
                f"give the module a `{name}` its train_dataloader reads, or name the attribute that holds the batch size."
            )
        strategy = trainer.strategy
        if trainer.world_size > 1 and (not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy)):
            raise ConfigError(
                f"strategy={type(strategy).__name__} on {trainer.world_size} processes: it shards the model, and the "
                "probe's trials run each rank's whole module; use strategy='ddp', or probe on one device and pass "
                "the answer as the batch size."
            )
        if any(isinstance(c, BatchSizeFinder) for c in trainer.callbacks):
            raise ConfigError("BatchSizeFinder and AdaptiveBatchFinder both set the batch size: keep one of them.")
        accumulating = ("global_batch_size" if self.global_batch_size is not None
                        else "grow_with_accumulation" if self.batch.grows and self.batch.accumulates else None)
        if accumulating is not None and not pl_module.automatic_optimization:
            raise ConfigError(
                f"{accumulating} with manual optimization: it trains its batch in accumulated micro-batches, which "
                "Lightning's automatic optimization steps; a manual training_step steps where it likes. Set "
                "automatic_optimization=True, or drop it and accumulate in your own step."
            )
        if owner is not None and any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            raise ConfigError(f"GradientAccumulationScheduler with {owner}: both set accumulate_grad_batches; keep "
                              "one of them.")
        if not trainer.fit_loop._data_source.is_module():
            raise ConfigError(
                "train_dataloaders passed to fit() are built already, so the batch size found cannot reach them: "
                f"return the DataLoader from train_dataloader() (the module's or a datamodule's), built with self.{name}."
            )


def _train_loader(trainer: Trainer) -> Any:
    """The fit loop's training dataloader, built as the loop builds it.

    Raises:
        ConfigError: for several training dataloaders (one worst-case batch stands for one).
    """
    loop = trainer.fit_loop
    loop.setup_data()
    loaders = loop._combined_loader.flattened
    if len(loaders) != 1:
        raise ConfigError(f"{len(loaders)} training dataloaders: AdaptiveBatchFinder probes one; combine them into one "
                          "dataset, or probe with adaptive_batch.find_max_batch_size and a make_batch of your own.")
    return loaders[0]


def _rebuild_train_loader(trainer: Trainer, batch_arg_name: str, batch_size: int) -> None:
    """Makes the fit loop build its dataloaders again at the batch size just set.

    Raises:
        ConfigError: when the rebuilt dataloader does not take it (a ``train_dataloader`` that
            does not read ``batch_arg_name``): the fit would train another batch without a word.
    """
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    loader = loop._combined_loader.flattened[0]
    # A loader of its own batch sampler has no batch_size; the sampler may (torch's has).
    built = loader.batch_size if getattr(loader, "batch_size", None) is not None else getattr(
        getattr(loader, "batch_sampler", None), "batch_size", None)
    if built is not None and built != batch_size:
        raise ConfigError(
            f"batch_arg_name={batch_arg_name!r} is now {batch_size}, but train_dataloader() still builds batches of "
            f"{built}: build its DataLoader with batch_size=self.{batch_arg_name}."
        )


def _a_scheduler_accumulates(trainer: Trainer) -> bool:
    """Whether a ``GradientAccumulationScheduler`` accumulates in some epoch: the trials then hold
    one micro-batch's gradients through the next, as its epochs will (epoch 0's count of 1 gave
    an answer that ran out of memory where it accumulated 8)."""
    return any(isinstance(c, GradientAccumulationScheduler) and c.going_to_accumulate_grad_batches()
               for c in trainer.callbacks)


def _seed_the_shuffle(loader: Any, epoch: int) -> None:
    """A loader rebuilt for a grown epoch shuffles from a generator seeded with the run's seed
    (``seed_everything``'s) and the epoch: its sampler would draw its seed from the global RNG,
    which a checkpoint does not keep, so a fit resumed before a growth epoch shuffled it otherwise
    (a torchdata loader restored from the checkpoint takes up its state only at its next epoch)."""
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and hasattr(sampler, "generator"):  # a shuffling one (DistributedSampler seeds by epoch)
        sampler.generator = epoch_generator(torch.initial_seed(), epoch)


def _small_split(batch: FitBatch, found: int) -> str:
    """A warning, where Lightning's equal micro-batches (it accumulates by count) come out under
    half of what fits: a batch with no divisor near the answer (13 where 6 fit: 13 x 1)."""
    if batch.micro_batch * 2 >= found or batch.accumulate == 1:
        return ""
    return (f" Its micro-batches are under half of the {found} that fit, since {batch.effective} has no divisor "
            f"near it: a batch of a multiple of a size up to {found} trains faster.")


def _smallest(*sizes: Optional[int]) -> Optional[int]:
    given = [size for size in sizes if size is not None]
    return min(given) if given else None


def _dataset_size(loader: Any) -> Optional[int]:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None


def _worst_case_batch(loader: Any) -> Callable[[int], Any]:
    """``f(b)``: the largest of the first training samples, ``b`` times, through the loader's collate_fn.

    Raises:
        ConfigError: for an iterable dataset (no sample to pick by index).
    """
    dataset, collate = loader.dataset, loader.collate_fn
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            f"the training dataset is a {type(dataset).__name__}, read in order: AdaptiveBatchFinder cannot pick "
            "its largest sample; pass make_batch=f(batch_size) returning the worst-case batch."
        )
    return RepeatedSample.largest(dataset, collate, scan=WORST_CASE_SCAN)
