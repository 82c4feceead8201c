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

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, FrozenSet, List, Optional

import torch

from adaptive_batch.data.samplers import BATCH_STATE_KEY, BatchState
from adaptive_batch.data.token_budget import TokenBatchOptions
from adaptive_batch.distributed import RankGroup, per_rank_increase
from adaptive_batch.errors import BatchIncreaseFunctionError, ConfigError
from adaptive_batch.memory.device import (
    address_space_limit,
    device_capacity,
    return_freed_memory_to_os,
    use_expandable_segments,
)
from adaptive_batch.probe.cache import default_cache_dir
from adaptive_batch.probe.search import round_batch_size
from adaptive_batch.probe.service import ProbeOptions, save_probe_report
from adaptive_batch.probe.trials import PROBE_STATE_KEY
from adaptive_batch.run.batching import SampleBatches, TokenBatches
from adaptive_batch.run.step import AccumulatedStep, accumulate_gradients, batch_rows
from adaptive_batch.schedule.global_batch import (
    KEY as GLOBAL_KEY,
)
from adaptive_batch.schedule.global_batch import (
    GlobalBatchOptions,
    MicroBatchPlan,
    check_global_batch,
    fastest_split,
    split_global_batch,
)
from adaptive_batch.schedule.growth import KEY as GROWTH_KEY
from adaptive_batch.schedule.growth import GrowthOptions, GrowthStatistics, function_name
from adaptive_batch.schedule.lr_progress import SampleProgressLR
from adaptive_batch.schedule.lr_scaling import BatchLRScaler, LRScalingOptions
from adaptive_batch.schedule.noise_scale import (
    NOISE_SCALE_STATE_KEY,
    GradientNoiseScale,
    MicroBatchGradients,
    NoiseScaleOptions,
    estimate_noise,
)
from adaptive_batch.validation import check_positive_int

Probe = Callable[..., Dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class AdaptiveBatchOptions:
    """Every adaptive-batch setting, one section per owner; each section checks itself.

    Attributes:
        probe: finding the largest batch before training.
        growth: growing the batch during training.
        tokens: token-budget batches.
        lr_scaling: the LR following the batch.
        global_batch: a fixed global batch with probed micro-batches.
        noise: measuring the gradient noise scale.
    """

    probe: ProbeOptions = field(default_factory=ProbeOptions)
    growth: GrowthOptions = field(default_factory=GrowthOptions)
    global_batch: GlobalBatchOptions = field(default_factory=GlobalBatchOptions)
    noise: NoiseScaleOptions = field(default_factory=NoiseScaleOptions)
    tokens: TokenBatchOptions = field(default_factory=TokenBatchOptions)
    lr_scaling: LRScalingOptions = field(default_factory=LRScalingOptions)

    @classmethod
    def keys(cls) -> FrozenSet[str]:
        """The flat setting names (the config keys), from the sections' fields."""
        return frozenset(f.name for section in fields(cls) for f in fields(section.default_factory))

    @classmethod
    def from_flat(cls, values: Dict[str, Any]) -> "AdaptiveBatchOptions":
        """Builds the sections from flat ``key: value`` settings; missing keys keep defaults.

        Raises:
            ConfigError: for a bad value, or a key no section has.
        """
        unknown = set(values) - cls.keys()
        if unknown:
            raise ConfigError(f"unknown adaptive-batch setting {sorted(unknown)[0]!r}; known: {sorted(cls.keys())}")
        sections = {}
        for section in fields(cls):
            names = {f.name for f in fields(section.default_factory)}
            sections[section.name] = section.default_factory(**{k: v for k, v in values.items() if k in names})
        return cls(**sections)


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
    """

    accumulated: AccumulatedStep
    samples: int
    global_samples: int
    num_tokens: float
    padded_tokens: float
    loss: float
    interval: int = 0
    noise_scale: Optional[float] = None


class AdaptiveBatchController:
    """Owns the batch size of a run: probing, growth, micro-batches, LR coupling, state.

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
        self.options = options
        self.device = device
        self.ranks = ranks or RankGroup(device)
        self.output_dir = output_dir
        self.max_seq_len = max_seq_len
        self.log = log
        self.warn = warn or log
        self._batch_size = batch_size
        self._accumulation = gradient_accumulation_steps
        self._check_combinations(packed=packed, optimizer_in_bwd=optimizer_in_bwd)
        self.micro_batch_plan: Optional[MicroBatchPlan] = None
        self.mode = (
            TokenBatches(options.tokens, options.probe.max_batch_size)
            if options.tokens.max_tokens is not None
            else SampleBatches()
        )
        self.probe_report: Optional[Dict[str, Any]] = None
        self.batch: Optional[BatchState] = None
        self._batch_state: Optional[Dict[str, Any]] = None
        self._max_steps_per_epoch: Optional[int] = None
        self._sampler: Any = None
        # The user's function seen from a rank (global sizes in and out), built once.
        self._growth = per_rank_increase(options.growth.batch_increase_function, self.ranks.world_size)
        self._gradients: Optional[MicroBatchGradients] = None
        self.noise_scale: Optional[GradientNoiseScale] = (
            GradientNoiseScale(options.noise.noise_scale_ema) if options.noise.measure_noise_scale else None
        )
        self._samples_per_token: Optional[float] = None
        self._warned_no_noise = False
        self._lr_progress: Optional[SampleProgressLR] = None
        self._lr_scaler: Optional[BatchLRScaler] = None
        self._lr_scheduler: Any = None
        self._read_lr: Callable[[], float] = lambda: float("nan")
        # Under an address-space limit glibc's cache of freed blocks would count against it.
        if device.type == "cpu" and address_space_limit() is not None:
            return_freed_memory_to_os()
        # Likewise the CUDA allocator's split blocks would make the probed batch fail its second step.
        if device.type == "cuda" and self.needs_probe:
            use_expandable_segments(log=self.log, warn=self.warn)

    def _check_combinations(self, *, packed: bool, optimizer_in_bwd: bool) -> None:
        probe, growth, tokens = self.options.probe, self.options.growth, self.options.tokens
        if self.device.type in ("cpu", "cuda"):
            probe.max_memory_bytes(device_capacity(self.device).headroom_bytes)
        if probe.max_batch_size is not None and tokens.min_batch_size > probe.max_batch_size:
            raise ConfigError(
                f"min_batch_size={tokens.min_batch_size} is larger than max_batch_size={probe.max_batch_size}: "
                "lower min_batch_size or raise max_batch_size."
            )
        if tokens.max_tokens is not None and packed:
            raise ConfigError(
                f"max_tokens={tokens.max_tokens} with dataset.packed=True: packed samples are already "
                "max_seq_len tokens each; set dataset.packed=False or max_tokens=null."
            )
        if tokens.max_tokens is not None and self._accumulation != 1:
            raise ConfigError(
                f"gradient_accumulation_steps={self._accumulation} with max_tokens={tokens.max_tokens}: "
                "a token batch is one optimizer step (split into micro-batches only if it runs out "
                "of memory); set gradient_accumulation_steps=1 and raise max_tokens instead."
            )
        global_batch = self.options.global_batch.global_batch_size
        if global_batch is not None:
            if tokens.max_tokens is not None:
                raise ConfigError(
                    f"{GLOBAL_KEY}={global_batch} with max_tokens={tokens.max_tokens}: a token budget "
                    f"sets each step's samples; set max_tokens=null or {GLOBAL_KEY}=null."
                )
            if optimizer_in_bwd:
                raise ConfigError(
                    f"{GLOBAL_KEY}={global_batch} with optimizer_in_bwd=True: a global batch is run in "
                    f"accumulated micro-batches, which an optimizer stepping inside backward cannot do; "
                    f"set optimizer_in_bwd=False or {GLOBAL_KEY}=null."
                )
            check_global_batch(
                global_batch, world_size=self.ranks.world_size, gradient_accumulation_steps=self._accumulation
            )
        growing = growth.batch_increase_function is not None
        if getattr(growth.batch_increase_function, "needs_gradient_noise_scale", False):
            if not self.options.noise.measure_noise_scale:
                raise ConfigError(
                    f"{GROWTH_KEY}={function_name(growth.batch_increase_function)} grows toward the gradient noise "
                    "scale, with measure_noise_scale=False: set measure_noise_scale=True (and, for steps of one "
                    "micro-batch on one device, noise_scale_split_step=True)."
                )
        if not growing and not growth.batch_increase_interval.per_epoch:
            raise ConfigError(
                f"batch_increase_interval='{growth.batch_increase_interval}' without a batch_increase_function: "
                "nothing would grow; set batch_increase_function, or batch_increase_interval=epoch."
            )
        if optimizer_in_bwd and (growth.retry_on_oom or growing):
            what, off = (
                (f"{GROWTH_KEY}={growth.batch_increase_function!r}", f"{GROWTH_KEY}=null")
                if growing
                else ("retry_on_oom=True", "retry_on_oom=False")
            )
            raise ConfigError(
                f"{what} with optimizer_in_bwd=True: both split steps into accumulated micro-batches, "
                f"which an optimizer stepping inside backward cannot do; set optimizer_in_bwd=False or {off}."
            )
        if growing and tokens.max_tokens is not None:
            raise ConfigError(
                f"{GROWTH_KEY} with max_tokens={tokens.max_tokens}: token-budget batches change size with every "
                f"step, so there is no batch size to grow; set max_tokens=null or {GROWTH_KEY}=null."
            )
        if self.needs_probe:
            if self.device.type not in ("cpu", "cuda"):
                raise ConfigError(
                    f"use_maximum_batch_size=True (or a batch_increase_function without "
                    f"max_batch_size) on device={self.device.type!r}: the probe measures memory on "
                    "cpu and cuda only; set use_maximum_batch_size=False and max_batch_size."
                )
            if self.max_seq_len is None:
                raise ConfigError(
                    "probing the largest batch (use_maximum_batch_size=True, or a "
                    "batch_increase_function without max_batch_size) with tokenizer.max_seq_len=null: the probe runs "
                    "every sequence at that length so no longer batch can run out of memory "
                    "later; set tokenizer.max_seq_len, e.g. tokenizer.max_seq_len=2048."
                )

    @property
    def needs_probe(self) -> bool:
        """Probing is asked for, or growth has no other bound than what fits."""
        probe, growth = self.options.probe, self.options.growth
        return probe.use_maximum_batch_size or (
            growth.batch_increase_function is not None and probe.max_batch_size is None
        )

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

    # ------------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:
        """The batch state and the probe result, under their recipe-state keys."""
        state: Dict[str, Any] = {BATCH_STATE_KEY: self.batch.state_dict()}
        if self.probe_report is not None:
            state[PROBE_STATE_KEY] = self.probe_report
        if self.noise_scale is not None:
            state[NOISE_SCALE_STATE_KEY] = self.noise_scale.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Takes a resumed run's probe result and batch state from the recipe state (other
        keys are ignored); the batch state applies once :meth:`settle` has built the batch."""
        self.probe_report = state.get(PROBE_STATE_KEY)
        self._batch_state = state.get(BATCH_STATE_KEY)
        if self.noise_scale is not None and state.get(NOISE_SCALE_STATE_KEY) is not None:
            self.noise_scale.load_state_dict(state[NOISE_SCALE_STATE_KEY])
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
        """Decides the batch to start with and the largest micro-batch, probing if needed.

        Without growth the micro-batch is the probed batch when probing, else ``batch_size``,
        and a step ``gradient_accumulation_steps`` of them. With growth ``batch_size`` x
        ``gradient_accumulation_steps`` is the starting step and the largest batch that fits
        (or ``max_batch_size``) the largest micro-batch.

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
        self._max_steps_per_epoch = max_steps_per_epoch
        probe_options, growth = self.options.probe, self.options.growth
        if self.probe_report is not None:
            self.log(f"Resumed run: using the probed batch_size={self.probe_report['batch_size']} from the recipe state.")
        elif self.needs_probe:
            if not probe_options.use_maximum_batch_size:
                self.log(
                    "batch_increase_function without max_batch_size: probing for the largest batch "
                    "that fits, as the bound of the growth."
                )
            if probe is None:
                raise ValueError("settle() needs probe= to find the largest batch that fits.")
            self.probe_report = probe(
                probe_options,
                dataset_size=dataset_size,
                device=self.device,
                ranks=self.ranks,
                output_dir=self.output_dir,
                log=self.log,
            )
        if self.probe_report is not None and self.mode.adopt_probe(self.probe_report, self.max_seq_len, self.log):
            save_probe_report(self.probe_report, self.output_dir, self.ranks)
        self.mode.prepare(lengths, self.log)

        if self.options.global_batch.global_batch_size is not None:
            start, micro = self._global_batch(dataset_size)
        else:
            start, micro = self._starting_batch()
        self.batch = BatchState(
            batch_size=start,
            max_micro_batch_size=self.mode.max_micro_batch_size(micro, dataset_size),
            # A global batch runs in accumulated micro-batches, and grows the same way.
            grow_with_accumulation=growth.grow_with_accumulation or self.micro_batch_plan is not None,
            samples_per_epoch=self.mode.samples_per_epoch(dataset_size, start, max_steps_per_epoch),
        )
        if self._batch_state is not None:
            self.batch.load_state_dict(self._batch_state)
            self.log(f"Resumed run: batch state from the recipe state: {self.batch.state_dict()}")
        return self.batch

    def _starting_batch(self) -> "tuple[int, int]":
        """The first step's samples and the largest micro-batch."""
        accumulation, report = self._accumulation, self.probe_report
        if self.options.growth.batch_increase_function is None:
            if report is None:
                return self._batch_size * accumulation, self._batch_size
            micro = report["batch_size"]
            self.log(f"use_maximum_batch_size: training with batch_size={micro}")
            return micro * accumulation, micro
        # Growth is bounded by the largest batch that fits, whatever batch the objective chose.
        bound = (
            round_batch_size(report["max_batch_size"], self.options.probe.batch_size_rounding)
            if report is not None
            else self.options.probe.max_batch_size
        )
        start = self._batch_size * accumulation
        with_accumulation = self.options.growth.grow_with_accumulation
        self.log(
            f"batch_increase_function: starting at {start} samples a step, micro-batches of up to "
            f"{bound}; growth " + ("may pass it by gradient accumulation." if with_accumulation else "stops there.")
        )
        if start > bound and not with_accumulation:
            self.warn(
                f"batch_size={self._batch_size} x gradient_accumulation_steps={accumulation} is over "
                f"the largest batch that fits, {bound}: starting at {bound}."
            )
            start = bound
        return start, bound

    def _global_batch(self, dataset_size: int) -> "tuple[int, int]":
        """A rank's share of ``global_batch_size`` and the micro-batch limit: the probed batch
        (or the fastest split of it), else ``batch_size``. Recorded in ``batch_probe.json``.

        Raises:
            ConfigError: when a rank's share is more than its samples.
        """
        global_batch, world = self.options.global_batch.global_batch_size, self.ranks.world_size
        share = global_batch // world
        if share > dataset_size:
            raise ConfigError(
                f"{GLOBAL_KEY}={global_batch} is {share} samples a rank a step, more than the "
                f"{dataset_size} samples a rank has: lower {GLOBAL_KEY} to at most {dataset_size * world}."
            )
        report = self.probe_report
        trials = (report or {}).get("throughput", {}).get("trials")
        if report is not None and trials:
            plan = fastest_split(
                global_batch, world_size=world, trials=trials, tolerance=self.options.probe.throughput_tolerance
            )
        elif report is not None:
            plan = split_global_batch(global_batch, world_size=world, largest_micro_batch=report["batch_size"])
        else:
            plan = split_global_batch(
                global_batch, world_size=world, largest_micro_batch=self._batch_size, chosen_by="batch_size"
            )
        self.micro_batch_plan = plan
        self.log(plan.describe() + "; the global batch and the LR stay, an out-of-memory error halves the micro-batch.")
        if report is not None:
            report["global_batch"] = plan.to_dict()
            save_probe_report(report, self.output_dir, self.ranks)
        return share, plan.micro_batch_limit

    def track_gradients(self, params: Any) -> None:
        """With ``measure_noise_scale``, allocates the gradient copy the measurement needs;
        called before :meth:`settle`, so the probe counts it as training state."""
        if self.noise_scale is not None:
            self._gradients = MicroBatchGradients(list(params))
            self._gradients.allocate()

    def _measure_noise(self, global_samples: float) -> Optional[float]:
        """Folds the step's micro-batch gradients into the noise scale; ``None`` for a step of
        one micro-batch (nothing to compare) or before tracking."""
        gradients = self._gradients
        if gradients is None or len(gradients.sq_norms) < 2:
            return None if self.noise_scale is None else self._noise_in_samples()
        n = len(gradients.sq_norms)
        # Sharded gradients: a norm is the sum of the ranks' local ones; tokens are all ranks'.
        totals = self.ranks.sums(*gradients.sq_norms, *gradients.tokens, gradients.step_sq_norm())
        sq, tokens, step_sq = totals[:n], totals[n : 2 * n], totals[-1]
        # .grad holds summed-loss gradients averaged over ranks: per-token means need x world / tokens.
        world = self.ranks.world_size
        means = [s * world**2 / t**2 for s, t in zip(sq, tokens)]
        step_tokens = sum(tokens)
        self.noise_scale.update(estimate_noise(means, tokens, step_sq * world**2 / step_tokens**2, step_tokens))
        self._samples_per_token = global_samples / step_tokens
        return self._noise_in_samples()

    def _noise_in_samples(self) -> Optional[float]:
        """The averaged noise scale (per token) in samples, at the last measured step's ratio."""
        value = self.noise_scale.value
        ratio = self._samples_per_token
        return None if value is None or ratio is None else value * ratio

    def batch_sampler(self, dataset: Any, *, shuffle: bool) -> Any:
        """The batch sampler of this rank's share of ``dataset``, following the batch."""
        self._sampler = self.mode.batch_sampler(dataset, self.batch, self.ranks, shuffle)
        return self._sampler

    def collate(self, collate_fn: Callable) -> Callable:
        """``collate_fn`` as the batches need it (truncated to the token budget)."""
        return self.mode.collate(collate_fn)

    def lr_schedule_steps(self, epochs: int, num_batches: int) -> float:
        """``num_training_steps`` for the LR scheduler, given the first epoch's batches."""
        return self.mode.lr_schedule_steps(epochs, self.batch, self.mode.steps_per_epoch(num_batches, self._max_steps_per_epoch))

    def lr_last_epoch(self) -> int:
        """``last_epoch`` for the LR scheduler."""
        return self.mode.lr_last_epoch(self.global_step)

    def attach_lr(self, optimizer: Any, lr_scheduler: Any, read_lr: Callable[[], float]) -> None:
        """Couples the LR to the batch: a schedule counted in samples (fixed-size batches), and
        the scaling rule.

        Args:
            optimizer: whose param groups the scaling rule sets.
            lr_scheduler: the run's scheduler, or ``None``.
            read_lr: reads the LR a step uses, for the log.

        Raises:
            ConfigError: for a scheduler that cannot be counted in samples.
        """
        self._lr_scheduler, self._read_lr = lr_scheduler, read_lr
        if lr_scheduler is not None and self.mode.counts_lr_in_samples:
            try:
                self._lr_progress = SampleProgressLR(lr_scheduler, self.batch.initial_batch_size)
            except TypeError as e:
                raise ConfigError(f"lr_scheduler: {e}") from None
            self._lr_progress.set_progress(self.batch.samples_seen)
        scaling = self.options.lr_scaling
        if scaling.scales:
            reference = scaling.lr_scaling_reference
            try:
                self._lr_scaler = BatchLRScaler(
                    optimizer,
                    rule=scaling.lr_scaling,
                    reference=float(reference if reference is not None else self._configured_batch()),
                    unit=scaling.lr_scaling_unit,
                    lr_scheduler=self._lr_progress or lr_scheduler,
                    weight_decay_scaling=scaling.weight_decay_scaling,
                )
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def _configured_batch(self) -> int:
        """The per-rank batch the config's LR was set for."""
        if self.micro_batch_plan is not None:
            return self.micro_batch_plan.per_rank
        return self._batch_size * self._accumulation

    # ------------------------------------------------------------------ training

    def start_epoch(self, epoch: int, dataloader: Any) -> int:
        """Starts (or, after a mid-epoch resume, continues) ``epoch``: growth at the epoch's
        boundary, or at boundary 0 of a steps, samples or tokens interval; returns the steps
        the epoch has left.

        Rank 0 calls the batch increase function (with global batch sizes) and every rank
        takes its decision, so all ranks keep the same batch whatever the function does.

        Raises:
            BatchIncreaseFunctionError: on every rank, when the function fails.
        """
        continuing = not self.batch.enter_epoch(epoch)
        if self._growth is not None:
            if self._interval.per_epoch:
                if epoch >= self.batch.intervals_done:
                    self._grow(epoch)
            else:
                self._grow_at_boundaries()
        self.mode.start_epoch(dataloader.batch_sampler, self.batch, epoch, self.log)
        if continuing:
            self.log(
                f"Epoch {epoch}: resuming after its step {self.batch.epoch_steps} "
                f"(global step {self.batch.global_step})."
            )
        return self.mode.steps_left(dataloader.batch_sampler, self.batch, len(dataloader), self._max_steps_per_epoch)

    @property
    def _interval(self) -> Any:
        return self.options.growth.batch_increase_interval

    def _grow(self, k: int) -> None:
        """Boundary ``k``'s call, decided on rank 0 and taken by every rank."""
        label = "epoch" if self._interval.per_epoch else "interval"
        growth, stats = self._growth, self._growth_statistics()
        waiting = stats.gradient_noise_scale is None and stats.global_step > 0
        if waiting and getattr(growth, "needs_gradient_noise_scale", False):
            self._warn_no_noise_scale(k)
        decision = self.ranks.decide_on_main(
            lambda: self.batch.grow_at(growth, k, label=label, stats=stats), errors=(BatchIncreaseFunctionError,)
        )
        self.batch.batch_size, self.batch.intervals_done = decision.batch_size, k + 1
        # Per epoch, a request held at the bound is said too; per step it would repeat each step.
        asked = decision.requested != decision.previous and self._interval.per_epoch
        if decision.batch_size != decision.previous or asked:
            self._log_growth(k, decision)

    def _growth_statistics(self) -> GrowthStatistics:
        """What a growth function taking ``stats`` sees, in global sizes."""
        batch = self.batch
        return GrowthStatistics(
            global_step=batch.global_step,
            samples_seen=batch.global_samples_seen,
            tokens_seen=batch.tokens_seen,
            gradient_noise_scale=None if self.noise_scale is None else self._noise_in_samples(),
            max_batch_size=batch.growth_bound() * self.ranks.world_size,
        )

    def _warn_no_noise_scale(self, k: int) -> None:
        if self._warned_no_noise:
            return
        self._warned_no_noise = True
        why = (
            "its |G|^2 average is not above 0 yet"
            if self.noise_scale.updates
            else "it is measured on steps of two or more micro-batches (noise_scale_split_step=True splits steps of one)"
        )
        self.warn(f"{self._interval.describe(k).capitalize()}: no gradient noise scale yet, so the batch stays; {why}.")

    def _grow_at_boundaries(self) -> None:
        """Every steps, samples or tokens boundary reached and not yet applied, in order."""
        for k in self.batch.pending_boundaries(self._interval):
            self._grow(k)

    def _log_growth(self, k: int, decision: Any) -> None:
        note = ""
        if decision.clamped:
            why = "an epoch's samples" if decision.bound == self.batch.samples_per_epoch else "the largest micro-batch"
            note = f" (clamped from {decision.requested} to {decision.bound}, {why})"
        per_rank = f" per rank, x{self.ranks.world_size} ranks" if self.ranks.distributed else ""
        where = self._interval.describe(k).capitalize()
        if not self._interval.per_epoch:
            where += f" at step {self.batch.global_step}"
        self.log(f"{where}: batch_size {decision.previous} -> {decision.batch_size}{per_rank}{note}.")

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
        if self._lr_progress is not None:
            self._lr_progress.set_progress(self.batch.samples_seen)
        step = accumulate_gradients(
            forward_backward,
            batch,
            micro_batch_limit=self.batch.max_micro_batch_size,
            zero_grad=zero_grad,
            retry_on_oom=self.options.growth.retry_on_oom,
            device=self.device,
            log=self.warn,
            agree_on_oom=self.ranks.any if self.ranks.distributed else None,
            observer=self._gradients,
            min_micro_batches=2 if self.options.noise.noise_scale_split_step else 1,
        )
        global_samples, tokens, padded, loss_sum = self.ranks.sums(samples, step.num_tokens, padded, step.loss_sum)
        interval = self.batch.intervals_done - 1
        noise = self._measure_noise(global_samples)
        return StepOutcome(step, samples, int(global_samples), tokens, padded, loss_sum / tokens, interval, noise)

    def before_optimizer_step(self, step: StepOutcome) -> float:
        """Scales the LR for the step's batch; returns the LR the step uses."""
        if self._lr_scaler is None:
            return self._read_lr()
        # Across ranks the LR scales with a rank's mean share, so it is the same on all.
        world = self.ranks.world_size
        return self._lr_scaler.apply(samples=step.global_samples / world, tokens=int(step.num_tokens / world))

    def after_optimizer_step(self, step: StepOutcome) -> None:
        """Puts the unscaled LR back, advances a step-counted scheduler, counts the step, and
        grows the batch at the steps, samples or tokens boundaries the step reached (the next
        step takes the new batch)."""
        if self._lr_scaler is not None:
            self._lr_scaler.restore()
        if self._lr_scheduler is not None and self._lr_progress is None:
            self._lr_scheduler.step()
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
        if self._growth is not None and not self._interval.per_epoch:
            self._grow_at_boundaries()
            self.mode.resize(self._sampler, self.batch)

    def step_metrics(self, step: StepOutcome, seconds: float) -> Dict[str, float]:
        """The batch's per-step metrics, for the metric logger."""
        world = self.ranks.world_size
        growth = {} if self._growth is None else {"growth_interval": step.interval}
        noise = {} if step.noise_scale is None else {"gradient_noise_scale": step.noise_scale}
        scaler = self._lr_scaler
        decay = {} if scaler is None or scaler.last_weight_decay is None else {"weight_decay": scaler.last_weight_decay}
        return {
            **growth,
            **noise,
            **decay,
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
