"""The run's batch decisions, framework-neutral: told of each event, it answers what to do.

A :class:`BatchSession` decides and executes nothing: no sampler, optimizer or model passes
through it. Whatever runs the steps (the :class:`~adaptive_batch.run.controller.AdaptiveBatchController`
of the recipes and :class:`~adaptive_batch.AdaptiveBatch`, or a framework's own loop) tells it
of each event and applies the answer::

    session.settle(dataset_size=n)                   # the first batch, probing through a callable
    for epoch in range(epochs):
        start = session.begin_epoch(epoch)           # growth at the boundary: start.batch_size
        for _ in range(session.steps_left(len(dataloader))):
            sizes = session.split_step(rows).micro_batch_sizes
            ...                                      # forward and backward in those micro-batches
            scaling = session.scaling(global_samples=s, tokens=t)   # the LR and weight-decay factors
            ...                                      # the optimizer step
            resize = session.record_step(StepRecord(...))           # the next batch, when growth moved it

Its state (:meth:`state_dict`) is the batch state, the probe result and the noise scale;
:class:`~adaptive_batch.run.state.RunState` adds the settings' fingerprint.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.probe.report import PROBE_STATE_KEY, ProbeReport
from adaptive_batch.probe.service import save_probe_report
from adaptive_batch.run.batching import SampleBatches, TokenBatches
from adaptive_batch.run.grower import Grower
from adaptive_batch.run.options import AdaptiveBatchOptions, RunContext
from adaptive_batch.run.progress import BATCH_STATE_KEY, BatchProgress
from adaptive_batch.run.start import first_batch
from adaptive_batch.schedule.global_batch import micro_batch_sizes
from adaptive_batch.schedule.global_batch import GlobalBatchSplit, micro_batches_per_trial
from adaptive_batch.schedule.lr_scaling import BatchScaling, LRRule
from adaptive_batch.schedule.noise_scale import NOISE_SCALE_STATE_KEY
from adaptive_batch.validation import check_positive_int

Probe = Callable[..., ProbeReport]


@dataclass(frozen=True)
class EpochStart:
    """What an epoch begins with, growth at its boundary applied.

    Attributes:
        epoch: the epoch (0-based).
        batch_size: this rank's samples a step (sample batches; a token budget packs its own).
        micro_batch_size: the largest micro-batch of a full step.
        micro_batches: the micro-batches of a full step.
        resumed_after_step: the epoch's steps already run, for a run resumed inside it
            (``None`` for an epoch that begins).
    """

    epoch: int
    batch_size: int
    micro_batch_size: int
    micro_batches: int
    resumed_after_step: Optional[int] = None


@dataclass(frozen=True)
class StepSplit:
    """How a step's rows run: micro-batches of at most ``micro_batch_limit``, as equal as can be,
    and at least ``min_micro_batches`` of them where there are rows enough."""

    micro_batch_sizes: Tuple[int, ...]
    micro_batch_limit: int
    min_micro_batches: int = 1


@dataclass(frozen=True)
class StepRecord:
    """What a step ran, as the session counts it.

    Attributes:
        samples: this rank's samples.
        global_samples: all ranks' samples.
        tokens: all ranks' tokens that carry a loss.
        micro_batch_limit: the limit the step ended with (lower after an out-of-memory retry).
        oom_retries: restarts the step needed.
        micro_batch_sizes: the sizes that finally ran (for the log).
    """

    samples: int
    global_samples: int
    tokens: int
    micro_batch_limit: int
    oom_retries: int = 0
    micro_batch_sizes: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Resize:
    """Growth moved the batch at the end of a step: the next step takes ``batch_size``."""

    previous: int
    batch_size: int


class BatchSession:
    """The batch decisions of one run: the start, growth, micro-batches, LR factors and counting.

    Args:
        options: the settings.
        batch_size: the configured batch (per rank): the starting batch with growth, the
            batch without growth and probing.
        device: where training runs (some settings are for CUDA or CPU only).
        output_dir: where the probe report goes.
        gradient_accumulation_steps: micro-batches a configured step has.
        input_key: the collated batch's ``[samples, sequence]`` tensor the model reads
            (torchtune: ``"tokens"``; Hugging Face: ``"input_ids"``): its padded tokens are
            counted, and a token budget truncates it.
        max_seq_len: the tokenizer's longest sequence (what the probe's rows hold).
        packed: whether the dataset is packed.
        optimizer_in_bwd: whether the optimizer steps inside backward.
        ranks: the data-parallel ranks (this process alone when ``None``).
        log: where decisions are reported (``None``: the ``adaptive_batch`` logger).
        warn: where recoveries are reported (``log`` when ``None``, else the logger's warnings).

    Attributes:
        log: the ``log`` given (``None`` for the logger), kept for the methods that say lines
            (:func:`~adaptive_batch.logs.lines_to`).
        warn: the ``warn`` given.

    Raises:
        ConfigError: for the first setting, or combination of settings, the run cannot use.
    """

    def __init__(
        self,
        options: AdaptiveBatchOptions,
        *,
        batch_size: int,
        device: torch.device,
        output_dir: str,
        gradient_accumulation_steps: int = 1,
        input_key: Optional[str] = None,
        max_seq_len: Optional[int] = None,
        packed: bool = False,
        optimizer_in_bwd: bool = False,
        ranks: Optional[RankGroup] = None,
        log: Optional[Callable[[str], None]] = None,
        warn: Optional[Callable[[str], None]] = None,
    ) -> None:
        check_positive_int("batch_size", batch_size)
        check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        self.options, self.device, self.ranks = options, device, ranks or RankGroup(device)
        self.output_dir, self.max_seq_len, self.input_key = output_dir, max_seq_len, input_key
        # A step split after an out-of-memory error, unless the optimizer steps inside backward.
        self.retries_oom = options.growth.retries_oom(optimizer_in_bwd)
        self.log, self.warn = log, warn
        self._batch_size, self._accumulation = batch_size, gradient_accumulation_steps
        options.validate(RunContext(device, gradient_accumulation_steps, packed, optimizer_in_bwd,
                                    self.ranks.world_size, max_seq_len))
        self.mode = (
            TokenBatches(options.tokens, options.probe.max_batch_size, input_key)
            if options.tokens.max_tokens is not None
            else SampleBatches()
        )
        self.grower = Grower(options.growth, options.noise, ranks=self.ranks)
        self.global_batch_split: Optional[GlobalBatchSplit] = None
        self.probe_report: Optional[ProbeReport] = None
        self._probe_again = False
        self.batch: Optional[BatchProgress] = None
        self._batch_state: Optional[Dict[str, Any]] = None
        self._max_steps_per_epoch: Optional[int] = None
        self.dataset_size: Optional[int] = None  # one rank's samples, once settled
        self._lr_rule: Optional[LRRule] = None

    @property
    def global_step(self) -> int:
        return 0 if self.batch is None else self.batch.global_step

    # ---------------------------------------------------------------- state
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

    # ---------------------------------------------------------------- the run begins
    def settle(
        self,
        *,
        dataset_size: int,
        max_steps_per_epoch: Optional[int] = None,
        probe: Optional[Probe] = None,
        lengths: Optional[List[int]] = None,
    ) -> BatchProgress:
        """Decides the first batch and the largest micro-batch (:mod:`~adaptive_batch.run.start`),
        probing if needed, and writes the probe report once.

        Args:
            dataset_size: the samples of one rank.
            max_steps_per_epoch: torchtune's cap on an epoch's steps, or ``None``.
            probe: ``probe(options, dataset_size=, ranks=, output_dir=, save_report=False)``
                (a partial of :func:`probe_batch_size` with its target), when probing; its lines
                go where the session's do.
            lengths: every sample's length in tokens (token-budget batches only).

        Raises:
            ConfigError: for a token budget the samples cannot use.
            BatchSizeTooLargeError: when probing finds that batch 1 does not fit.
            ValueError: when a probe is needed and ``probe`` is ``None``.
        """
        with logs.lines_to(self.log, self.warn):
            self._max_steps_per_epoch, self.dataset_size = max_steps_per_epoch, dataset_size
            probed = self._probe_if_needed(dataset_size, probe)
            report, options = self.probe_report, self.options
            changed = report is not None and self.mode.adopt_probe(report, self.max_seq_len)
            self.mode.prepare(lengths)
            start, micro, self.global_batch_split = first_batch(
                options, batch_size=self._batch_size, gradient_accumulation_steps=self._accumulation,
                world_size=self.ranks.world_size, dataset_size=dataset_size, report=report,
                resuming=self._batch_state is not None,
            )
            split = self.global_batch_split
            configured = split.per_rank if split is not None else self._batch_size * self._accumulation
            self._lr_rule = LRRule.of(options.lr_scaling, configured)
            if report is not None and self.global_batch_split is not None:
                report.global_batch, changed = self.global_batch_split.to_dict(), True
            if probed or changed:
                save_probe_report(report, self.output_dir, self.ranks, plot=options.probe.plot)
            self.batch = BatchProgress(
                batch_size=start,
                max_micro_batch_size=self.mode.max_micro_batch_size(micro, dataset_size),
                # A global batch runs in accumulated micro-batches, and grows the same way.
                grow_with_accumulation=options.growth.grow_with_accumulation or self.global_batch_split is not None,
                samples_per_epoch=self.mode.samples_per_epoch(dataset_size, start, max_steps_per_epoch),
            )
            if self._batch_state is not None:
                probed_micro = self.batch.max_micro_batch_size
                self.batch.load_state_dict(self._batch_state)
                if self._probe_again:
                    self.batch.max_micro_batch_size = probed_micro
                logs.info(f"Resumed run: batch state from the recipe state: {self.batch.state_dict()}")
            return self.batch

    def _probe_if_needed(self, dataset_size: int, probe: Optional[Probe]) -> bool:
        """Probes unless a resumed result stands or nothing needs one; whether it probed."""
        options = self.options
        if self.probe_report is not None:
            logs.info(f"Resumed run: using the probed batch_size={self.probe_report.batch_size} from the recipe state.")
            return False
        if not options.needs_probe:
            return False
        if not options.probe.use_maximum_batch_size:
            logs.info(
                "batch_increase_function without max_batch_size: probing for the largest batch "
                "that fits, as the bound of the growth."
            )
        if probe is None:
            raise ValueError("settle() needs probe= to find the largest batch that fits.")
        self.probe_report = probe(
            options.probe, dataset_size=dataset_size, ranks=self.ranks, output_dir=self.output_dir, save_report=False,
            held=tuple(self.grower.held_tensors()), trial_fields=self._trial_fields(),
        )
        return True

    def _trial_fields(self) -> Dict[str, Any]:
        """What the settings add to a trial's memory beside the step the caller names (the probe
        cache's key): the micro-batches it runs and how the noise scale is measured. An answer
        cached without the noise scale once came back beside it, and one with it 17% small."""
        noise = self.options.noise
        return dict(gradient_accumulation_steps=self._accumulation,
                    global_batch_size=self.options.global_batch.global_batch_size,
                    grow_with_accumulation=self.options.growth.grow_with_accumulation,
                    measure_noise_scale=noise.measure_noise_scale, noise_scale_estimator=noise.noise_scale_estimator,
                    noise_scale_split_step=noise.noise_scale_split_step)

    def probe_micro_batches(self, micro_batch_size: int) -> int:
        """How many micro-batches a probe trial at ``micro_batch_size`` runs before its optimizer
        step (:func:`~adaptive_batch.schedule.global_batch.micro_batches_per_trial`)."""
        return micro_batches_per_trial(
            micro_batch_size, gradient_accumulation_steps=self._accumulation,
            global_batch_size=self.options.global_batch.global_batch_size, world_size=self.ranks.world_size,
            grow_with_accumulation=self.options.growth.grow_with_accumulation,
        )

    @property
    def lr_rule(self) -> LRRule:
        """The LR rule with its reference: ``lr_scaling_reference``, or the per-rank batch the
        config's LR was set for (the global batch's share, or the configured step); decided once
        by :meth:`settle`, read every step.

        Raises:
            RuntimeError: before :meth:`settle`, when the reference is not yet known.
        """
        if self._lr_rule is None:
            raise RuntimeError("the LR rule is decided by settle(): call it first.")
        return self._lr_rule

    def lr_schedule_steps(self, epochs: int, num_batches: int) -> float:
        """``num_training_steps`` for an LR scheduler, given the first epoch's batches."""
        steps = self.mode.steps_per_epoch(num_batches, self._max_steps_per_epoch)
        return self.mode.lr_schedule_steps(epochs, self.batch, steps)

    def lr_last_epoch(self) -> int:
        """``last_epoch`` for an LR scheduler."""
        return self.mode.lr_last_epoch(self.global_step)

    # ---------------------------------------------------------------- events
    def begin_epoch(self, epoch: int) -> EpochStart:
        """Starts or continues ``epoch``, with growth at its boundary (or at the boundaries an
        interval reached).

        Raises:
            BatchIncreaseFunctionError: on every rank, when the function fails.
        """
        batch = self.batch
        continuing = not batch.enter_epoch(epoch)
        with logs.lines_to(self.log, self.warn):
            self.grower.start_epoch(batch, epoch)
        return EpochStart(
            epoch, batch.batch_size, batch.micro_batch_size, batch.grad_accum_steps,
            resumed_after_step=batch.epoch_steps if continuing else None,
        )

    def steps_left(self, num_batches: int) -> int:
        """The epoch's steps after those already run, at the current batch: what this rank's
        sampler yields, counted from ``settle``'s ``dataset_size`` (this rank's share, as the
        sampler has it). ``num_batches`` is the whole epoch's, as a token budget's sampler counts
        it once the epoch is set (sample batches do not read it)."""
        batch = self.batch
        if not self.mode.uses_token_budget:
            samples = min(batch.samples_per_epoch, self.dataset_size)
            return -(-(samples - batch.epoch_samples) // batch.batch_size)
        return self.mode.steps_per_epoch(num_batches, self._max_steps_per_epoch) - batch.epoch_steps

    def split_step(self, rows: int) -> StepSplit:
        """The micro-batches of a step of ``rows`` samples: the fewest that fit (two or more with
        ``noise_scale_split_step``)."""
        limit = self.batch.max_micro_batch_size
        least = 2 if self.options.noise.noise_scale_split_step else 1
        return StepSplit(tuple(micro_batch_sizes(rows, limit, least)), limit, least)

    def scaling(self, *, global_samples: float, tokens: float) -> BatchScaling:
        """The LR and weight-decay factors of a step of ``global_samples`` samples and
        ``tokens`` loss-carrying tokens over all ranks; across ranks a rank's mean share is the
        batch, so every rank takes the same LR."""
        world = self.ranks.world_size
        rule = self.lr_rule
        if not rule.scales:
            return BatchScaling()
        return rule.factors(samples=global_samples / world, tokens=int(tokens / world))

    def record_step(self, step: StepRecord) -> Optional[Resize]:
        """Counts a step, keeps a limit an out-of-memory retry lowered, and grows the batch at
        the boundaries the step reached; the new batch when it changed."""
        with logs.lines_to(self.log, self.warn):
            batch = self.batch
            previous = batch.batch_size
            batch.record_step(
                samples=step.samples, micro_batch_limit=step.micro_batch_limit, oom_retries=step.oom_retries,
                global_samples=step.global_samples, tokens=int(step.tokens),
            )
            if step.oom_retries:
                logs.warning(
                    f"Step {batch.global_step}: recovered from out of memory in micro-batches "
                    f"of {list(step.micro_batch_sizes)}; steps from now on use at most {batch.max_micro_batch_size}."
                )
            # A boundary held at the bound (clamped) leaves the batch as it was: no resize.
            if self.grower.grow_at_boundaries(batch) and batch.batch_size != previous:
                return Resize(previous, batch.batch_size)
            return None


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
