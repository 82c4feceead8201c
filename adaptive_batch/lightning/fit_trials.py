"""The probe's trials as Lightning's fit loop runs a step, and what they must leave as they found it.

A trial is one optimizer step of the module's own ``training_step`` through the strategy (the
precision context, its ``backward`` hook), at a worst-case batch. Under several processes each
rank probes its own device, so the ranks run different numbers of trials: a trial must then run
no collective, or a rank would wait in one the others never reach
(:func:`trials_on_this_rank_alone`).
"""

from contextlib import contextmanager
import functools
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from lightning.pytorch.strategies import ddp
from lightning.pytorch.trainer.call import _call_strategy_hook

from adaptive_batch.batch_tensors import tensors_of
from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.schedule.global_batch import micro_batches_per_trial


@contextmanager
def trials_on_this_rank_alone(trainer: Trainer) -> Iterator[None]:
    """Runs the trials inside the block on this rank's module alone, where the fit runs on
    several processes: the module bare instead of inside ``DistributedDataParallel`` (whose
    backward all-reduces the gradients), each ``SyncBatchNorm`` over a group of this rank alone
    (its forward gathers the batch statistics of every rank), and the DDP strategy's reduce and
    barrier this rank's own (``self.log(..., sync_dist=True)`` reduces over the ranks at every
    step). The memory of a step is the same; the buckets DDP made when it wrapped the module are
    there already. One process: as it is.
    """
    strategy = trainer.strategy
    if trainer.world_size == 1:
        yield
        return
    module = strategy.lightning_module
    norms: List[nn.SyncBatchNorm] = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]
    groups = [norm.process_group for norm in norms]
    for norm in norms:  # every rank holds the same module, so every rank asks for the group, as it must
        norm.process_group = _this_rank_alone(trainer.world_size)
    wrapped, strategy.model = strategy.model, module
    # The reduce's collective, not the strategy's method: self.log() keeps the method with what it
    # logged, and a key logged again with another one is refused ("twice with different arguments").
    synced, ddp._sync_ddp_if_available = ddp._sync_ddp_if_available, lambda tensor, *args, **kwargs: tensor
    strategy.barrier = lambda *args, **kwargs: None  # an instance attribute over the method
    try:
        yield
    finally:
        ddp._sync_ddp_if_available = synced
        del strategy.barrier
        strategy.model = wrapped
        for norm, group in zip(norms, groups):
            norm.process_group = group


@functools.lru_cache(maxsize=None)
def _this_rank_alone(world_size: int) -> Any:
    """A process group of this rank alone, made once a process (every rank makes every group)."""
    alone, _ = dist.new_subgroups(group_size=1)
    return alone


@contextmanager
def trials_leave_no_trace(trainer: Trainer) -> Iterator[None]:
    """Puts back what the trials may change beyond the model, optimizer, scheduler and RNG (which
    the probe's snapshot puts back): the precision plugin's state (a GradScaler's scale, halved by
    an overflowing trial under manual optimization), and the loggers, swapped for a dummy one so
    that a callback's hook run by a trial's backward writes nothing to the run's logs."""
    precision, loggers = trainer.precision_plugin.state_dict(), trainer.loggers
    trainer.loggers = [DummyLogger()] if loggers else []
    try:
        yield
    finally:
        trainer.loggers = loggers
        trainer.precision_plugin.load_state_dict(precision)


def batches_the_loop_prefetches(trainer: Trainer, module: LightningModule) -> int:
    """The batches Lightning's fit loop holds in the step's memory beside the step's own, once
    the loop has set up its data. Its fetcher reads ahead where the loader has no length (a
    streamed ``IterableDataset`` with no integer ``limit_train_batches``), to know the last
    batch; a loader with one is not read ahead, and a ``training_step`` that takes the
    ``dataloader_iter`` fetches for itself. On the CPU that is the step's memory; on a card the
    next batch waits on the host until its own step."""
    fetcher = trainer.fit_loop._data_fetcher
    if module.device.type != "cpu" or not isinstance(fetcher, _PrefetchDataFetcher) or fetcher.length is not None:
        return 0
    return fetcher.prefetch_batches


def training_step_of(trainer: Trainer, module: LightningModule, optimizer: Optional[torch.optim.Optimizer],
                     global_batch_size: Optional[int] = None, *,
                     grow_with_accumulation: bool = False, prefetched: int = 0) -> Callable[[Any], None]:
    """One optimizer step as the fit loop runs it: the trainer's precision context around the
    module's ``training_step``, its ``backward`` through the strategy, clipping, the step and
    ``zero_grad``; two micro-batches first where the trainer accumulates (or the global batch,
    or growth, will be accumulated). Under manual optimization the module's ``training_step`` is
    the whole step. Copies of every tensor of the batch stand for the ``prefetched`` batches the
    loop holds through it (:func:`batches_the_loop_prefetches`), in the precision's input dtype
    (the loop's are as the loader made them)."""
    accumulate = int(trainer.accumulate_grad_batches)

    def step(batch: Any) -> None:
        fetched = [tensor.clone() for _ in range(prefetched) for tensor in tensors_of(batch)]
        # Through the strategy, as the fit loop calls it: the precision context, and the hook's
        # name set so that the module's self.log() works.
        if not module.automatic_optimization:
            _call_strategy_hook(trainer, "training_step", batch, 0)
            del fetched
            return
        pieces = micro_batches_per_trial(BatchLayout().rows(batch), gradient_accumulation_steps=accumulate,
                                         global_batch_size=global_batch_size,
                                         grow_with_accumulation=grow_with_accumulation)
        for _ in range(pieces):
            out = _call_strategy_hook(trainer, "training_step", batch, 0)
            loss = out["loss"] if isinstance(out, dict) else out
            if loss is not None:  # None: the loop skips the step's backward too
                trainer.strategy.backward(loss / pieces, optimizer)
        if trainer.gradient_clip_val:
            torch.nn.utils.clip_grad_norm_(module.parameters(), float(trainer.gradient_clip_val))
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del fetched

    return step
