"""The adaptive-batch decisions of a training run, behind a handful of calls a recipe makes.

A recipe builds an :class:`AdaptiveBatchController` from :class:`AdaptiveBatchOptions` in its
constructor (every setting is checked there, before anything expensive), then calls, in
torchtune's order::

    controller.load_state_dict(recipe_state)           # resume: probe result and batch state
    controller.settle(dataset_size=..., probe=...)     # setup: probe (or not), the batch
    sampler = controller.batch_sampler(dataset, shuffle=...)
    controller.attach_lr(optimizer, lr_scheduler, read_lr)
    for epoch in ...:
        steps = controller.start_epoch(epoch, dataloader)   # growth per epoch; the steps left
        for batch in dataloader:
            step = controller.run_step(forward_backward, batch, zero_grad=...)
            lr = controller.before_optimizer_step(step)     # LR scaling
            ...optimizer step...
            controller.after_optimizer_step(step)           # scheduler, batch state, growth
    recipe_state.update(controller.state_dict())            # by steps, samples or tokens

Whether batches hold a number of samples or a token budget is decided once, as a
:mod:`adaptive_batch.run.batching` object.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from adaptive_batch.data.samplers import BATCH_STATE_KEY, BatchState
from adaptive_batch.distributed import RankGroup
from adaptive_batch.memory.device import address_space_limit, return_freed_memory_to_os, use_expandable_segments
from adaptive_batch.probe.cache import default_cache_dir
from adaptive_batch.probe.service import save_probe_report
from adaptive_batch.probe.trials import PROBE_STATE_KEY
from adaptive_batch.run.batching import SampleBatches, TokenBatches
from adaptive_batch.run.grower import Grower
from adaptive_batch.run.lr_coupling import LRCoupling
from adaptive_batch.run.options import AdaptiveBatchOptions, RunContext
from adaptive_batch.run.start import global_batch_plan, starting_batch
from adaptive_batch.run.step import AccumulatedStep, accumulate_gradients, batch_rows
from adaptive_batch.schedule.global_batch import MicroBatchPlan
from adaptive_batch.schedule.noise_scale import NOISE_SCALE_STATE_KEY, GradientNoiseScale
from adaptive_batch.validation import check_positive_int

Probe = Callable[..., Dict[str, Any]]


@dataclass
class StepOutcome:
    """One optimizer step's forward and backward, summed over ranks.

    Attributes:
        accumulated: what ran on this rank (micro-batches, retries).
        samples: this rank's samples.
        global_samples: the samples of all ranks.
        num_tokens: the tokens that carry a loss, all ranks.
        padded_tokens: the batch's padded size in tokens, all ranks.
        loss: the mean loss per counted token, all ranks.
        interval: the growth boundary whose batch the step ran (the epoch, per epoch).
        noise_scale: the gradient noise scale in samples after this step, when measured.
        lr: the LR the optimizer step used (set by :meth:`AdaptiveBatchController.step`).
        grad_norm: what the optimizer step returned (the clipped gradients' norm, or ``None``).
        global_step: optimizer steps taken, this one included.
    """

    accumulated: AccumulatedStep
    samples: int
    global_samples: int
    num_tokens: float
    padded_tokens: float
    loss: float
    interval: int = 0
    noise_scale: Optional[float] = None
    lr: float = float("nan")
    grad_norm: Any = None
    global_step: int = 0


class AdaptiveBatchController:
    """A facade over the parts of a run's batch: the start (:mod:`~adaptive_batch.run.start`),
    growth (:class:`~adaptive_batch.run.grower.Grower`), LR coupling
    (:class:`~adaptive_batch.run.lr_coupling.LRCoupling`), steps in micro-batches
    (:func:`~adaptive_batch.run.step.accumulate_gradients`) and the batch state.

    Args:
        options: the settings.
        batch_size: the configured batch (per rank): the starting batch with growth, the
            batch without growth and probing.
        gradient_accumulation_steps: micro-batches a configured step has.
        device: where training runs.
        output_dir: where the probe report goes.
        max_seq_len: the tokenizer's longest sequence (what the probe's rows hold).
        packed: whether the dataset is packed.
        optimizer_in_bwd: whether the optimizer steps inside backward.
        ranks: the data-parallel ranks (this process alone when ``None``).
        log: where decisions are reported.
        warn: where recoveries are reported (``log`` when ``None``).

    Raises:
        ConfigError: for the first setting, or combination of settings, the run cannot use.
    """

    def __init__(
        self,
        options: AdaptiveBatchOptions,
        *,
        batch_size: int,
        gradient_accumulation_steps: int = 1,
        device: torch.device,
        output_dir: str,
        max_seq_len: Optional[int] = None,
        packed: bool = False,
        optimizer_in_bwd: bool = False,
        ranks: Optional[RankGroup] = None,
        log: Callable[[str], None] = print,
        warn: Optional[Callable[[str], None]] = None,
    ) -> None:
        check_positive_int("batch_size", batch_size)
        check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        self.options, self.device, self.ranks = options, device, ranks or RankGroup(device)
        self.output_dir, self.max_seq_len = output_dir, max_seq_len
        self.log, self.warn = log, warn or log
        self._batch_size, self._accumulation = batch_size, gradient_accumulation_steps
        options.validate(RunContext(device, gradient_accumulation_steps, packed, optimizer_in_bwd,
                                    self.ranks.world_size, max_seq_len))
        self.mode = (
            TokenBatches(options.tokens, options.probe.max_batch_size)
            if options.tokens.max_tokens is not None
            else SampleBatches()
        )
        self.grower = Grower(options.growth, options.noise, ranks=self.ranks, log=self.log, warn=self.warn)
        self.lr: Optional[LRCoupling] = None
        self.micro_batch_plan: Optional[MicroBatchPlan] = None
        self.probe_report: Optional[Dict[str, Any]] = None
        self.batch: Optional[BatchState] = None
        self._batch_state: Optional[Dict[str, Any]] = None
        self._max_steps_per_epoch: Optional[int] = None
        self.dataset_size: Optional[int] = None  # one rank's samples, once settled
        self._sampler: Any = None
        # Under an address-space limit glibc's cache of freed blocks would count against it.
        if device.type == "cpu" and address_space_limit() is not None:
            return_freed_memory_to_os()
        # Likewise the CUDA allocator's split blocks would make the probed batch fail its second step.
        if device.type == "cuda" and self.needs_probe:
            use_expandable_segments(log=self.log, warn=self.warn)

    @property
    def needs_probe(self) -> bool:
        return self.options.needs_probe

    @property
    def probe_cache_dir(self) -> Optional[str]:
        """The directory the probe cache will be read and written in, or ``None`` when unused."""
        probe = self.options.probe
        if not (self.needs_probe and probe.probe_cache):
            return None
        return probe.probe_cache_dir or default_cache_dir()

    @property
    def uses_token_budget(self) -> bool:
        return self.mode.uses_token_budget

    @property
    def global_step(self) -> int:
        return 0 if self.batch is None else self.batch.global_step

    @property
    def noise_scale(self) -> Optional[GradientNoiseScale]:
        return self.grower.noise_scale

    # ------------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:
        """The batch state, the probe result and the noise scale, under their recipe-state keys."""
        state: Dict[str, Any] = {BATCH_STATE_KEY: self.batch.state_dict()}
        if self.probe_report is not None:
            state[PROBE_STATE_KEY] = self.probe_report
        if self.noise_scale is not None:
            state[NOISE_SCALE_STATE_KEY] = self.grower.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Takes a resumed run's probe result and batch state from the recipe state (other
        keys are ignored); the batch state applies once :meth:`settle` has built the batch."""
        self.probe_report = state.get(PROBE_STATE_KEY)
        self._batch_state = state.get(BATCH_STATE_KEY)
        self.grower.load_state_dict(state.get(NOISE_SCALE_STATE_KEY))
        if self.batch is not None and self._batch_state is not None:
            self.batch.load_state_dict(self._batch_state)

    # ------------------------------------------------------------------ setup

    def settle(
        self,
        *,
        dataset_size: int,
        max_steps_per_epoch: Optional[int] = None,
        probe: Optional[Probe] = None,
        lengths: Optional[List[int]] = None,
    ) -> BatchState:
        """Decides the batch to start with and the largest micro-batch, probing if needed
        (:func:`~adaptive_batch.run.start.starting_batch`), and writes the probe report once.

        Args:
            dataset_size: the samples of one rank.
            max_steps_per_epoch: torchtune's cap on an epoch's steps, or ``None``.
            probe: called as ``probe(options, dataset_size=, device=, ranks=, output_dir=,
                log=)`` to find the batch (a partial of :func:`probe_batch_size`); needed
                when probing.
            lengths: every sample's length in tokens (token-budget batches only).

        Returns:
            The batch state.

        Raises:
            ConfigError: for a token budget the samples cannot use.
            BatchSizeTooLargeError: when probing finds that batch 1 does not fit.
        """
        self._max_steps_per_epoch, self.dataset_size = max_steps_per_epoch, dataset_size
        options = self.options
        if self.probe_report is not None:
            self.log(f"Resumed run: using the probed batch_size={self.probe_report['batch_size']} from the recipe state.")
        elif self.needs_probe:
            if not options.probe.use_maximum_batch_size:
                self.log(
                    "batch_increase_function without max_batch_size: probing for the largest batch "
                    "that fits, as the bound of the growth."
                )
            if probe is None:
                raise ValueError("settle() needs probe= to find the largest batch that fits.")
            self.probe_report = probe(
                options.probe, dataset_size=dataset_size, device=self.device, ranks=self.ranks,
                output_dir=self.output_dir, log=self.log,
            )
        report = self.probe_report
        changed = report is not None and self.mode.adopt_probe(report, self.max_seq_len, self.log)
        self.mode.prepare(lengths, self.log)

        global_batch = options.global_batch.global_batch_size
        if global_batch is not None:
            plan = global_batch_plan(
                global_batch, world_size=self.ranks.world_size, dataset_size=dataset_size,
                batch_size=self._batch_size, report=report, throughput_tolerance=options.probe.throughput_tolerance,
            )
            self.micro_batch_plan = plan
            self.log(plan.describe() + "; the global batch and the LR stay, an out-of-memory error halves the micro-batch.")
            start, micro = global_batch // self.ranks.world_size, plan.micro_batch_limit
            if report is not None:
                report["global_batch"], changed = plan.to_dict(), True
        else:
            start, micro = starting_batch(
                batch_size=self._batch_size, gradient_accumulation_steps=self._accumulation, report=report,
                probe=options.probe, growth=options.growth, log=self.log, warn=self.warn,
            )
        if changed:
            save_probe_report(report, self.output_dir, self.ranks)
        self.batch = BatchState(
            batch_size=start,
            max_micro_batch_size=self.mode.max_micro_batch_size(micro, dataset_size),
            # A global batch runs in accumulated micro-batches, and grows the same way.
            grow_with_accumulation=options.growth.grow_with_accumulation or self.micro_batch_plan is not None,
            samples_per_epoch=self.mode.samples_per_epoch(dataset_size, start, max_steps_per_epoch),
        )
        if self._batch_state is not None:
            self.batch.load_state_dict(self._batch_state)
            self.log(f"Resumed run: batch state from the recipe state: {self.batch.state_dict()}")
        return self.batch

    def track_gradients(self, params: Any) -> None:
        """With ``measure_noise_scale``, allocates the gradient copy the measurement needs;
        called before :meth:`settle`, so the probe counts it as training state."""
        self.grower.track_gradients(params)

    def batch_sampler(self, dataset: Any, *, shuffle: bool) -> Any:
        """The batch sampler of this rank's share of ``dataset``, following the batch."""
        self._sampler = self.mode.batch_sampler(dataset, self.batch, self.ranks, shuffle)
        return self._sampler

    def collate(self, collate_fn: Callable) -> Callable:
        """``collate_fn`` as the batches need it (truncated to the token budget)."""
        return self.mode.collate(collate_fn)

    def lr_schedule_steps(self, epochs: int, num_batches: int) -> float:
        """``num_training_steps`` for the LR scheduler, given the first epoch's batches."""
        steps = self.mode.steps_per_epoch(num_batches, self._max_steps_per_epoch)
        return self.mode.lr_schedule_steps(epochs, self.batch, steps)

    def lr_last_epoch(self) -> int:
        """``last_epoch`` for the LR scheduler."""
        return self.mode.lr_last_epoch(self.global_step)

    def attach_lr(self, optimizer: Any, lr_scheduler: Any, read_lr: Callable[[], float]) -> None:
        """Couples the LR to the batch (:class:`~adaptive_batch.run.lr_coupling.LRCoupling`).

        Raises:
            ConfigError: for a scheduler that cannot be counted in samples.
        """
        plan = self.micro_batch_plan
        self.lr = LRCoupling(
            self.options.lr_scaling, optimizer=optimizer, lr_scheduler=lr_scheduler, read_lr=read_lr,
            batch=self.batch, count_in_samples=self.mode.counts_lr_in_samples,
            configured_batch=plan.per_rank if plan is not None else self._batch_size * self._accumulation,
            world_size=self.ranks.world_size,
        )

    # ------------------------------------------------------------------ training

    def start_epoch(self, epoch: int, dataloader: Any) -> int:
        """Starts (or, after a mid-epoch resume, continues) ``epoch``: growth at the epoch's
        boundary, or at boundary 0 of a steps, samples or tokens interval; returns the steps
        the epoch has left.

        Raises:
            BatchIncreaseFunctionError: on every rank, when the function fails.
        """
        continuing = not self.batch.enter_epoch(epoch)
        self.grower.start_epoch(self.batch, epoch)
        self.mode.start_epoch(dataloader.batch_sampler, self.batch, epoch, self.log)
        if continuing:
            self.log(
                f"Epoch {epoch}: resuming after its step {self.batch.epoch_steps} "
                f"(global step {self.batch.global_step})."
            )
        return self.mode.steps_left(dataloader.batch_sampler, self.batch, len(dataloader), self._max_steps_per_epoch)

    def step(
        self,
        batch: Dict[str, torch.Tensor],
        *,
        forward_backward: Callable,
        optimizer_step: Callable[[float], Any],
        zero_grad: Callable[[], None],
    ) -> StepOutcome:
        """One optimizer step of ``batch``: :meth:`run_step`, the LR set for its batch around
        ``optimizer_step(tokens of all ranks)``, then :meth:`after_optimizer_step`.

        Raises:
            MicroBatchOutOfMemoryError: when one-sample micro-batches run out of memory.
        """
        outcome = self.run_step(forward_backward, batch, zero_grad=zero_grad)
        outcome.lr = self.before_optimizer_step(outcome)
        outcome.grad_norm = optimizer_step(outcome.num_tokens)
        self.after_optimizer_step(outcome)
        outcome.global_step = self.global_step
        return outcome

    def run_step(self, forward_backward: Callable, batch: Dict[str, torch.Tensor], *, zero_grad: Callable[[], None]) -> StepOutcome:
        """Forward and backward of a step's batch in micro-batches of at most the largest that
        fits; one that runs out of memory is rerun in halves (``retry_on_oom``).

        Args:
            forward_backward: one micro-batch's forward and backward; returns its summed loss
                and counted tokens.
            batch: the step's collated batch on the device.
            zero_grad: drops gradients, to restart a step.

        Raises:
            MicroBatchOutOfMemoryError: when one-sample micro-batches run out of memory.
        """
        samples, padded = batch_rows(batch), batch["tokens"].numel()
        if self.lr is not None:
            self.lr.start_step()
        step = accumulate_gradients(
            forward_backward,
            batch,
            micro_batch_limit=self.batch.max_micro_batch_size,
            zero_grad=zero_grad,
            retry_on_oom=self.options.growth.retry_on_oom,
            device=self.device,
            log=self.warn,
            agree_on_oom=self.ranks.any if self.ranks.distributed else None,
            observer=self.grower.gradients,
            min_micro_batches=2 if self.options.noise.noise_scale_split_step else 1,
        )
        global_samples, tokens, padded, loss_sum = self.ranks.sums(samples, step.num_tokens, padded, step.loss_sum)
        interval = self.batch.intervals_done - 1
        noise = self.grower.measure_noise(global_samples)
        return StepOutcome(step, samples, int(global_samples), tokens, padded, loss_sum / tokens, interval, noise)

    def before_optimizer_step(self, step: StepOutcome) -> float:
        """Scales the LR for the step's batch; returns the LR the step uses (NaN when no LR
        was attached)."""
        return float("nan") if self.lr is None else self.lr.before_optimizer_step(step.global_samples, step.num_tokens)

    def after_optimizer_step(self, step: StepOutcome) -> None:
        """Puts the unscaled LR back, advances a step-counted scheduler, counts the step, and
        grows the batch at the steps, samples or tokens boundaries the step reached (the next
        step takes the new batch)."""
        if self.lr is not None:
            self.lr.after_optimizer_step()
        accumulated = step.accumulated
        self.batch.record_step(
            samples=step.samples,
            micro_batch_limit=accumulated.micro_batch_limit,
            oom_retries=accumulated.oom_retries,
            global_samples=step.global_samples,
            tokens=int(step.num_tokens),
        )
        if accumulated.oom_retries:
            self.warn(
                f"Step {self.batch.global_step}: recovered from out of memory in micro-batches "
                f"of {accumulated.micro_batch_sizes}; steps from now on use at most {self.batch.max_micro_batch_size}."
            )
        if self.grower.grow_at_boundaries(self.batch):
            self.mode.resize(self._sampler, self.batch)

    def step_metrics(self, step: StepOutcome, seconds: float) -> Dict[str, float]:
        """The batch's per-step metrics, for the metric logger."""
        world = self.ranks.world_size
        growth = {} if not self.grower.active else {"growth_interval": step.interval}
        noise = {} if step.noise_scale is None else {"gradient_noise_scale": step.noise_scale}
        decay = None if self.lr is None else self.lr.weight_decay
        return {
            **growth,
            **noise,
            **({} if decay is None else {"weight_decay": decay}),
            "batch_size": step.global_samples,
            "micro_batch_size": max(step.accumulated.micro_batch_sizes),
            "grad_accum_steps": len(step.accumulated.micro_batch_sizes),
            "samples_seen": self.batch.global_samples_seen,
            "tokens_seen": self.batch.tokens_seen,
            "oom_retries": step.accumulated.oom_retries,
            "tokens_per_second_per_gpu": step.num_tokens / world / seconds,
            "real_tokens": int(step.num_tokens),
            "padded_tokens": int(step.padded_tokens),
            "padding_fraction": 1 - step.num_tokens / step.padded_tokens,
        }
