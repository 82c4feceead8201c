"""adaptive-batch: find the largest batch that fits before training, grow it while training,
keep the learning rate right as it changes.

The core imports torch alone; :mod:`adaptive_batch.torchtune` holds the torchtune glue, and the
repository's ``recipes/`` folder (installed as ``adaptive_batch_recipes``) the recipes. The
subpackages, in the order they import each other (each imports only those before it):

- :mod:`~adaptive_batch.logs`: the ``adaptive_batch`` logger (standard ``logging``, rank 0's lines).
- :mod:`~adaptive_batch.errors`, :mod:`~adaptive_batch.faults`, :mod:`~adaptive_batch.files`,
  :mod:`~adaptive_batch.validation`, :mod:`~adaptive_batch.rng`: every error, the named points
  where tests kill a run, files written whole and the output directory's lock, value checks,
  the one RNG capture.
- :mod:`~adaptive_batch.memory`: what a device holds, measuring a step, recognising OOM.
- :mod:`~adaptive_batch.distributed`: what data-parallel ranks agree on.
- :mod:`~adaptive_batch.schedule`: pure policy: how the batch, LR and weight decay change.
- :mod:`~adaptive_batch.probe`: real trial steps, the search, the plan, the probe's two
  entry points (:func:`find_max_batch_size` and :func:`probe_batch_size`).
- :mod:`~adaptive_batch.data`: batch samplers, fixed-sample and token-budget.
- :mod:`~adaptive_batch.run`: a training run's decisions (``run.session.BatchSession``, told of
  each epoch and step, executing nothing), the recipes' adapter over them
  (:class:`AdaptiveBatchController`), :class:`AdaptiveBatch` for a plain loop; steps in
  micro-batches; step checkpoints.
- :mod:`~adaptive_batch.torchtune`: config adapter, tokenizer, data, planner for configs, CLI.

This module exports the names a user needs; everything else is reached through its
subpackage.
"""

from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.distributed import RankGroup
from adaptive_batch.errors import (
    BatchIncreaseFunctionError,
    BatchSizeTooLargeError,
    CheckpointWriteError,
    ConfigError,
    MicroBatchOutOfMemoryError,
    PeerOutOfMemoryError,
    RunStopped,
)
from adaptive_batch.memory.device import parse_memory
from adaptive_batch.memory.oom import is_oom_error
from adaptive_batch.probe.api import find_max_batch_size
from adaptive_batch.probe.plan import MemoryPlan, plan_memory
from adaptive_batch.probe.service import ProbeOptions, probe_batch_size
from adaptive_batch.run.controller import AdaptiveBatchController, StepOutcome
from adaptive_batch.run.loop import AdaptiveBatch
from adaptive_batch.run.options import AdaptiveBatchOptions
from adaptive_batch.run.state import RunState
from adaptive_batch.run.step_checkpoints import StepCheckpoints
from adaptive_batch.schedule.growth import (
    GrowthStatistics,
    double_every_epoch,
    linear_ramp,
    linear_rampup,
    multiply_every,
    seesaw,
    step_increments,
)
from adaptive_batch.schedule.noise_scale import noise_scale_growth

__all__ = [
    # the run: a plain loop's wrapper, the recipes' facade, options, state
    "AdaptiveBatch",
    "AdaptiveBatchController",
    "AdaptiveBatchOptions",
    "StepOutcome",
    "BatchLayout",
    "RunState",
    "StepCheckpoints",
    "RankGroup",
    # the probe and the plan
    "find_max_batch_size",
    "probe_batch_size",
    "ProbeOptions",
    "plan_memory",
    "MemoryPlan",
    "parse_memory",
    "is_oom_error",
    # growth functions configs name (batch_increase_function)
    "double_every_epoch",
    "multiply_every",
    "linear_ramp",
    "step_increments",
    "linear_rampup",
    "seesaw",
    "noise_scale_growth",
    "GrowthStatistics",
    # errors
    "ConfigError",
    "BatchSizeTooLargeError",
    "BatchIncreaseFunctionError",
    "MicroBatchOutOfMemoryError",
    "PeerOutOfMemoryError",
    "CheckpointWriteError",
    "RunStopped",
]
