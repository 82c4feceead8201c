"""The library in a plain PyTorch loop: two calls beside the loop's own lines.

    adaptive = AdaptiveBatch(model, optimizer, dataset, loss_fn, batch_size=8, batch_increase_function=double_every_epoch)
    for epoch in range(3):
        for batch in adaptive.batches(epoch):
            adaptive.step(batch)

Everything else a recipe gets comes with it: growth by the same functions and schedules, a
fixed ``global_batch_size`` in micro-batches, the LR (and weight decay) scaled with the batch,
an out-of-memory step rerun in halves, the probe, and ``state_dict()`` for checkpoints.
"""

from functools import partial
from itertools import islice
import tempfile
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch.utils.data import default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.data.loader import LOADER_KEYS, loader_settings
from adaptive_batch.errors import ConfigError
from adaptive_batch.probe.api import needs_two_samples
from adaptive_batch.probe.cache import step_fields
from adaptive_batch.probe.service import probe_batch_size
from adaptive_batch.probe.target import (
    MAKE_BATCH_EXAMPLE, ProbeTarget, check_make_batch, check_model_and_optimizer, step_device,
)
from adaptive_batch.run.controller import AdaptiveBatchController, StepOutcome
from adaptive_batch.run.options import AdaptiveBatchOptions
from adaptive_batch.run.state import RunState
from adaptive_batch.schedule.lr_progress import check_counted_in_samples
from adaptive_batch.validation import check_bool, check_callable, check_known_keys, check_positive_number


class AdaptiveBatch:
    """A training loop's batch: what it holds, how it grows and what the LR does about it.

    ``loss_fn(micro_batch)`` returns that micro-batch's mean loss; each is weighted by its
    samples (or by ``count_of(micro_batch)``, e.g. the tokens that carry a loss) and the
    gradients divided by the step's total, so a step in micro-batches makes the update one step
    on the whole batch would. Batches come as ``dataset`` and ``collate_fn`` make them (move them
    to the device in ``loss_fn``), of any structure (``layout``).

    Args:
        model: what trains.
        optimizer: its optimizer.
        dataset: a map-style dataset; an epoch is one pass over it. A ``DataLoader`` gives its
            dataset, ``collate_fn``, shuffling, workers and (unless ``batch_size`` is given) its
            batch size; the batches themselves are drawn here, to resize them.
        loss_fn: ``f(micro_batch) -> `` its mean loss (a scalar tensor with a graph).
        batch_size: the first batch (per step, before any growth); a ``DataLoader``'s when ``None``.
        collate_fn: turns a list of samples into a batch (torch's ``default_collate``).
        lr_scheduler: stepped once per optimizer step (by samples, with ``lr_scaling``).
        shuffle: shuffle the samples, in another order each epoch.
        clip_grad_norm: clip the gradients' norm to this before each optimizer step.
        make_batch: ``f(b) -> `` a worst-case batch of ``b`` samples, for the probe.
        build: a picklable top-level ``f() -> ProbeTarget(train_step, make_batch, model, optimizer)``
            building the step afresh: under a hard address-space limit every probe trial then runs
            in a fresh process, as with :func:`~adaptive_batch.find_max_batch_size` (an
            out-of-memory trial here can leave this process unable to train what it ran).
        count_of: ``f(micro_batch) -> `` what its mean loss is over (samples by default).
        layout: where a batch's samples lie (the first dimension of its tensors by default).
        output_dir: where the probe's report goes (a new temporary directory when ``None``;
            nothing is written without probing).
        log: where decisions are reported (``None``: the ``adaptive_batch`` logger).
        **settings: the adaptive keys of ``docs/configuration.md`` (``batch_increase_function``,
            ``max_batch_size``, ``global_batch_size``, ``lr_scaling``, ``use_maximum_batch_size``,
            ``max_memory``, ``retry_on_oom``, ...), with their defaults; and torch's
            ``DataLoader`` options for workers (``num_workers``, ``pin_memory``, ...:
            :data:`~adaptive_batch.data.loader.LOADER_KEYS`).

    Raises:
        ConfigError: for a bad setting or combination, before any step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        loss_fn: Callable[[Any], torch.Tensor],
        *,
        batch_size: Optional[int] = None,
        collate_fn: Callable = default_collate,
        lr_scheduler: Any = None,
        shuffle: bool = True,
        clip_grad_norm: Optional[float] = None,
        make_batch: Optional[Callable[[int], Any]] = None,
        build: Optional[Callable[[], ProbeTarget]] = None,
        count_of: Optional[Callable[[Any], Any]] = None,
        layout: Optional[BatchLayout] = None,
        output_dir: Optional[str] = None,
        log: Optional[Callable[[str], None]] = None,
        **settings: Any,
    ) -> None:
        check_known_keys(settings, [*AdaptiveBatchOptions.keys(), *LOADER_KEYS, *_OWN_ARGUMENTS],
                         kind="argument", reader="AdaptiveBatch")
        _check_the_functions(collate_fn=collate_fn, make_batch=make_batch, count_of=count_of, layout=layout)
        data = loader_settings(  # no collate_fn: torch's, as a DataLoader takes None
            dataset, batch_size=batch_size, collate_fn=collate_fn or default_collate, shuffle=check_bool("shuffle", shuffle),
            options={key: settings.pop(key) for key in LOADER_KEYS if key in settings},
        )
        options = AdaptiveBatchOptions.from_flat(settings)
        _refuse_before_any_step(options, make_batch, lr_scheduler)
        _check_the_parts(model, optimizer, loss_fn, clip_grad_norm, data)
        self.model, self.optimizer, self.dataset = model, optimizer, data.dataset
        self._lr_scheduler, self._clip, self._make_batch = lr_scheduler, clip_grad_norm, make_batch
        self._build = check_callable("build", build, "a top-level f() -> ProbeTarget(...)", allow_none=True)
        self._loss_fn, self._collate, self._shuffle = loss_fn, data.collate_fn, data.shuffle
        self._loader_options = data.options
        self._layout = layout or BatchLayout()
        self._count_of = count_of or self._layout.rows
        device = step_device(model, None)
        self.controller = AdaptiveBatchController(
            options, batch_size=data.batch_size, input_key=None, device=device, layout=self._layout, log=log,
            # only the probe writes there (its report and snapshot)
            output_dir=output_dir or (tempfile.mkdtemp(prefix="adaptive-batch-") if options.needs_probe else "."),
            max_seq_len=0,
        )
        self._run_state = _run_state(self.controller, options, data, clip_grad_norm)
        self._dataloader: Optional[StatefulDataLoader] = None
        self._resumed: Dict[str, Any] = {}
        # The loader's own generator: a data loader's iterator draws its workers' seed at each
        # epoch's start, from the global RNG where it has none, so a run resumed inside an epoch
        # (the RNG restored beside the model) drew once more than the uninterrupted one, and its
        # dropout masks differed from there on.
        self._loader_generator = torch.Generator().manual_seed(torch.initial_seed())
        self._epoch_generator_state: Optional[torch.Tensor] = None
        self._resume_pending = False  # a loaded loader state its next iterator takes up

    @property
    def batch_size(self) -> int:
        """The batch the next step takes."""
        self._settle()
        return self.controller.batch.batch_size

    def batches(self, epoch: int) -> Iterator[Any]:
        """The batches of ``epoch`` (growth at its start; after a resume, the steps it has left).

        Raises:
            BatchIncreaseFunctionError: when the growth function fails.
        """
        self._settle()
        self._leave_the_saved_epoch_for(epoch)
        self._resume_pending = False  # this epoch's iterator takes it up
        steps = self.controller.start_epoch(epoch, self._dataloader)
        self._epoch_generator_state = self._loader_generator.get_state()  # before the epoch's draw
        return islice(self._dataloader, steps)

    def _leave_the_saved_epoch_for(self, epoch: int) -> None:
        """Where a loop resumed from a state saved at its epoch's end asks for the next epoch, the
        saved epoch's iterator (the loader resumes it once, at its end) is made and set aside as
        the uninterrupted loop's ran out: asked for first, it took the next epoch's place, which
        yielded nothing, so a whole epoch went untrained without a word.

        Raises:
            ConfigError: where the saved epoch has steps left (the loop would skip them).
        """
        saved = self.controller.batch.epoch
        if not self._resume_pending or epoch == saved or saved < 0:
            return
        left = self.controller.session.steps_left(len(self._dataloader))
        if left > 0 or epoch < saved:
            unfinished = f", {left} of its steps left" if left > 0 else ""
            raise ConfigError(
                f"batches({epoch}) after load_state_dict() of a loop saved in epoch {saved}{unfinished}: call "
                f"batches({saved}) first, as the saved loop would have, then the epochs after it."
            )
        self._epoch_generator_state = self._loader_generator.get_state()
        iter(self._dataloader)  # the saved epoch's iterator, at its end: the uninterrupted loop's last draw

    def step(self, batch: Any) -> StepOutcome:
        """One optimizer step of ``batch``: forward and backward in micro-batches that fit, the
        LR scaled for the batch, the optimizer and scheduler stepped, the batch grown when due.

        Returns:
            What ran: ``loss`` (the batch's mean), ``lr``, micro-batches, retries, ``global_step``.

        Raises:
            MicroBatchOutOfMemoryError: when one-sample micro-batches run out of memory.
        """
        self._settle()
        self._check_the_rows(batch)
        return self.controller.step(
            batch, forward_backward=self._forward_backward, optimizer_step=self._optimizer_step,
            zero_grad=self._zero_grad,
        )

    def _check_the_rows(self, batch: Any) -> None:
        """Raises:
        ConfigError: for a batch the layout counts as more samples than the step drew (its
            first tensor is no row a sample: an ``EmbeddingBag``'s flat indices) where the step
            is cut into micro-batches of those rows: its bags lost their bounds (an error deep in
            the model, or wrong gradients without one). Uncut, it trains as it is."""
        rows, drawn = self._layout.rows(batch), self.controller.batch.batch_size
        if rows > drawn and len(self.controller.session.split_step(rows).micro_batch_sizes) > 1:
            raise ConfigError(
                f"the step drew {drawn} samples and the batch's first tensor along batch_dim="
                f"{self._layout.batch_dim} has {rows}: its tensors are not one row a sample (an EmbeddingBag's flat "
                "indices, a packed sequence), and the step is cut into micro-batches by that count; collate one row "
                "a sample (padded ids and a mask), or say how many samples a batch holds with "
                "layout=BatchLayout(batch_size_of=f) where no step is cut."
            )

    def state_dict(self) -> Dict[str, Any]:
        """The batch, probe result, data position and LR schedule, for a checkpoint beside the
        model's and optimizer's."""
        self._settle()
        state = dict(self._run_state.state_dict(), dataloader=self._dataloader.state_dict(),
                     loader_generator=(self._loader_generator.get_state() if self._epoch_generator_state is None
                                       else self._epoch_generator_state))
        if self._lr_scheduler is not None:
            state["lr_scheduler"] = self._lr_scheduler.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes from :meth:`state_dict`'s answer; call it before the first :meth:`batches`.

        Raises:
            ValueError: when batches have already been drawn.
            ConfigError: when a setting that changes what is trained (``max_batch_size``, the
                growth function, ``lr_scaling``, ``batch_size``, the dataset's size, ...) differs
                from the saved loop's, naming it and both values; when the saved loop stepped an
                ``lr_scheduler`` and this one has none, or the other way round.
        """
        if self._dataloader is not None:
            raise ValueError("load_state_dict() after batches(): load the state first, then draw the batches.")
        _refuse_another_schedule(state, self._lr_scheduler)
        self._run_state.load_state_dict(state)
        try:
            self._run_state.check_resume()
        except ConfigError:
            self._run_state.load_state_dict({})  # as built: a refused state is not left half taken
            raise
        self._resumed = state

    def _settle(self) -> None:
        """The first batch (probing if asked), its sampler, data loader and the LR coupling."""
        if self._dataloader is not None:
            return
        ctl = self.controller
        probe = None
        if ctl.options.needs_probe:
            target = ProbeTarget(self._train_step, self._make_batch, self.model, self.optimizer, ctl.device)
            # The key holds what the step is made of: another model's answer once came back.
            fields = step_fields(self.model, self.optimizer, self._make_batch(1), (self._loss_fn,)) if (
                ctl.options.probe_cache_dir) else None
            probe = partial(probe_batch_size, target=target, seq_len=0, cache_fields=fields, build=self._build)
        try:
            ctl.settle(dataset_size=len(self.dataset), probe=probe)
        except ValueError as e:
            if not needs_two_samples(e):
                raise
            raise ConfigError(
                "use_maximum_batch_size=True: a batch of 1 does not train (the model's BatchNorm needs 2 samples a "
                "channel), and this loop's probe counts from 1; probe with adaptive_batch.find_max_batch_size (it "
                "searches from 2) and pass its answer as batch_size, with use_maximum_batch_size=False."
            ) from e
        sampler = ctl.batch_sampler(self.dataset, shuffle=self._shuffle)
        if "loader_generator" in self._resumed:  # the epoch's, so its resumed iterator draws what it drew
            self._loader_generator.set_state(self._resumed["loader_generator"])
        self._dataloader = StatefulDataLoader(
            self.dataset, batch_sampler=sampler, collate_fn=self._collate, generator=self._loader_generator,
            **self._loader_options
        )
        if "dataloader" in self._resumed:
            self._dataloader.load_state_dict(self._resumed["dataloader"])
            self._resume_pending = True  # the next iterator is the saved epoch's
        if "lr_scheduler" in self._resumed and self._lr_scheduler is not None:
            self._lr_scheduler.load_state_dict(self._resumed["lr_scheduler"])
        # The optimizer, not self: a cycle through self left the loader's workers to the garbage
        # collector, whose order stalls their shutdown 5 s (their queues' feeders end first).
        optimizer = self.optimizer
        ctl.attach_lr(optimizer, self._lr_scheduler, read_lr=lambda: optimizer.param_groups[0]["lr"])

    def _forward_backward(self, piece: Any):
        """One micro-batch's summed loss (its mean times its count) and count, backward run."""
        count = torch.as_tensor(self._count_of(piece), dtype=torch.float32)
        loss = self._loss_fn(piece) * count.to(self.controller.device)
        loss.backward()
        return loss.detach(), count

    def _optimizer_step(self, total: float) -> Optional[torch.Tensor]:
        """Divides the summed gradients by the step's count, clips, steps and zeroes them."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(float(total))
        norm = None if self._clip is None else torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._clip)
        self.optimizer.step()
        self._zero_grad()
        return norm

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _train_step(self, batch: Any) -> None:
        """One whole step, as :meth:`step` runs it, for the probe: the micro-batches a step holds
        (:meth:`~adaptive_batch.run.controller.AdaptiveBatchController.probe_micro_batches`), then
        the optimizer step."""
        total = 0.0
        for _ in range(self.controller.probe_micro_batches(self.controller.layout.rows(batch))):
            # A copy each, where it can be had: a loss may take its labels out of the batch.
            piece = dict(batch) if isinstance(batch, dict) else batch
            total += float(self._forward_backward(piece)[1])
        self._optimizer_step(total)


def _refuse_another_schedule(state: Dict[str, Any], lr_scheduler: Any) -> None:
    """Raises:
    ConfigError: when the saved loop stepped an LR schedule and this one has none (it trained at
        the optimizer's constant LR where the saved run decayed it), or the other way round (the
        schedule would start over mid-run)."""
    saved = "lr_scheduler" in state
    if saved and lr_scheduler is None:
        raise ConfigError(
            "load_state_dict(): the saved loop stepped an lr_scheduler (its state is in the checkpoint) and this "
            "AdaptiveBatch has none, so it would train at the optimizer's LR: pass lr_scheduler= built as before, "
            "or train from the start without the saved state."
        )
    if not saved and lr_scheduler is not None:
        raise ConfigError(
            f"load_state_dict(): this AdaptiveBatch has lr_scheduler={type(lr_scheduler).__name__} and the saved loop "
            "had none, so its schedule would start over mid-run: build it without lr_scheduler to resume, or train "
            "from the start without the saved state."
        )


def _refuse_before_any_step(options: AdaptiveBatchOptions, make_batch: Optional[Callable[[int], Any]],
                            lr_scheduler: Any) -> None:
    """What this loop cannot run, refused when it is built.

    Raises:
        ConfigError: for ``max_tokens``, a probe without ``make_batch`` (or with one that ignores
            its size), a schedule that cannot be counted in samples.
    """
    if options.tokens.max_tokens is not None:
        raise ConfigError(
            f"max_tokens={options.tokens.max_tokens}: token-budget batches need the recipes' tokenized samples; "
            "remove max_tokens and set batch_size."
        )
    if options.needs_probe and make_batch is None:
        raise ConfigError(
            "use_maximum_batch_size=True (or a batch_increase_function without max_batch_size) probes the "
            "largest batch that fits: pass make_batch=f(b) -> a worst-case batch of b samples, or set max_batch_size."
        )
    if make_batch is not None and options.needs_probe:
        check_make_batch(make_batch)
    if lr_scheduler is not None:  # before the probe: the schedule advances by samples here
        check_counted_in_samples(lr_scheduler)


# The arguments of AdaptiveBatch's own, for the nearest name to a misspelt one.
_OWN_ARGUMENTS = ("batch_size", "collate_fn", "lr_scheduler", "shuffle", "clip_grad_norm", "make_batch", "build",
                  "count_of", "layout", "output_dir", "log")


def _check_the_functions(*, collate_fn: Any, make_batch: Any, count_of: Any, layout: Any) -> None:
    """Raises:
    ConfigError: for a function argument that cannot be called, or a ``layout`` that is no
        :class:`BatchLayout`, when the loop is built (not at its first batch)."""
    check_callable("collate_fn", collate_fn, "torch.utils.data.default_collate, or f(samples) -> batch",
                   allow_none=True)
    check_callable("make_batch", make_batch, MAKE_BATCH_EXAMPLE, allow_none=True)
    check_callable("count_of", count_of, "lambda batch: (batch['labels'] != -100).sum()", allow_none=True)
    if layout is not None and not isinstance(layout, BatchLayout):
        raise ConfigError(f"layout={layout!r} is no BatchLayout: pass e.g. layout=BatchLayout(batch_dim=1), "
                          "or None for the first dimension of the batch's tensors.")


def _check_the_parts(model: Any, optimizer: Any, loss_fn: Any, clip_grad_norm: Any, data: Any) -> None:
    """The loop's own parts, checked when it is built (a negative clip norm flipped every gradient).

    Raises:
        ConfigError: for a model that is no module, an optimizer that is no torch optimizer, a
            ``loss_fn`` that cannot be called, a ``clip_grad_norm`` not above 0, or a
            ``batch_size`` larger than the dataset.
    """
    check_model_and_optimizer(model, optimizer, trained_by="loss_fn", optimizer_required=True)
    check_callable("loss_fn", loss_fn, "lambda batch: criterion(model(batch[0]), batch[1])")
    if clip_grad_norm is not None:
        check_positive_number("clip_grad_norm", clip_grad_norm, "the largest gradient norm, e.g. 1.0, or None")
    samples = len(data.dataset)
    if samples == 0:
        raise ConfigError("the dataset has no samples: there is nothing to train; pass the training samples.")
    if data.batch_size > samples:
        raise ConfigError(
            f"batch_size={data.batch_size} is larger than the dataset's {samples} samples: every step would train "
            f"{samples}, with the LR rule set for {data.batch_size}; set batch_size to at most {samples}."
        )


def _run_state(controller: AdaptiveBatchController, options: AdaptiveBatchOptions, data: Any,
               clip_grad_norm: Optional[float]) -> RunState:
    """What a resumed loop must share with the one that saved its state: the settings as taken
    (a function by its name), the first batch, the data and how it is drawn."""
    settings = {**options.trained_values(), "batch_size": data.batch_size, "shuffle": data.shuffle,
                "dataset_size": len(data.dataset), "clip_grad_norm": clip_grad_norm}
    return RunState(controller, settings=settings, resumed_by="load_state_dict()",
                    fresh_start="train from the start without the saved state")
