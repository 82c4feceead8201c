"""The adaptive-batch decisions of a training run, behind a handful of calls a recipe makes.

A recipe builds an :class:`AdaptiveBatchController` in its constructor (every setting is
checked there), hands it the resumed state, lets it :meth:`~AdaptiveBatchController.settle`
the batch (probing if asked), builds its dataloader on
:meth:`~AdaptiveBatchController.batch_sampler`, attaches the LR, and then calls
:meth:`~AdaptiveBatchController.start_epoch` and :meth:`~AdaptiveBatchController.step`
in its loop; ``docs/library.md`` walks through it.
"""

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional

import torch

from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.data.samplers import BATCH_STATE_KEY, BatchState
from adaptive_batch.distributed import RankGroup
from adaptive_batch.faults import fault_point
from adaptive_batch.memory.device import prepare_allocator
from adaptive_batch.errors import ConfigError
from adaptive_batch.probe.report import PROBE_STATE_KEY, ProbeReport
from adaptive_batch.probe.service import save_probe_report
from adaptive_batch.run.batching import SampleBatches, TokenBatches
from adaptive_batch.run.grower import Grower
from adaptive_batch.run.lr_coupling import LRCoupling
from adaptive_batch.run.options import AdaptiveBatchOptions, RunContext
from adaptive_batch.run.start import first_batch
from adaptive_batch.run.step import StepOutcome, accumulate_gradients
from adaptive_batch.schedule.global_batch import MicroBatchPlan, micro_batches_per_trial
from adaptive_batch.schedule.noise_scale import NOISE_SCALE_STATE_KEY
from adaptive_batch.validation import check_positive_int

Probe = Callable[..., ProbeReport]


class AdaptiveBatchController:
    """A facade over the parts of a run's batch: the start (:mod:`~adaptive_batch.run.start`),
    growth (:class:`~adaptive_batch.run.grower.Grower`), LR coupling
    (:class:`~adaptive_batch.run.lr_coupling.LRCoupling`), steps in micro-batches
    (:func:`~adaptive_batch.run.step.accumulate_gradients`) and the batch state.

    Args:
        options: the settings.
        batch_size: the configured batch (per rank): the starting batch with growth, the
            batch without growth and probing.
        input_key: the collated batch's ``[samples, sequence]`` tensor the model reads
            (torchtune: ``"tokens"``; Hugging Face: ``"input_ids"``): its elements are the
            padded tokens (none are counted where the batch holds no such key).
        gradient_accumulation_steps: micro-batches a configured step has.
        device: where training runs.
        output_dir: where the probe report goes.
        max_seq_len: the tokenizer's longest sequence (what the probe's rows hold).
        packed: whether the dataset is packed.
        optimizer_in_bwd: whether the optimizer steps inside backward.
        ranks: the data-parallel ranks (this process alone when ``None``).
        log: where decisions are reported.
        warn: where recoveries are reported (``log`` when ``None``).
        layout: where a batch's samples lie (any structure; the first dimension by default).

    Raises:
        ConfigError: for the first setting, or combination of settings, the run cannot use.
    """

    def __init__(
        self,
        options: AdaptiveBatchOptions,
        *,
        batch_size: int,
        input_key: Optional[str],
        gradient_accumulation_steps: int = 1,
        device: torch.device,
        output_dir: str,
        max_seq_len: Optional[int] = None,
        packed: bool = False,
        optimizer_in_bwd: bool = False,
        ranks: Optional[RankGroup] = None,
        log: Callable[[str], None] = print,
        warn: Optional[Callable[[str], None]] = None,
        layout: Optional[BatchLayout] = None,
    ) -> None:
        check_positive_int("batch_size", batch_size)
        check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        self.options, self.device, self.ranks = options, device, ranks or RankGroup(device)
        self.output_dir, self.max_seq_len, self.input_key = output_dir, max_seq_len, input_key
        self.log, self.warn, self.layout = log, warn or log, layout or BatchLayout()
        self._batch_size, self._accumulation = batch_size, gradient_accumulation_steps
        self._retry_on_oom = options.growth.retries_oom(optimizer_in_bwd)
        options.validate(RunContext(device, gradient_accumulation_steps, packed, optimizer_in_bwd,
                                    self.ranks.world_size, max_seq_len))
        self.mode = (
            TokenBatches(options.tokens, options.probe.max_batch_size, input_key)
            if options.tokens.max_tokens is not None
            else SampleBatches()
        )
        self.grower = Grower(options.growth, options.noise, ranks=self.ranks, log=self.log, warn=self.warn)
        self.lr: Optional[LRCoupling] = None
        self.micro_batch_plan: Optional[MicroBatchPlan] = None
        self.probe_report: Optional[ProbeReport] = None
        self._probe_again = False
        self.batch: Optional[BatchState] = None
        self._batch_state: Optional[Dict[str, Any]] = None
        self._max_steps_per_epoch: Optional[int] = None
        self.dataset_size: Optional[int] = None  # one rank's samples, once settled
        self._sampler: Any = None
        prepare_allocator(device, probing=options.needs_probe, log=self.log, warn=self.warn)

    @property
    def global_step(self) -> int:
        return 0 if self.batch is None else self.batch.global_step

    def state_dict(self) -> Dict[str, Any]:
        """The batch state, the probe result and the noise scale, under their recipe-state keys."""
        state: Dict[str, Any] = {BATCH_STATE_KEY: self.batch.state_dict()}
        if self.probe_report is not None:
            state[PROBE_STATE_KEY] = self.probe_report.to_dict()
        if self.grower.noise_scale is not None:
            state[NOISE_SCALE_STATE_KEY] = self.grower.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Takes a resumed run's probe result and batch state from the recipe state (other
        keys are ignored); the batch state applies once :meth:`settle` has built the batch.

        Raises:
            ConfigError: for a probe result this version cannot read (a newer format).
        """
        self.probe_report = None if state.get(PROBE_STATE_KEY) is None else _resumed_report(state[PROBE_STATE_KEY])
        self._batch_state = state.get(BATCH_STATE_KEY)
        self.grower.load_state_dict(state.get(NOISE_SCALE_STATE_KEY))
        if self.batch is not None and self._batch_state is not None:
            self.batch.load_state_dict(self._batch_state)

    def probe_again(self) -> None:
        """Drops the resumed probe result, so that :meth:`settle` probes the micro-batch anew
        and keeps it over the resumed batch state's (a changed budget, a fixed global batch)."""
        self.probe_report = None
        self._probe_again = True

    def settle(
        self,
        *,
        dataset_size: int,
        max_steps_per_epoch: Optional[int] = None,
        probe: Optional[Probe] = None,
        lengths: Optional[List[int]] = None,
    ) -> BatchState:
        """Decides the first batch and the largest micro-batch (:mod:`~adaptive_batch.run.start`),
        probing if needed, and writes the probe report once.

        Args:
            dataset_size: the samples of one rank.
            max_steps_per_epoch: torchtune's cap on an epoch's steps, or ``None``.
            probe: ``probe(options, dataset_size=, ranks=, output_dir=, log=, save_report=False)``
                (a partial of :func:`probe_batch_size` with its target), when probing.
            lengths: every sample's length in tokens (token-budget batches only).

        Raises:
            ConfigError: for a token budget the samples cannot use.
            BatchSizeTooLargeError: when probing finds that batch 1 does not fit.
        """
        self._max_steps_per_epoch, self.dataset_size = max_steps_per_epoch, dataset_size
        options = self.options
        probed = False
        if self.probe_report is not None:
            self.log(f"Resumed run: using the probed batch_size={self.probe_report.batch_size} from the recipe state.")
        elif options.needs_probe:
            if not options.probe.use_maximum_batch_size:
                self.log(
                    "batch_increase_function without max_batch_size: probing for the largest batch "
                    "that fits, as the bound of the growth."
                )
            if probe is None:
                raise ValueError("settle() needs probe= to find the largest batch that fits.")
            self.probe_report = probe(
                options.probe, dataset_size=dataset_size, ranks=self.ranks, output_dir=self.output_dir, log=self.log,
                save_report=False,
            )
            probed = True
        report = self.probe_report
        changed = report is not None and self.mode.adopt_probe(report, self.max_seq_len, self.log)
        self.mode.prepare(lengths, self.log)
        start, micro, self.micro_batch_plan = first_batch(
            options, batch_size=self._batch_size, gradient_accumulation_steps=self._accumulation,
            world_size=self.ranks.world_size, dataset_size=dataset_size, report=report, log=self.log, warn=self.warn,
        )
        if report is not None and self.micro_batch_plan is not None:
            report.global_batch, changed = self.micro_batch_plan.to_dict(), True
        if probed or changed:
            save_probe_report(report, self.output_dir, self.ranks, plot=options.probe.plot, log=self.log)
        self.batch = BatchState(
            batch_size=start,
            max_micro_batch_size=self.mode.max_micro_batch_size(micro, dataset_size),
            # A global batch runs in accumulated micro-batches, and grows the same way.
            grow_with_accumulation=options.growth.grow_with_accumulation or self.micro_batch_plan is not None,
            samples_per_epoch=self.mode.samples_per_epoch(dataset_size, start, max_steps_per_epoch),
        )
        if self._batch_state is not None:
            probed_micro = self.batch.max_micro_batch_size
            self.batch.load_state_dict(self._batch_state)
            if self._probe_again:
                self.batch.max_micro_batch_size = probed_micro
            self.log(f"Resumed run: batch state from the recipe state: {self.batch.state_dict()}")
        return self.batch

    def probe_micro_batches(self, micro_batch_size: int) -> int:
        """How many micro-batches a probe trial at ``micro_batch_size`` runs before its optimizer
        step (:func:`~adaptive_batch.schedule.global_batch.micro_batches_per_trial`)."""
        return micro_batches_per_trial(
            micro_batch_size, gradient_accumulation_steps=self._accumulation,
            global_batch_size=self.options.global_batch.global_batch_size, world_size=self.ranks.world_size,
            grow_with_accumulation=self.options.growth.grow_with_accumulation,
        )

    def track_gradients(self, params: Any) -> None:
        """Allocates ``measure_noise_scale``'s gradient copy before :meth:`settle` probes."""
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

    def start_epoch(self, epoch: int, dataloader: Any) -> int:
        """Starts or continues ``epoch`` (growth at its boundary); returns its steps left.

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
        batch: Any,
        *,
        forward_backward: Callable,
        optimizer_step: Callable[[float], Any],
        zero_grad: Callable[[], None],
    ) -> StepOutcome:
        """One optimizer step of ``batch``: forward and backward in micro-batches that fit,
        rerun in halves after an out-of-memory error (``retry_on_oom``); the LR scaled for the
        step's batch around ``optimizer_step(tokens of all ranks)``, which returns the gradient
        norm or ``None``; then the step counted and the batch grown at the boundaries it reached.

        Args:
            batch: the step's collated batch on the device, of any structure (``layout``).
            forward_backward: one micro-batch's forward and backward; returns its summed loss
                and its tokens that carry a loss.
            optimizer_step: scales the gradients by the tokens, steps and zeroes them.
            zero_grad: drops the gradients, to restart a step.

        Raises:
            MicroBatchOutOfMemoryError: when one-sample micro-batches run out of memory.
        """
        samples = self.layout.rows(batch)
        inputs = batch.get(self.input_key) if isinstance(batch, Mapping) else None
        padded = inputs.numel() if isinstance(inputs, torch.Tensor) else 0
        if self.lr is not None:
            self.lr.start_step()
        accumulated = accumulate_gradients(
            forward_backward, batch, rows=samples, micro_batch_limit=self.batch.max_micro_batch_size,
            zero_grad=zero_grad, retry_on_oom=self._retry_on_oom, device=self.device, log=self.warn,
            agree_on_oom=self.ranks.any if self.ranks.distributed else None, observer=self.grower.gradients,
            min_micro_batches=2 if self.options.noise.noise_scale_split_step else 1, layout=self.layout,
        )
        global_samples, tokens, padded, loss_sum = self.ranks.sums(samples, accumulated.num_tokens, padded, accumulated.loss_sum)
        outcome = StepOutcome(
            accumulated, samples, int(global_samples), tokens, padded, loss_sum / tokens,
            interval=self.batch.intervals_done - 1, noise_scale=self.grower.measure_noise(global_samples),
        )
        if self.lr is not None:
            outcome.lr = self.lr.before_optimizer_step(outcome.global_samples, outcome.num_tokens)
        fault_point("inside_step")
        outcome.grad_norm = optimizer_step(outcome.num_tokens)
        if self.lr is not None:
            self.lr.after_optimizer_step()
        self._count(outcome)
        outcome.global_step = self.global_step
        return outcome

    def _count(self, step: StepOutcome) -> None:
        """Records the step in the batch state and grows the batch at the boundaries it reached."""
        accumulated = step.accumulated
        self.batch.record_step(
            samples=step.samples, micro_batch_limit=accumulated.micro_batch_limit, oom_retries=accumulated.oom_retries,
            global_samples=step.global_samples, tokens=int(step.num_tokens),
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
        growth = {} if not self.grower.active else {"growth_interval": step.interval}
        noise = {} if step.noise_scale is None else {"gradient_noise_scale": step.noise_scale}
        decay = None if self.lr is None else self.lr.weight_decay
        return {
            **growth,
            **noise,
            **({} if decay is None else {"weight_decay": decay}),
            **step.metrics(
                samples_seen=self.batch.global_samples_seen, tokens_seen=self.batch.tokens_seen,
                world_size=self.ranks.world_size, seconds=seconds,
            ),
        }


def _resumed_report(data: Any) -> ProbeReport:
    """The recipe state's probe result (any format this version reads).

    Raises:
        ConfigError: when it does not read.
    """
    if isinstance(data, ProbeReport):
        return data
    try:
        return ProbeReport.from_dict(data)
    except ValueError as e:
        raise ConfigError(
            f"the recipe state's {PROBE_STATE_KEY!r} does not read ({e}): resume with the adaptive-batch that wrote it, "
            "or start afresh without resume_from_checkpoint."
        ) from None
