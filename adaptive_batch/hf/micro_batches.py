"""The Trainer's effective batch in the fewest micro-batches that fit, uneven where it must be.

``Trainer`` trains ``per_device_train_batch_size x gradient_accumulation_steps`` in equal
micro-batches, so an effective batch of 64 where 7 fit could only run as 16 x 4 (the largest
divisor of 64 that fits). In one process the Trainer's own batches of the effective size (its
sampler, shuffling and ``group_by_length`` kept) are split instead into the fewest micro-batches
that fit, sizes differing by one (4 x 7 + 6 x 6), and the loss of each is weighted by its labels
where the Trainer does not weight it by its tokens (``num_items_in_batch``). Several processes
keep equal micro-batches: Accelerate shards the batches among ranks by count. A loss that ignores
``num_items_in_batch`` though the Trainer takes it as read (:func:`loss_reads_item_count`) is
weighted by each micro-batch's labels, not summed.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch.utils.data import DataLoader, IterableDataset

from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.data.samplers import MicroBatchSampler
from adaptive_batch.rng import rng_state, set_rng_state
from adaptive_batch.schedule.global_batch import equal_micro_batches, micro_batch_sizes, split_global_batch


def split_effective_batch(effective: int, largest: int, *, uneven_allowed: bool) -> Tuple[int, int]:
    """``(per_device_train_batch_size, gradient_accumulation_steps)`` for ``effective`` samples
    a step in micro-batches of at most ``largest``: the fewest micro-batches, the largest of
    them as the per-device batch where ``uneven_allowed``, else the fewest equal ones."""
    if uneven_allowed:
        split = split_global_batch(effective, world_size=1, largest_micro_batch=largest)
        return split.micro_batch_size, split.gradient_accumulation_steps
    return equal_micro_batches(effective, largest)


def describe_micro_batches(effective: int, largest: int) -> str:
    """``"4 x 7 + 6 x 6"``: how many micro-batches of each size one step of ``effective`` takes
    in micro-batches of at most ``largest``."""
    sizes = micro_batch_sizes(effective, largest)
    return " + ".join(f"{sizes.count(size)} x {size}" for size in sorted(set(sizes), reverse=True))


def uneven_allowed(trainer: Any) -> bool:
    """Whether ``trainer``'s training batches can be split unevenly: one process on one device
    (``DataParallel`` splits each micro-batch among its devices), a dataset its own batch
    sampler draws from, and a batch sampler of fixed batches (not ``batch_rebalance``'s)."""
    args, dataset = trainer.args, trainer.train_dataset
    return (args.world_size == 1 and args.n_gpu <= 1 and dataset is not None
            and not isinstance(dataset, IterableDataset)
            and str(getattr(args, "train_sampling_strategy", "random")) != "batch_rebalance")


@contextmanager
def effective_batch_args(trainer: Any, effective: int) -> Iterator[None]:
    """The Trainer's arguments as for one micro-batch of ``effective`` samples a step, inside the
    block (its loader and ``group_by_length`` sampler then batch the effective batch)."""
    args = trainer.args
    kept = (args.per_device_train_batch_size, args.gradient_accumulation_steps, trainer._train_batch_size)
    args.per_device_train_batch_size, args.gradient_accumulation_steps = effective, 1
    trainer._train_batch_size = args.train_batch_size
    try:
        yield
    finally:
        args.per_device_train_batch_size, args.gradient_accumulation_steps, trainer._train_batch_size = kept


def split_into_micro_batches(loader: DataLoader, limit: int) -> DataLoader:
    """``loader`` (as the Trainer and Accelerate made it, one batch the effective batch) yielding
    each batch as the fewest micro-batches of at most ``limit`` samples.

    Raises:
        ValueError: for a loader without a batch sampler to split.
    """
    # Accelerate's loader wraps a torch one (``base_dataloader``) where its version does. A
    # DataLoader refuses a new batch sampler once made; everything else about this one (its
    # collator, workers, Accelerate's wrapping and device placement) stays as the Trainer made it.
    torch_loader = getattr(loader, "base_dataloader", loader)
    if getattr(torch_loader, "batch_sampler", None) is None:
        raise ValueError(f"{type(loader).__name__} has no batch sampler to split into micro-batches.")
    object.__setattr__(torch_loader, "batch_sampler", MicroBatchSampler(torch_loader.batch_sampler, limit))
    return loader


@dataclass(frozen=True)
class InputsHeld:
    """The samples of input a training step of the Trainer holds, at a micro-batch.

    Attributes:
        step_rows: the step's: every micro-batch of it (``get_batch_samples`` fetches them all
            before the first forward; a loader batch of the whole step is split in views); the
            next step's as many, fetched while the loop's list still holds these.
        prefetched_rows: the next micro-batch, where Accelerate's loader keeps it in the step's
            memory (the CPU's; on a card it waits on the host).
    """

    step_rows: int
    prefetched_rows: int

    @classmethod
    def at(cls, micro_batch: int, effective: int, *, grows: bool, grows_by_accumulation: bool,
           prefetched: bool) -> "InputsHeld":
        """At ``micro_batch`` for an ``effective`` batch; a growing batch reaches ``micro_batch``
        (two micro-batches, growing by accumulation) at the answer. A trial that held one
        micro-batch answered 143 for a ViT on images, 256 a step, whose Trainer took 24.4 MiB
        of a 24 MiB budget: two steps' images while the second's were fetched."""
        if grows:
            step = 2 * micro_batch if grows_by_accumulation else micro_batch
        else:
            step = max(effective, micro_batch)
        return cls(step, micro_batch if prefetched else 0)

    def beside(self, micro_batch: int) -> int:
        """The samples held beside a ``micro_batch`` through its step: the step's others and the next one."""
        return self.step_rows - micro_batch + self.prefetched_rows

    def at_peak(self, micro_batch: int) -> int:
        """The samples held beside a ``micro_batch`` at the most: also the next step's, fetched at its end."""
        return self.beside(micro_batch) + self.step_rows


def label_items(batch: Any, shifts_labels: bool = False) -> float:
    """What a mean loss of ``batch`` averages over, counted as the Trainer counts
    ``num_items_in_batch``: its labels that are not -100 (``shift_labels``, or all but each
    row's first where the loss shifts them), else its rows."""
    labels = batch.get("shift_labels", batch.get("labels")) if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        return float(BatchLayout().rows(batch))
    if shifts_labels and "shift_labels" not in batch and labels.dim() > 1:
        labels = labels[..., 1:]
    return float(labels.ne(-100).sum())


def micro_batch_weight(items: float, step_items: float, micro_batches: int) -> float:
    """What a micro-batch's mean loss over its ``items`` is multiplied by so that, divided by the
    micro-batches of its step as the Trainer divides it, the step's losses add up to the mean over
    the step's ``step_items``: every label weighs the same, as in the whole batch's loss."""
    return items * micro_batches / step_items if step_items > 0 else 1.0


def loss_reads_item_count(model: Any, inputs: Dict[str, Any], compute_loss_func: Optional[Callable] = None,
                          compute_loss: Optional[Callable] = None) -> bool:
    """Whether the loss on ``inputs`` (``model``'s own, ``compute_loss_func(outputs, labels,
    num_items_in_batch=...)`` where the Trainer has one, or ``compute_loss(model, inputs,
    num_items_in_batch=...)``, a trainer's own override, where given) is divided by the ``num_items_in_batch``
    it is given (a causal LM's is: the Trainer passes the step's token count, so micro-batch
    losses add up to the step's mean), or ignores it (a classification head's mean, although its
    forward takes ``**kwargs``, from which the Trainer infers it reads it). Two losses without
    gradients, in eval mode, the RNG put back; ``True`` where it cannot tell (no labels, no loss,
    a loss of 0 or not finite, a forward that refuses the count), which leaves the Trainer's own
    choice.
    """
    if "labels" not in inputs:
        return True
    losses = _losses(model, inputs, compute_loss_func, compute_loss, counts=(1, 2))
    if losses is None or any(not _a_loss(loss) for loss in losses):
        return True  # no loss, or one that reads the same at any count (0: a sample without a label)
    return not torch.allclose(losses[0], losses[1])


def scaled_by_the_ranks(model: Any, inputs: Dict[str, Any], compute_loss: Callable, ranks: int) -> bool:
    """Whether a trainer's own ``compute_loss``, whose loss ignores ``num_items_in_batch``, is
    ``ranks`` times larger given a count than given none: ``Trainer.compute_loss``'s factor for a
    loss summed over every rank's tokens, which reaches an override only where it calls it."""
    losses = _losses(model, inputs, None, compute_loss, counts=(None, 1))
    if losses is None or any(not _a_loss(loss) for loss in losses):
        return False
    return bool(torch.allclose(losses[1], losses[0] * ranks))


def _losses(model: Any, inputs: Dict[str, Any], compute_loss_func: Optional[Callable], compute_loss: Optional[Callable],
            counts: Tuple[Optional[int], ...]) -> Optional[List[Any]]:
    """The loss on ``inputs`` at each of ``counts`` (``num_items_in_batch``), without gradients,
    in eval mode, the RNG put back; ``None`` where a call fails (a forward that takes no count)."""
    training, state = model.training, rng_state()
    model.eval()
    items = [None if n is None else torch.tensor(n) for n in counts]
    try:
        with torch.no_grad():
            if compute_loss is not None:
                return [_loss_of(compute_loss(model, dict(inputs), num_items_in_batch=n)) for n in items]
            if compute_loss_func is None:
                return [getattr(model(**inputs, num_items_in_batch=n), "loss", None) for n in items]
            # as the Trainer calls it: the labels apart from the forward's inputs
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            return [compute_loss_func(outputs, inputs["labels"], num_items_in_batch=n) for n in items]
    except Exception:  # noqa: BLE001 - a forward that takes no count: the Trainer's choice stands
        return None
    finally:
        model.train(training)
        set_rng_state(state)


def _a_loss(loss: Any) -> bool:
    return isinstance(loss, torch.Tensor) and bool(torch.isfinite(loss).all()) and bool(loss.any())


def _loss_of(result: Any) -> Any:
    """The loss of what a ``compute_loss`` returns (``(loss, outputs)`` where it returns both)."""
    return result[0] if isinstance(result, tuple) else result
