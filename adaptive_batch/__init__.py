"""adaptive-batch: find the largest batch that fits before training, grow it while training,
for torchtune recipes."""

from adaptive_batch.accumulation import (
    accumulate_gradients,
    AccumulatedStep,
    batch_rows,
    micro_batch_sizes,
    MicroBatchOutOfMemoryError,
    split_batch,
)
from adaptive_batch.batch_state import BATCH_STATE_KEY, BatchState, ResizableBatchSampler
from adaptive_batch.checkpoint import initial_checkpoint_filename, write_random_init_checkpoint
from adaptive_batch.config_checks import (
    AdaptiveBatchOptions,
    check_adaptive_batch_options,
    check_bool,
    check_known_keys,
    check_stock_recipe_options,
    check_token_batch_options,
    ConfigError,
    default_safety_margin,
    TokenBatchOptions,
)
from adaptive_batch.data import pydoc_paragraphs, pydoc_text_dataset
from adaptive_batch.estimator import LinearMemoryEstimate
from adaptive_batch.growth import (
    BatchIncreaseFunctionError,
    check_growth_options,
    double_every_epoch,
    grow_batch_size,
    GrowthDecision,
    GrowthOptions,
    linear_ramp,
    multiply_every,
    resolve_batch_increase_function,
    step_increments,
)
from adaptive_batch.lengths import sample_lengths
from adaptive_batch.lr_scaling import BatchLRScaler, lr_scale_factor
from adaptive_batch.loss import next_token_loss
from adaptive_batch.lr_progress import SampleProgressLR
from adaptive_batch.memory import (
    address_space_limit,
    device_capacity,
    device_name,
    DeviceCapacity,
    format_bytes,
    parse_memory,
    return_freed_memory_to_os,
)
from adaptive_batch.oom import is_oom_error, release_memory
from adaptive_batch.ranks import (
    LockstepTrial,
    MAX_MEMORY_ENV,
    PeerOutOfMemoryError,
    per_rank_increase,
    rank_max_memory,
    RankGroup,
)
from adaptive_batch.planner import MemoryPlan, plan_memory, PlanRow
from adaptive_batch.plot import plot_probe_report
from adaptive_batch.probe_cache import cache_key, default_cache_dir, library_versions, ProbeCache
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
from adaptive_batch.search import (
    BatchSizeTooLargeError,
    round_batch_size,
    search_max_batch_size,
    SearchResult,
    Trial,
)
from adaptive_batch.snapshot import TrainingStateSnapshot
from adaptive_batch.token_batching import (
    check_token_budget,
    pack_by_tokens,
    TokenBudgetBatchSampler,
    truncating_collate,
)
from adaptive_batch.throughput import (
    choose_by_throughput,
    probe_throughput,
    throughput_candidates,
    ThroughputChoice,
    ThroughputTrial,
)
from adaptive_batch.tokenizer import byte_tokenizer, ByteTokenizer
from adaptive_batch.tracker import LiveTensorCounter, live_tensor_bytes, measure_peak_bytes

__all__ = [
    "AccumulatedStep",
    "BATCH_STATE_KEY",
    "BatchIncreaseFunctionError",
    "BatchState",
    "GrowthDecision",
    "GrowthOptions",
    "MicroBatchOutOfMemoryError",
    "ResizableBatchSampler",
    "SampleProgressLR",
    "ProbeCache",
    "ThroughputChoice",
    "ThroughputTrial",
    "cache_key",
    "choose_by_throughput",
    "default_cache_dir",
    "device_name",
    "library_versions",
    "plot_probe_report",
    "probe_throughput",
    "throughput_candidates",
    "MemoryPlan",
    "PlanRow",
    "plan_memory",
    "next_token_loss",
    "accumulate_gradients",
    "batch_rows",
    "check_growth_options",
    "double_every_epoch",
    "grow_batch_size",
    "linear_ramp",
    "micro_batch_sizes",
    "multiply_every",
    "resolve_batch_increase_function",
    "split_batch",
    "step_increments",
    "BatchLRScaler",
    "TokenBatchOptions",
    "TokenBudgetBatchSampler",
    "check_token_batch_options",
    "check_token_budget",
    "lr_scale_factor",
    "pack_by_tokens",
    "sample_lengths",
    "truncating_collate",
    "AdaptiveBatchOptions",
    "BatchSizeTooLargeError",
    "ByteTokenizer",
    "ConfigError",
    "DeviceCapacity",
    "LinearMemoryEstimate",
    "LiveTensorCounter",
    "MemoryBudget",
    "PROBE_FILENAME",
    "PROBE_STATE_KEY",
    "SearchResult",
    "TrainingStateSnapshot",
    "Trial",
    "address_space_limit",
    "byte_tokenizer",
    "check_adaptive_batch_options",
    "check_bool",
    "check_known_keys",
    "check_stock_recipe_options",
    "default_safety_margin",
    "describe_result",
    "device_capacity",
    "format_bytes",
    "is_oom_error",
    "live_tensor_bytes",
    "measure_peak_bytes",
    "memory_budget",
    "parse_memory",
    "probe_max_batch_size",
    "probe_report",
    "pydoc_paragraphs",
    "pydoc_text_dataset",
    "release_memory",
    "return_freed_memory_to_os",
    "round_batch_size",
    "search_max_batch_size",
    "training_state_bytes",
    "worst_case_text_batch",
    "write_probe_report",
    "initial_checkpoint_filename",
    "LockstepTrial",
    "MAX_MEMORY_ENV",
    "PeerOutOfMemoryError",
    "per_rank_increase",
    "rank_max_memory",
    "RankGroup",
    "write_random_init_checkpoint",
]
