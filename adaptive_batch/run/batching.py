"""How a step's batch is made: a number of samples, or a budget of padded tokens.

The choice is made once, as an object, and the controller asks it everything that differs
between the two: how many samples an epoch has, which sampler builds the batches, how long the
LR schedule is and whether it counts samples, and what a probe result means for the batch.

- :class:`SampleBatches`: torchtune's ``batch_size`` (x ``gradient_accumulation_steps``)
  samples a step. Growth may change it between epochs; the LR schedule advances by samples.
- :class:`TokenBatches`: samples packed until their padded size reaches ``max_tokens``
  (DeepSpeed's variable batch size); the LR schedule keeps torchtune's count of steps.
"""

from typing import Any, Callable, List, Optional, Sequence

from torch.utils.data import Sampler
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from adaptive_batch.data.samplers import ResizableBatchSampler
from adaptive_batch.run.progress import BatchProgress
from adaptive_batch.data.token_budget import (
    TokenBatchOptions,
    TokenBudgetBatchSampler,
    check_token_budget,
    truncating_collate,
)
from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.probe.report import ProbeReport


class SampleBatches:
    """A fixed number of samples a step, which growth may change between epochs."""

    uses_token_budget = False
    counts_lr_in_samples = True

    def adopt_probe(self, report: ProbeReport, seq_len: int) -> bool:
        """Nothing to take from a probe report beyond its batch size; returns ``False``."""
        return False

    def prepare(self, lengths: Optional[List[int]]) -> None:
        """Sample lengths play no part."""

    def max_micro_batch_size(self, micro_batch_size: int, dataset_size: int) -> int:
        return micro_batch_size

    def samples_per_epoch(self, dataset_size: int, step_samples: int, max_steps_per_epoch: Optional[int]) -> int:
        """The dataset, or ``max_steps_per_epoch`` steps at the starting batch (so the number
        of steps shrinks, not the samples, as the batch grows)."""
        if max_steps_per_epoch is None:
            return dataset_size
        return min(dataset_size, max_steps_per_epoch * step_samples)

    def batch_sampler(self, dataset: Sequence[Any], batch: BatchProgress, ranks: RankGroup, shuffle: bool) -> Sampler:
        sampler = StatefulDistributedSampler(
            dataset, num_replicas=ranks.world_size, rank=ranks.rank, shuffle=shuffle, seed=0
        )
        return ResizableBatchSampler(sampler, batch_size=batch.batch_size, samples_per_epoch=batch.samples_per_epoch)

    def collate(self, collate_fn: Callable) -> Callable:
        return collate_fn

    def lr_schedule_steps(self, epochs: int, batch: BatchProgress, steps_per_epoch: int) -> float:
        """In steps at the starting batch, so the schedule ends with the last sample."""
        return epochs * batch.samples_per_epoch / batch.initial_batch_size

    def lr_last_epoch(self, global_step: int) -> int:
        """The progress is set from samples seen, so the scheduler starts afresh."""
        return -1

    def start_epoch(self, sampler: Any, batch: BatchProgress, epoch: int) -> None:
        sampler.batch_size = batch.batch_size
        sampler.set_epoch(epoch)
        if batch.grad_accum_steps > 1:
            logs.info(
                f"Epoch {epoch}: {batch.batch_size} samples a step in "
                f"{batch.grad_accum_steps} micro-batches of up to {batch.micro_batch_size}."
            )

    def steps_per_epoch(self, num_batches: int, max_steps_per_epoch: Optional[int]) -> int:
        """``samples_per_epoch`` already stops the epoch."""
        return num_batches

    def resize(self, sampler: Any, batch: BatchProgress) -> None:
        """The next batch takes the batch size growth decided."""
        sampler.batch_size = batch.batch_size


class TokenBatches:
    """Batches packed to a budget of padded tokens.

    Args:
        options: the token-budget settings.
        max_batch_size: the most samples in a batch, or ``None``.

    Attributes:
        lengths: every sample's length in tokens, set before the sampler is built.
    """

    uses_token_budget = True
    counts_lr_in_samples = False

    def __init__(self, options: TokenBatchOptions, max_batch_size: Optional[int], input_key: str) -> None:
        self.options, self.input_key = options, input_key
        self.max_tokens: int = options.max_tokens
        self.max_batch_size = max_batch_size
        self.lengths: List[int] = []

    def adopt_probe(self, report: ProbeReport, seq_len: int) -> bool:
        """The budget becomes the probed batch in full-length rows: any batch with as many
        padded tokens fits. Returns whether the report gained ``max_tokens``."""
        added = report.max_tokens is None  # a new probe or a cached one
        if added:
            report.max_tokens = report.batch_size * seq_len
        self.max_tokens = report.max_tokens
        logs.info(f"use_maximum_batch_size: training with max_tokens={self.max_tokens}")
        return added

    def prepare(self, lengths: Optional[List[int]]) -> None:
        """Takes the samples' lengths and checks the budget against them.

        Raises:
            ConfigError: when no lengths are given, the budget cannot hold ``min_batch_size``
                of the longest samples, or a sample is too long under ``long_sample_policy=error``.
        """
        if lengths is None:
            raise ConfigError(f"max_tokens={self.max_tokens} needs every sample's length in tokens.")
        self.lengths = list(lengths)
        try:
            too_long = check_token_budget(
                self.lengths,
                max_tokens=self.max_tokens,
                min_batch_size=self.options.min_batch_size,
                max_batch_size=self.max_batch_size,
                long_sample_policy=self.options.long_sample_policy,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        logs.info(
            f"Token-budget batches: max_tokens={self.max_tokens}, "
            f"{too_long} of {len(self.lengths)} samples longer than that (truncated)."
        )

    def max_micro_batch_size(self, micro_batch_size: int, dataset_size: int) -> int:
        """A token batch runs whole unless it runs out of memory."""
        return dataset_size

    def samples_per_epoch(self, dataset_size: int, step_samples: int, max_steps_per_epoch: Optional[int]) -> int:
        return dataset_size

    def batch_sampler(self, dataset: Sequence[Any], batch: BatchProgress, ranks: RankGroup, shuffle: bool) -> Sampler:
        return TokenBudgetBatchSampler(
            self.lengths,
            max_tokens=self.max_tokens,
            picking_order=self.options.sequence_picking_order,
            shuffle=shuffle,
            seed=0,
            max_batch_size=self.max_batch_size,
            num_replicas=ranks.world_size,
            rank=ranks.rank,
        )

    def collate(self, collate_fn: Callable) -> Callable:
        return truncating_collate(collate_fn, self.max_tokens, self.input_key)

    def lr_schedule_steps(self, epochs: int, batch: BatchProgress, steps_per_epoch: int) -> float:
        return epochs * steps_per_epoch

    def lr_last_epoch(self, global_step: int) -> int:
        return global_step - 1

    def start_epoch(self, sampler: Any, batch: BatchProgress, epoch: int) -> None:
        sampler.set_epoch(epoch)

    def steps_per_epoch(self, num_batches: int, max_steps_per_epoch: Optional[int]) -> int:
        return num_batches if max_steps_per_epoch is None else min(num_batches, max_steps_per_epoch)

    def resize(self, sampler: Any, batch: BatchProgress) -> None:
        """Token batches do not grow."""
