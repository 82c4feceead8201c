"""The recipes' adapter over the run's batch decisions: it executes what the session decides.

A recipe builds an :class:`AdaptiveBatchController` in its constructor (every setting is
checked there), hands it the resumed state, lets it :meth:`~AdaptiveBatchController.settle`
the batch (probing if asked), builds its dataloader on
:meth:`~AdaptiveBatchController.batch_sampler`, attaches the LR, and then calls
:meth:`~AdaptiveBatchController.start_epoch` and :meth:`~AdaptiveBatchController.step`
in its loop; ``docs/library.md`` walks through it. Every decision is the
:class:`~adaptive_batch.run.session.BatchSession`'s; the controller owns what runs them: the
batch sampler, the LR in the optimizer, and the step's micro-batches with their out-of-memory
retries.
"""

from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional

import torch

from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.faults import fault_point
import adaptive_batch.logs as logs
from adaptive_batch.memory.device import prepare_allocator, relax_allocator_for_training
from adaptive_batch.run.lr_coupling import LRCoupling
from adaptive_batch.run.options import AdaptiveBatchOptions
from adaptive_batch.run.progress import BatchProgress
from adaptive_batch.run.session import BatchSession, StepRecord
from adaptive_batch.run.step import StepOutcome, accumulate_gradients


class AdaptiveBatchController:
    """Runs a recipe's steps as its :class:`~adaptive_batch.run.session.BatchSession` decides:
    the batch sampler follows the batch, the LR the session's factors
    (:class:`~adaptive_batch.run.lr_coupling.LRCoupling`), and each step runs in the micro-batches
    it splits (:func:`~adaptive_batch.run.step.accumulate_gradients`), retried smaller after an
    out-of-memory error.

    Args:
        options: the settings.
        layout: where a batch's samples lie (any structure; the first dimension by default).
        **session: :class:`~adaptive_batch.run.session.BatchSession`'s keyword arguments
            (``batch_size``, ``device``, ``output_dir``, ``input_key``, ``max_seq_len``, ``ranks``,
            ``log``, ...): every decision is the session's.

    Raises:
        ConfigError: for the first setting, or combination of settings, the run cannot use.
    """

    def __init__(self, options: AdaptiveBatchOptions, *, layout: Optional[BatchLayout] = None, **session: Any) -> None:
        self.session = BatchSession(options, **session)
        self.layout = layout or BatchLayout()
        self.lr: Optional[LRCoupling] = None
        self._sampler: Any = None
        with logs.lines_to(self.log, self.warn):
            prepare_allocator(self.device, probing=options.needs_probe, max_memory=options.probe.max_memory)

    # What the recipes read of the session's decisions.
    options = property(lambda self: self.session.options)
    device = property(lambda self: self.session.device)
    input_key = property(lambda self: self.session.input_key)
    ranks = property(lambda self: self.session.ranks)
    log = property(lambda self: self.session.log)
    warn = property(lambda self: self.session.warn)
    mode = property(lambda self: self.session.mode)
    grower = property(lambda self: self.session.grower)
    batch = property(lambda self: self.session.batch)
    probe_report = property(lambda self: self.session.probe_report)
    global_batch_split = property(lambda self: self.session.global_batch_split)
    global_step = property(lambda self: self.session.global_step)

    def state_dict(self) -> Dict[str, Any]:
        """The session's state (:meth:`BatchSession.state_dict`)."""
        return self.session.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The session's resumed state (:meth:`BatchSession.load_state_dict`)."""
        self.session.load_state_dict(state)

    def settle(self, **settle: Any) -> BatchProgress:
        """The first batch, as :meth:`BatchSession.settle` decides it (its keyword arguments:
        ``dataset_size``, ``max_steps_per_epoch``, ``probe``, ``lengths``); after a probe on a
        soft budget, the allocator trains at full speed (:func:`relax_allocator_for_training`)."""
        progress = self.session.settle(**settle)
        report = self.session.probe_report
        if report is not None and report.budget is not None:
            with logs.lines_to(self.log, self.warn):
                relax_allocator_for_training(self.device, soft_budget=report.budget.is_soft)
        return progress

    def probe_micro_batches(self, micro_batch_size: int) -> int:
        """The micro-batches a probe trial runs (:meth:`BatchSession.probe_micro_batches`)."""
        return self.session.probe_micro_batches(micro_batch_size)

    def track_gradients(self, model: Any, row_tokens: Optional[Callable[[Any], torch.Tensor]] = None) -> None:
        """What ``measure_noise_scale`` reads, set up before :meth:`settle` probes
        (:meth:`Grower.track_gradients <adaptive_batch.run.grower.Grower.track_gradients>`)."""
        self.grower.track_gradients(model, row_tokens)

    def batch_sampler(self, dataset: Any, *, shuffle: bool) -> Any:
        """The batch sampler of this rank's share of ``dataset``, following the batch."""
        self._sampler = self.mode.batch_sampler(dataset, self.batch, self.ranks, shuffle)
        return self._sampler

    def collate(self, collate_fn: Callable) -> Callable:
        """``collate_fn`` as the batches need it (truncated to the token budget)."""
        return self.mode.collate(collate_fn)

    def lr_schedule_steps(self, epochs: int, num_batches: int) -> float:
        """``num_training_steps`` for the LR scheduler, given the first epoch's batches."""
        return self.session.lr_schedule_steps(epochs, num_batches)

    def lr_last_epoch(self) -> int:
        """``last_epoch`` for the LR scheduler."""
        return self.session.lr_last_epoch()

    def attach_lr(self, optimizer: Any, lr_scheduler: Any, read_lr: Callable[[], float]) -> None:
        """Couples the LR to the batch (:class:`~adaptive_batch.run.lr_coupling.LRCoupling`).

        Raises:
            ConfigError: for a scheduler that cannot be counted in samples.
        """
        self.lr = LRCoupling(
            self.session.lr_rule, optimizer=optimizer, lr_scheduler=lr_scheduler, read_lr=read_lr,
            batch=self.batch, count_in_samples=self.mode.counts_lr_in_samples,
        )

    def start_epoch(self, epoch: int, dataloader: Any) -> int:
        """Starts or continues ``epoch`` (growth at its boundary); returns its steps left.

        Raises:
            BatchIncreaseFunctionError: on every rank, when the function fails.
        """
        start = self.session.begin_epoch(epoch)
        with logs.lines_to(self.log, self.warn):
            self.mode.start_epoch(dataloader.batch_sampler, self.batch, epoch)
            if start.resumed_after_step is not None:
                logs.info(
                    f"Epoch {epoch}: resuming after its step {start.resumed_after_step} "
                    f"(global step {self.batch.global_step})."
                )
        return self.session.steps_left(len(dataloader))

    def step(
        self,
        batch: Any,
        *,
        forward_backward: Callable,
        optimizer_step: Callable[[float], Any],
        zero_grad: Callable[[], None],
    ) -> StepOutcome:
        """One optimizer step of ``batch``: forward and backward in the micro-batches the session
        splits, rerun in halves after an out-of-memory error (``retry_on_oom``); the LR set to the
        session's factors around ``optimizer_step(tokens of all ranks)``, which returns the
        gradient norm or ``None``; then the step recorded, and the sampler resized when growth
        moved the batch.

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
        split = self.session.split_step(samples)
        with logs.lines_to(self.log, self.warn):
            accumulated = accumulate_gradients(
                forward_backward, batch, rows=samples, micro_batch_limit=split.micro_batch_limit,
                zero_grad=zero_grad, retry_on_oom=self.session.retries_oom, device=self.device,
                agree_on_oom=self.ranks.any if self.ranks.distributed else None, observer=self.grower.gradients,
                min_micro_batches=split.min_micro_batches, layout=self.layout,
            )
        global_samples, tokens, padded, loss_sum = self.ranks.sums(samples, accumulated.num_tokens, padded, accumulated.loss_sum)
        outcome = StepOutcome(
            accumulated, samples, int(global_samples), tokens, padded, loss_sum / tokens,
            interval=self.batch.intervals_done - 1, noise_scale=self.grower.measure_noise(global_samples),
        )
        if self.lr is not None:
            scaling = self.session.scaling(global_samples=outcome.global_samples, tokens=outcome.num_tokens)
            outcome.lr = self.lr.before_optimizer_step(scaling)
        fault_point("inside_step")
        outcome.grad_norm = optimizer_step(outcome.num_tokens)
        if self.lr is not None:
            self.lr.after_optimizer_step()
        resize = self.session.record_step(StepRecord(
            samples, outcome.global_samples, int(outcome.num_tokens), accumulated.micro_batch_limit,
            accumulated.oom_retries, tuple(accumulated.micro_batch_sizes),
        ))
        if resize is not None:
            self.mode.resize(self._sampler, self.batch)
        outcome.global_step = self.global_step
        return outcome

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

