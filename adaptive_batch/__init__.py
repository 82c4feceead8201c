"""adaptive-batch: find the largest batch that fits before training, grow it while training,
keep the learning rate right as it changes.

The core imports torch alone. The torchtune integration (embedded tokenizer and data, config
adapter, planner for configs) is :mod:`adaptive_batch.torchtune`; the recipes are in the
``recipes/`` folder of the repository (installed as ``adaptive_batch_recipes``).

Layout, from the entry points down:

- :mod:`~adaptive_batch.api`: ``find_max_batch_size``, the probe for a
  plain PyTorch loop.
- :mod:`~adaptive_batch.controller`: ``AdaptiveBatchController``, the decisions a recipe
  delegates, and ``AdaptiveBatchOptions``.
- :mod:`~adaptive_batch.probing`: the probe as one service (budget, cache, ranks, throughput,
  report); :mod:`~adaptive_batch.probe` and :mod:`~adaptive_batch.search`: real steps and the
  search over them; :mod:`~adaptive_batch.estimator`, :mod:`~adaptive_batch.tracker`,
  :mod:`~adaptive_batch.snapshot`, :mod:`~adaptive_batch.probe_cache`,
  :mod:`~adaptive_batch.throughput`.
- :mod:`~adaptive_batch.batching`: fixed-sample or token-budget batches;
  :mod:`~adaptive_batch.batch_state`, :mod:`~adaptive_batch.token_batching`,
  :mod:`~adaptive_batch.growth`, :mod:`~adaptive_batch.interval`,
  :mod:`~adaptive_batch.global_batch`, :mod:`~adaptive_batch.accumulation`,
  :mod:`~adaptive_batch.lr_scaling`, :mod:`~adaptive_batch.lr_progress`.
- :mod:`~adaptive_batch.step_checkpoint`: checkpoints every N steps, exact mid-epoch resume.
- :mod:`~adaptive_batch.ranks`: what data-parallel ranks agree on.
- :mod:`~adaptive_batch.memory`, :mod:`~adaptive_batch.oom`, :mod:`~adaptive_batch.validation`:
  leaves.
"""

from adaptive_batch.accumulation import (
    accumulate_gradients,
    AccumulatedStep,
    batch_rows,
    micro_batch_sizes,
    MicroBatchOutOfMemoryError,
    split_batch,
)
from adaptive_batch.api import find_max_batch_size
from adaptive_batch.batch_state import BATCH_STATE_KEY, BatchState, ResizableBatchSampler
from adaptive_batch.batching import SampleBatches, TokenBatches
from adaptive_batch.controller import AdaptiveBatchController, AdaptiveBatchOptions, StepOutcome
from adaptive_batch.estimator import LinearMemoryEstimate
from adaptive_batch.global_batch import fastest_split, GlobalBatchOptions, MicroBatchPlan, split_global_batch
from adaptive_batch.growth import (
    BatchIncreaseFunctionError,
    double_every_epoch,
    grow_batch_size,
    GrowthDecision,
    GrowthOptions,
    GrowthStatistics,
    linear_ramp,
    linear_rampup,
    multiply_every,
    resolve_batch_increase_function,
    seesaw,
    step_increments,
)
from adaptive_batch.interval import GrowthInterval, parse_interval
from adaptive_batch.lengths import sample_lengths
from adaptive_batch.lr_progress import SampleProgressLR
from adaptive_batch.lr_scaling import BatchLRScaler, lr_scale_factor, LRScalingOptions
from adaptive_batch.noise_scale import (
    estimate_noise,
    GradientNoiseScale,
    noise_scale_growth,
    NoiseScaleOptions,
)
from adaptive_batch.memory import (
    address_space_limit,
    device_capacity,
    device_name,
    DeviceCapacity,
    format_bytes,
    parse_memory,
    return_freed_memory_to_os,
    use_expandable_segments,
)
from adaptive_batch.oom import is_oom_error, release_memory
from adaptive_batch.planner import MemoryPlan, plan_memory, PlanRow
from adaptive_batch.plot import plot_probe_report
from adaptive_batch.probe import (
    describe_result,
    memory_budget,
    MemoryBudget,
    PROBE_FILENAME,
    PROBE_STATE_KEY,
    probe_max_batch_size,
    probe_report,
    training_state_bytes,
    worst_case_text_batch,
    write_probe_report,
)
from adaptive_batch.probe_cache import cache_key, default_cache_dir, library_versions, ProbeCache
from adaptive_batch.probing import default_safety_margin, probe_batch_size, ProbeOptions, save_probe_report
from adaptive_batch.ranks import (
    LockstepTrial,
    MAX_MEMORY_ENV,
    PeerOutOfMemoryError,
    per_rank_increase,
    rank_max_memory,
    RankGroup,
)
from adaptive_batch.search import (
    BatchSizeTooLargeError,
    round_batch_size,
    search_max_batch_size,
    SearchResult,
    Trial,
)
from adaptive_batch.snapshot import TrainingStateSnapshot
from adaptive_batch.step_checkpoint import (
    LR_SCHEDULER_KEY,
    rng_state,
    RNG_KEY,
    set_rng_state,
    StepCheckpoints,
)
from adaptive_batch.throughput import (
    choose_by_throughput,
    probe_throughput,
    throughput_candidates,
    ThroughputChoice,
    ThroughputTrial,
)
from adaptive_batch.token_batching import (
    check_token_budget,
    pack_by_tokens,
    TokenBatchOptions,
    TokenBudgetBatchSampler,
    truncating_collate,
)
from adaptive_batch.tracker import LiveTensorCounter, live_tensor_bytes, measure_peak_bytes
from adaptive_batch.validation import check_bool, check_known_keys, ConfigError

__all__ = [
    "fastest_split",
    "GlobalBatchOptions",
    "GrowthInterval",
    "linear_rampup",
    "noise_scale_growth",
    "NoiseScaleOptions",
    "GradientNoiseScale",
    "estimate_noise",
    "LR_SCHEDULER_KEY",
    "MicroBatchPlan",
    "parse_interval",
    "rng_state",
    "RNG_KEY",
    "seesaw",
    "set_rng_state",
    "split_global_batch",
    "StepCheckpoints",
    "AccumulatedStep",
    "AdaptiveBatchController",
    "AdaptiveBatchOptions",
    "BATCH_STATE_KEY",
    "BatchIncreaseFunctionError",
    "BatchLRScaler",
    "BatchSizeTooLargeError",
    "BatchState",
    "ConfigError",
    "DeviceCapacity",
    "GrowthDecision",
    "GrowthOptions",
    "GrowthStatistics",
    "LRScalingOptions",
    "LinearMemoryEstimate",
    "LiveTensorCounter",
    "LockstepTrial",
    "MAX_MEMORY_ENV",
    "MemoryBudget",
    "MemoryPlan",
    "MicroBatchOutOfMemoryError",
    "PROBE_FILENAME",
    "PROBE_STATE_KEY",
    "PeerOutOfMemoryError",
    "PlanRow",
    "ProbeCache",
    "ProbeOptions",
    "RankGroup",
    "ResizableBatchSampler",
    "SampleBatches",
    "SampleProgressLR",
    "SearchResult",
    "StepOutcome",
    "ThroughputChoice",
    "ThroughputTrial",
    "TokenBatchOptions",
    "TokenBatches",
    "TokenBudgetBatchSampler",
    "TrainingStateSnapshot",
    "Trial",
    "accumulate_gradients",
    "address_space_limit",
    "batch_rows",
    "cache_key",
    "check_bool",
    "check_known_keys",
    "check_token_budget",
    "choose_by_throughput",
    "default_cache_dir",
    "default_safety_margin",
    "describe_result",
    "device_capacity",
    "device_name",
    "double_every_epoch",
    "find_max_batch_size",
    "format_bytes",
    "grow_batch_size",
    "is_oom_error",
    "library_versions",
    "linear_ramp",
    "live_tensor_bytes",
    "lr_scale_factor",
    "measure_peak_bytes",
    "memory_budget",
    "micro_batch_sizes",
    "multiply_every",
    "pack_by_tokens",
    "parse_memory",
    "per_rank_increase",
    "plan_memory",
    "plot_probe_report",
    "probe_batch_size",
    "probe_max_batch_size",
    "probe_report",
    "probe_throughput",
    "rank_max_memory",
    "release_memory",
    "resolve_batch_increase_function",
    "return_freed_memory_to_os",
    "use_expandable_segments",
    "round_batch_size",
    "sample_lengths",
    "save_probe_report",
    "search_max_batch_size",
    "split_batch",
    "step_increments",
    "throughput_candidates",
    "training_state_bytes",
    "truncating_collate",
    "worst_case_text_batch",
    "write_probe_report",
]
