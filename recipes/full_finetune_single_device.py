# torchtune's full_finetune_single_device recipe with adaptive batch size.
#
# Launch from the repository root (PYTHONPATH puts this `recipes` package before the one
# torchtune's wheel installs):
#   PYTHONPATH=. tune run recipes/full_finetune_single_device.py \
#       --config configs/tiny/full_single_device.yaml use_maximum_batch_size=True

import math
import sys
import time
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torch.optim import Optimizer
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training import DummyProfiler, PROFILER_KEY
from torchtune.training.lr_schedulers import get_lr
from tqdm import tqdm

import adaptive_batch as ab
from adaptive_batch.tracker import peak_rss_bytes, reset_peak_rss

log = utils.get_logger("DEBUG")

# Every top-level key this recipe reads; anything else is a typo (`batch_sise=8`).
KNOWN_KEYS = frozenset(
    {
        "output_dir", "model", "tokenizer", "dataset", "seed", "shuffle", "checkpointer",
        "resume_from_checkpoint", "batch_size", "epochs", "optimizer", "loss", "lr_scheduler",
        "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer_in_bwd",
        "clip_grad_norm", "compile", "device", "enable_activation_checkpointing",
        "enable_activation_offloading", "dtype", "metric_logger", "log_every_n_steps",
        "log_peak_memory_stats", "profiler", "collate_fn", "cudnn_deterministic_mode",
        # adaptive batch size
        "use_maximum_batch_size", "max_memory", "memory_safety_margin",
        "batch_size_rounding", "max_batch_size", "batch_size_objective", "throughput_tolerance",
        "probe_cache", "probe_cache_dir", "plot",
        # online growth
        "batch_increase_function", "grow_with_accumulation", "retry_on_oom",
        # token-budget batches and LR scaling
        "max_tokens", "sequence_picking_order", "min_batch_size", "long_sample_policy",
        "lr_scaling", "lr_scaling_unit", "lr_scaling_reference",
    }
)


def _instantiate_increase_function(node: Any) -> Any:
    """A ``_component_`` node with arguments becomes the callable its factory builds; a node
    with only ``_component_`` names the function itself; a path string stays as is."""
    if not isinstance(node, DictConfig):
        return node
    if set(node.keys()) == {"_component_"}:
        return node._component_
    try:
        return config.instantiate(node)
    except Exception as e:
        raise ab.ConfigError(
            f"batch_increase_function: building {node.get('_component_')!r} with "
            f"{ {k: v for k, v in node.items() if k != '_component_'} } failed: {e}"
        ) from None


class FullFinetuneRecipeSingleDevice(FTRecipeInterface):
    """Full finetuning on one device, with the batch size found before training.

    torchtune's single-device full-finetune recipe (activation checkpointing, bf16/fp32,
    gradient accumulation, optimizer in backward, checkpointing, metric logging), plus:

        - ``use_maximum_batch_size``: before the first step, real training steps at trial batch
          sizes (every sequence at ``tokenizer.max_seq_len``) find the largest batch whose peak
          stays within ``max_memory`` (or the device) less ``memory_safety_margin``. Model,
          optimizer and RNG state come out of probing untouched. The result is logged, written
          to ``<output_dir>/batch_probe.json`` and kept in the recipe state, so a resumed run
          does not probe again.
        - ``max_batch_size`` caps the probe, ``batch_size_rounding`` can round its result down
          to a power of two.
        - ``batch_increase_function``: ``f(epoch, current_batch_size) -> increment`` grows the
          batch at the start of every epoch, up to the probed maximum (or ``max_batch_size``),
          or past it by gradient accumulation with ``grow_with_accumulation``. The LR schedule
          advances by samples seen, so it ends with the data however the batch grows.
        - Every step runs its batch in micro-batches of at most the largest size that fits;
          with ``retry_on_oom`` a step that runs out of memory is rerun in halves.
        - Token-budget batches (``max_tokens``) and LR scaling with the batch.
        - Batch state in the recipe state: a resumed run continues with the same batch sizes.
        - Per-step ``batch_size``, ``micro_batch_size``, ``grad_accum_steps``,
          ``samples_seen`` and peak memory metrics, on CPU too (the process's peak RSS).

    Args:
        cfg (DictConfig): OmegaConf object parsed from yaml file

    Raises:
        ConfigError: for any bad setting, before the model is built.
    """

    known_keys = KNOWN_KEYS

    def __init__(self, cfg: DictConfig) -> None:
        ab.check_known_keys(cfg.keys(), self.known_keys)
        self._device = utils.get_device(device=cfg.device)
        # One process here; the distributed recipe's ranks, which agree on every batch decision.
        self._ranks = ab.RankGroup(self._device)
        ab.check_stock_recipe_options(
            dtype=cfg.dtype,
            device_type=self._device.type,
            optimizer_in_bwd=cfg.optimizer_in_bwd,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            clip_grad_norm=cfg.get("clip_grad_norm", None),
            enable_activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
            enable_activation_offloading=cfg.get("enable_activation_offloading", False),
            collate_fn=cfg.get("collate_fn", "torchtune.data.padded_collate_sft"),
            compile_model=cfg.compile,
            use_maximum_batch_size=cfg.get("use_maximum_batch_size", False) is True,
        )
        self._adaptive = ab.check_adaptive_batch_options(
            batch_size=cfg.batch_size,
            use_maximum_batch_size=cfg.get("use_maximum_batch_size", False),
            max_memory=cfg.get("max_memory", None),
            memory_safety_margin=cfg.get("memory_safety_margin", None),
            batch_size_rounding=cfg.get("batch_size_rounding", "none"),
            max_batch_size=cfg.get("max_batch_size", None),
            batch_size_objective=cfg.get("batch_size_objective", "max_fit"),
            throughput_tolerance=cfg.get("throughput_tolerance", 0.02),
            probe_cache=cfg.get("probe_cache", True),
            probe_cache_dir=cfg.get("probe_cache_dir", None),
            plot=cfg.get("plot", False),
            device_type=self._device.type,
            device_capacity_bytes=(
                ab.device_capacity(self._device).headroom_bytes
                if self._device.type in ("cpu", "cuda")
                else None
            ),
        )
        dataset_cfg = cfg.dataset if not isinstance(cfg.dataset, ListConfig) else cfg.dataset[0]
        self._tokens = ab.check_token_batch_options(
            max_tokens=cfg.get("max_tokens", None),
            sequence_picking_order=cfg.get("sequence_picking_order", "dataloader"),
            min_batch_size=cfg.get("min_batch_size", 1),
            max_batch_size=cfg.get("max_batch_size", None),
            long_sample_policy=cfg.get("long_sample_policy", "truncate"),
            lr_scaling=cfg.get("lr_scaling", "none"),
            lr_scaling_unit=cfg.get("lr_scaling_unit", "samples"),
            lr_scaling_reference=cfg.get("lr_scaling_reference", None),
            batch_size=cfg.batch_size,
            packed=bool(dataset_cfg.get("packed", False)),
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        )
        self._growth = ab.check_growth_options(
            batch_increase_function=_instantiate_increase_function(cfg.get("batch_increase_function", None)),
            grow_with_accumulation=cfg.get("grow_with_accumulation", False),
            retry_on_oom=cfg.get("retry_on_oom", True),
            max_tokens=self._tokens.max_tokens,
            optimizer_in_bwd=cfg.optimizer_in_bwd,
        )
        if self._adaptive.use_maximum_batch_size or (
            self._growth.batch_increase_function is not None and self._adaptive.max_batch_size is None
        ):
            if self._device.type not in ("cpu", "cuda"):
                raise ab.ConfigError(
                    f"use_maximum_batch_size=True (or a batch_increase_function without "
                    f"max_batch_size) on device={self._device.type!r}: the probe measures memory on "
                    "cpu and cuda only; set use_maximum_batch_size=False and max_batch_size."
                )
            if cfg.tokenizer.get("max_seq_len", None) is None:
                raise ab.ConfigError(
                    "probing the largest batch (use_maximum_batch_size=True, or a "
                    "batch_increase_function without max_batch_size) with tokenizer.max_seq_len=null: the probe runs "
                    "every sequence at that length so no longer batch can run out of memory "
                    "later; set tokenizer.max_seq_len, e.g. tokenizer.max_seq_len=2048."
                )
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)

        # logging attributes
        self._output_dir = cfg.output_dir
        self._log_every_n_steps = cfg.get("log_every_n_steps", 1)
        self._log_peak_memory_stats = cfg.get("log_peak_memory_stats", False)

        # Training cfg
        self._resume_from_checkpoint = cfg.resume_from_checkpoint
        self._gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self._optimizer_in_bwd = cfg.optimizer_in_bwd
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._enable_activation_checkpointing = cfg.get("enable_activation_checkpointing", False)
        self._enable_activation_offloading = cfg.get("enable_activation_offloading", False)
        self._batch_size = cfg.batch_size
        self._max_tokens = self._tokens.max_tokens
        self._probe_report: Optional[Dict[str, Any]] = None
        self._batch_state_dict: Optional[Dict[str, Any]] = None

        # Under an address-space limit glibc's cache of freed blocks would count against it.
        if self._device.type == "cpu" and ab.address_space_limit() is not None:
            ab.return_freed_memory_to_os()

        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0

    def load_checkpoint(self, cfg_checkpointer: DictConfig) -> Dict[str, Any]:
        """
        Extract the checkpoint state from file and validate. If resume_from_checkpoint
        is True, this also includes the recipe state.
        """
        self._checkpointer = config.instantiate(
            cfg_checkpointer,
            should_load_recipe_state=self._resume_from_checkpoint,
        )
        checkpoint_dict = self._checkpointer.load_checkpoint()

        if self._resume_from_checkpoint:
            self._update_recipe_state(checkpoint_dict)
        return checkpoint_dict

    def _update_recipe_state(self, ckpt_dict: Dict[str, Any]) -> None:
        """
        Updates the recipe state from checkpoint.
        """
        try:
            self.epochs_run = ckpt_dict[training.EPOCHS_KEY]
            if self.seed != ckpt_dict[training.SEED_KEY]:
                log.warning(f"Config seed differs from the checkpoint's; using {ckpt_dict[training.SEED_KEY]}")
                self.seed = ckpt_dict[training.SEED_KEY]
            if self.max_steps_per_epoch != ckpt_dict[training.MAX_STEPS_KEY]:
                log.warning("Config max_steps_per_epoch differs from the checkpoint's; using the checkpoint's")
                self.max_steps_per_epoch = ckpt_dict[training.MAX_STEPS_KEY]
        except KeyError as e:
            raise KeyError(
                "Checkpoint does not contain the required keys needed for updating recipe state. "
                "Are you sure you passed in the right recipe checkpoint?"
            ) from e
        # A resumed run keeps the batch size its first run probed, and where growth had got to.
        self._probe_report = ckpt_dict.get(ab.PROBE_STATE_KEY)
        self._batch_state_dict = ckpt_dict.get(ab.BATCH_STATE_KEY)

    def setup(self, cfg: DictConfig) -> None:
        """
        Sets up the recipe state correctly. This includes setting recipe attributes based
        on the ``resume_from_checkpoint`` flag.
        """
        self._metric_logger = None
        if self._ranks.is_main:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)

        if cfg.checkpointer.get("checkpoint_files", None) is None:
            # No weights given: a seeded random initialisation, loaded by the real checkpointer.
            if self._ranks.is_main:
                ab.write_random_init_checkpoint(
                    lambda: config.instantiate(cfg.model),
                    cfg.checkpointer.checkpoint_dir,
                    self.seed,
                    keep=self._is_base_weight,
                )
            self._ranks.barrier()
            cfg.checkpointer.checkpoint_files = [ab.initial_checkpoint_filename(self.seed)]
            log.info(f"No checkpoint_files given: initialised the model randomly with seed {self.seed}.")
        ckpt_dict = self.load_checkpoint(cfg.checkpointer)

        self._compile = cfg.compile
        self._model = self._setup_model(
            cfg_model=cfg.model,
            enable_activation_checkpointing=self._enable_activation_checkpointing,
            enable_activation_offloading=self._enable_activation_offloading,
            compile_model=self._compile,
            model_state_dict=ckpt_dict[training.MODEL_KEY],
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        log.info("Tokenizer is initialized from file.")

        self._optimizer = self._setup_optimizer(
            cfg_optimizer=cfg.optimizer,
            optimizer_in_bwd=cfg.optimizer_in_bwd,
            opt_state_dict=(
                ckpt_dict[training.OPT_KEY] if self._resume_from_checkpoint else None
            ),
        )

        self._loss_fn = config.instantiate(cfg.loss)
        # What changes a step's memory, for the probe cache's key.
        self._probe_cache_fields = {
            "recipe": type(self).__name__,
            "model": OmegaConf.to_container(cfg.model, resolve=True),
            "optimizer": OmegaConf.to_container(cfg.optimizer, resolve=True),
            "loss": OmegaConf.to_container(cfg.loss, resolve=True),
            "dtype": str(self._dtype),
            "activation_checkpointing": self._enable_activation_checkpointing,
            "activation_offloading": self._enable_activation_offloading,
            "compile": bool(cfg.compile),
            "world_size": self._ranks.world_size,
        }
        if self._compile:
            training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        log.info("Loss is initialized.")

        dataset, packed = self._setup_dataset(cfg.dataset)

        lengths = None
        if self._max_tokens is not None:
            lengths = ab.sample_lengths(
                dataset,
                cache_dir=f"{self._output_dir}/seqlen_cache",
                key={"dataset": OmegaConf.to_container(cfg.dataset), "tokenizer": OmegaConf.to_container(cfg.tokenizer)},
                log=log.info,
            )

        # The batch size (or token budget) is settled before the dataloader is built with it.
        # Each rank trains on its share of the data (the sampler pads it to equal shares).
        rank_dataset_size = math.ceil(len(dataset) / self._ranks.world_size)
        batch_size, max_micro_batch_size = self._settle_batch_size(dataset_size=rank_dataset_size)

        if lengths is not None:
            try:
                too_long = ab.check_token_budget(
                    lengths,
                    max_tokens=self._max_tokens,
                    min_batch_size=self._tokens.min_batch_size,
                    max_batch_size=self._adaptive.max_batch_size,
                    long_sample_policy=self._tokens.long_sample_policy,
                )
            except ValueError as e:
                raise ab.ConfigError(str(e)) from None
            log.info(
                f"Token-budget batches: max_tokens={self._max_tokens}, "
                f"{too_long} of {len(lengths)} samples longer than that (truncated)."
            )

        # One dataloader batch is one optimizer step's global batch; micro-batches split it.
        self._batch = ab.BatchState(
            batch_size=batch_size,
            max_micro_batch_size=max_micro_batch_size if lengths is None else len(dataset),
            grow_with_accumulation=self._growth.grow_with_accumulation,
            samples_per_epoch=self._samples_per_epoch(rank_dataset_size, batch_size),
        )
        if self._batch_state_dict is not None:
            self._batch.load_state_dict(self._batch_state_dict)
            log.info(f"Resumed run: batch state from the recipe state: {self._batch.state_dict()}")
        self.global_step = self._batch.global_step

        self._dataloader = self._setup_dataloader(
            dataset,
            packed=packed,
            shuffle=cfg.shuffle,
            collate_fn=cfg.get("collate_fn", "torchtune.data.padded_collate_sft"),
            lengths=lengths,
        )

        # Fixed-size batches count the schedule in samples, so it ends with the last sample
        # however the batch grows; token batches keep torchtune's count of steps.
        if lengths is None:
            num_training_steps = self.total_epochs * self._batch.samples_per_epoch / self._batch.initial_batch_size
        else:
            num_training_steps = self.total_epochs * self._token_steps_per_epoch()
        self._lr_scheduler = self._setup_lr_scheduler(
            cfg_lr_scheduler=cfg.get("lr_scheduler", None),
            num_training_steps=num_training_steps,
            last_epoch=-1 if lengths is None else self.global_step - 1,
        )
        self._lr_progress = None
        if self._lr_scheduler is not None and lengths is None:
            try:
                self._lr_progress = ab.SampleProgressLR(self._lr_scheduler, self._batch.initial_batch_size)
            except TypeError as e:
                raise ab.ConfigError(f"lr_scheduler: {e}") from None
            self._lr_progress.set_progress(self._batch.samples_seen)
        self._lr_scaler = None
        if self._tokens.lr_scaling != "none":
            self._lr_scaler = ab.BatchLRScaler(
                self._optimizer,
                rule=self._tokens.lr_scaling,
                reference=self._tokens.lr_scaling_reference,
                unit=self._tokens.lr_scaling_unit,
                lr_scheduler=self._lr_progress or self._lr_scheduler,
            )
        self._profiler = self._setup_profiler(cfg.get(PROFILER_KEY, None))

    def _settle_batch_size(self, dataset_size: int) -> Tuple[int, int]:
        """The global batch to start with and the largest micro-batch.

        Without growth the micro-batch is the probed maximum when probing, else ``batch_size``,
        and the global batch ``gradient_accumulation_steps`` of them. With a batch increase
        function ``batch_size`` x ``gradient_accumulation_steps`` is the starting global batch
        and the probed maximum (or ``max_batch_size``) the largest micro-batch.
        """
        growing = self._growth.batch_increase_function is not None
        if self._probe_report is not None:
            log.info(f"Resumed run: using the probed batch_size={self._probe_report['batch_size']} from the recipe state.")
        elif self._adaptive.use_maximum_batch_size or (growing and self._adaptive.max_batch_size is None):
            if not self._adaptive.use_maximum_batch_size:
                log.info(
                    "batch_increase_function without max_batch_size: probing for the largest batch "
                    "that fits, as the bound of the growth."
                )
            self._probe_batch_size(dataset_size=dataset_size)
        if self._probe_report is not None and self._max_tokens is not None:
            if "max_tokens" not in self._probe_report:  # a new probe or a cached one
                # The probe's rows are full-length: any batch with as many padded tokens fits.
                self._probe_report["max_tokens"] = self._probe_report["batch_size"] * self._tokenizer.max_seq_len
                self._write_probe_report()
            self._max_tokens = self._probe_report["max_tokens"]
            log.info(f"use_maximum_batch_size: training with max_tokens={self._max_tokens}")
        accumulation = self._gradient_accumulation_steps
        if not growing:
            if self._probe_report is None:
                return self._batch_size * accumulation, self._batch_size
            micro = self._probe_report["batch_size"]
            log.info(f"use_maximum_batch_size: training with batch_size={micro}")
            return micro * accumulation, micro
        # Growth is bounded by the largest batch that fits, whatever batch the objective chose.
        bound = (
            ab.round_batch_size(self._probe_report["max_batch_size"], self._adaptive.batch_size_rounding)
            if self._probe_report is not None
            else self._adaptive.max_batch_size
        )
        start = self._batch_size * accumulation
        log.info(
            f"batch_increase_function: starting at {start} samples a step, micro-batches of up to "
            f"{bound}; growth "
            + ("may pass it by gradient accumulation." if self._growth.grow_with_accumulation else "stops there.")
        )
        if start > bound and not self._growth.grow_with_accumulation:
            log.warning(
                f"batch_size={self._batch_size} x gradient_accumulation_steps={accumulation} is over "
                f"the largest batch that fits, {bound}: starting at {bound}."
            )
            start = bound
        return start, bound

    def _samples_per_epoch(self, dataset_size: int, micro_batch_size: int) -> int:
        """Samples one epoch trains on: the dataset, or ``max_steps_per_epoch`` steps at the
        starting batch (so the number of steps shrinks, not the samples, as the batch grows)."""
        if self.max_steps_per_epoch is None or self._max_tokens is not None:
            return dataset_size
        steps_samples = self.max_steps_per_epoch * micro_batch_size * self._gradient_accumulation_steps
        return min(dataset_size, steps_samples)

    def _token_steps_per_epoch(self) -> int:
        steps = len(self._dataloader)
        if self.max_steps_per_epoch is not None:
            steps = min(steps, self.max_steps_per_epoch)
        return steps

    def _probe_batch_size(self, dataset_size: int) -> None:
        """Finds the largest batch that fits with real steps (or the fastest, with the
        throughput objective), or reuses a cached result; keeps and writes the report."""
        seq_len = self._tokenizer.max_seq_len
        live = ab.training_state_bytes(self._model, self._optimizer)
        capacity = ab.device_capacity(self._device)
        budget = ab.memory_budget(
            max_memory_bytes=self._adaptive.max_memory_bytes,
            capacity=capacity,
            live_bytes=live,
            safety_margin=self._adaptive.memory_safety_margin,
        )
        # Every rank searches against the smallest budget; each measures against its own.
        rank_budgets = self._ranks.gather(budget.budget_bytes)
        common_budget = min(rank_budgets)
        cap = dataset_size
        if self._adaptive.max_batch_size is not None:
            cap = min(cap, self._adaptive.max_batch_size)
        cache, cache_fields = None, None
        if self._adaptive.probe_cache:
            cache = ab.ProbeCache(self._adaptive.probe_cache_dir or ab.default_cache_dir(), warn=log.warning)
            cache_fields = dict(
                self._probe_cache_fields,
                seq_len=seq_len,
                device=ab.device_name(self._device),
                budget_bytes=common_budget,
                rank_budget_bytes=rank_budgets,
                batch_size_cap=cap,
                batch_size_rounding=self._adaptive.batch_size_rounding,
                batch_size_objective=self._adaptive.batch_size_objective,
                throughput_tolerance=self._adaptive.throughput_tolerance,
                versions=ab.library_versions(),
            )
            cached = self._ranks.broadcast(cache.load(cache_fields) if self._ranks.is_main else None)
            if cached is not None:
                self._probe_report = dict(cached, cache={"hit": True, "path": cache.path(cache_fields)})
                path = self._write_probe_report()
                log.info(
                    f"use_maximum_batch_size: probe cache hit ({cache.path(cache_fields)}): batch_size="
                    f"{cached['batch_size']}, no probing; probe_cache=False probes again. Details in {path}"
                )
                self._plot_probe()
                return
        vocab_size = self._model.tok_embeddings.num_embeddings
        make_batch = partial(ab.worst_case_text_batch, seq_len=seq_len, vocab_size=vocab_size, device=self._device)
        log.info(
            f"use_maximum_batch_size: probing up to batch {cap} at seq_len={seq_len} with a "
            f"budget of {ab.format_bytes(budget.budget_bytes)} ({budget.source})."
        )
        probe_parts = dict(
            train_step=self._probe_step,
            make_batch=make_batch,
            model=self._model,
            optimizer=self._optimizer,
            device=self._device,
            snapshot_dir=self._output_dir,
            log=log.info,
        )
        lockstep: List[ab.LockstepTrial] = []

        def agree_on_outcomes(run_trial):
            lockstep.append(
                self._ranks.lockstep_trial(run_trial, budget_bytes=budget.budget_bytes, common_budget_bytes=common_budget)
            )
            return lockstep[-1]

        result = ab.probe_max_batch_size(
            budget_bytes=common_budget, max_batch_size=cap, wrap_trial=agree_on_outcomes, **probe_parts
        )
        batch_size = ab.round_batch_size(result.max_batch_size, self._adaptive.batch_size_rounding)
        extra = {
            "capacity": capacity.to_dict(),
            "batch_size_cap": cap,
            "batch_size_objective": self._adaptive.batch_size_objective,
            "world_size": self._ranks.world_size,
            # What every rank measured against its own budget; the batch is what fits on all.
            "ranks": self._ranks.gather(lockstep[0].report()),
        }
        if self._adaptive.batch_size_objective == "throughput":
            # Ranks time the same steps; rank 0's choice holds for all.
            choice = self._ranks.broadcast(
                ab.probe_throughput(max_batch_size=batch_size, tolerance=self._adaptive.throughput_tolerance, **probe_parts)
            )
            extra["throughput"] = choice.to_dict()
            log.info(
                f"batch_size_objective=throughput: batch {choice.batch_size} is within "
                f"{choice.tolerance:.0%} of the best {choice.best_samples_per_second:.1f} samples/s."
            )
            batch_size = choice.batch_size
        self._probe_report = ab.probe_report(
            result, batch_size=batch_size, seq_len=seq_len, device=self._device, budget=budget, extra=extra
        )
        if cache is not None:
            stored = cache.store(cache_fields, self._probe_report) if self._ranks.is_main else None
            self._probe_report["cache"] = {"hit": False, "path": self._ranks.broadcast(stored)}
        path = self._write_probe_report()
        log.info(ab.describe_result(result, budget))
        log.info(f"use_maximum_batch_size: the batch to use is {batch_size}; details in {path}")
        self._plot_probe()

    def _write_probe_report(self) -> str:
        """Rank 0 writes ``batch_probe.json``; returns its path."""
        path = f"{self._output_dir}/{ab.PROBE_FILENAME}"
        if self._ranks.is_main:
            path = ab.write_probe_report(self._probe_report, self._output_dir)
        return path

    def _plot_probe(self) -> None:
        if self._adaptive.plot and self._ranks.is_main:
            path = ab.plot_probe_report(self._probe_report, f"{self._output_dir}/batch_probe.png")
            log.info(f"plot: memory against batch size in {path}")

    def _setup_profiler(
        self, cfg_profiler: Optional[DictConfig] = None
    ) -> Union[torch.profiler.profile, DummyProfiler]:
        """
        Parses the ``profiler`` section of top-level ``cfg`` and sets up profiler.
        """
        if cfg_profiler is None:
            cfg_profiler = DictConfig({"enabled": False})
        if cfg_profiler.get("_component_", None) is None:
            cfg_profiler["_component_"] = "torchtune.training.setup_torch_profiler"
        profiler, profiler_cfg = config.instantiate(cfg_profiler)
        log.info(f" Profiler config after instantiation: {profiler_cfg}")
        self.profiler_profile_memory = profiler_cfg.get("profile_memory", False)
        if profiler_cfg["enabled"]:
            self.profiler_wait_steps = profiler_cfg["wait_steps"]
            self.profiler_warmup_steps = profiler_cfg["warmup_steps"]
            self.profiler_active_steps = profiler_cfg["active_steps"]
        return profiler

    def _setup_model(
        self,
        cfg_model: DictConfig,
        enable_activation_checkpointing: bool,
        enable_activation_offloading: bool,
        compile_model: bool,
        model_state_dict: Dict[str, Any],
    ) -> nn.Module:
        """
        Set up the model including enabling activation checkpointing.
        """
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        self._select_trainable(model, cfg_model)

        if compile_model:
            training.compile_model(model)

        if enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )

        self._load_model_weights(model, model_state_dict)
        self.activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, enable_activation_offloading
        )
        log.info(f"Model is initialized with precision {self._dtype}.")
        if self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        return model

    def _select_trainable(self, model: nn.Module, cfg_model: DictConfig) -> None:
        """Which parameters train: all of them here (the LoRA recipe keeps only adapters)."""

    def _load_model_weights(self, model: nn.Module, model_state_dict: Dict[str, Any]) -> None:
        """Loads the checkpoint's weights and checks their dtype."""
        model.load_state_dict(model_state_dict)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)

    def _setup_optimizer(
        self,
        cfg_optimizer: DictConfig,
        optimizer_in_bwd: bool = False,
        opt_state_dict: Optional[Dict[str, Any]] = None,
    ) -> Optional[Optimizer]:
        """
        Set up the optimizer. This method also handles loading the optimizer state_dict, if specified.
        """
        if optimizer_in_bwd:
            optim_dict = {
                p: config.instantiate(cfg_optimizer, [p]) for p in self._model.parameters()
            }
            training.register_optim_in_bwd_hooks(model=self._model, optim_dict=optim_dict)
            self._optim_ckpt_wrapper = training.create_optim_in_bwd_wrapper(
                model=self._model, optim_dict=optim_dict
            )
            if opt_state_dict is not None:
                self._optim_ckpt_wrapper.load_state_dict(opt_state_dict)
            log.info("In-backward optimizers are set up.")
            return None
        optimizer = config.instantiate(cfg_optimizer, self._model.parameters())
        if opt_state_dict:
            self._load_optimizer_state(optimizer, opt_state_dict)
        log.info("Optimizer is initialized.")
        return optimizer

    def _load_optimizer_state(self, optimizer: Optimizer, opt_state_dict: Dict[str, Any]) -> None:
        optimizer.load_state_dict(opt_state_dict)

    def _setup_lr_scheduler(
        self,
        cfg_lr_scheduler: Optional[DictConfig],
        num_training_steps: int,
        last_epoch: int,
    ) -> Optional[Optimizer]:
        """
        Set up the learning rate scheduler based on the provided configuration.
        """
        if cfg_lr_scheduler is None:
            log.info("No learning rate scheduler configured. Using constant learning rate.")
            return None
        if self._optimizer_in_bwd:
            optimizer = next(iter(self._optim_ckpt_wrapper.optim_map.values()))
        else:
            optimizer = self._optimizer
        lr_scheduler = config.instantiate(
            cfg_lr_scheduler,
            optimizer,
            num_training_steps=num_training_steps,
            last_epoch=last_epoch,
        )
        if self._optimizer_in_bwd:
            self._optim_ckpt_wrapper.set_lr_scheduler(lr_scheduler)
        log.info("Learning rate scheduler is initialized.")
        return lr_scheduler

    def _setup_dataset(self, cfg_dataset: DictConfig) -> Tuple[Any, bool]:
        """Instantiates the dataset (or several, concatenated) with the tokenizer."""
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset(
                datasets=[config.instantiate(c, self._tokenizer) for c in cfg_dataset]
            )
            return ds, getattr(ds, "packed", False)
        return config.instantiate(cfg_dataset, self._tokenizer), cfg_dataset.get("packed", False)

    def _setup_dataloader(
        self,
        dataset: Any,
        packed: bool,
        shuffle: bool,
        collate_fn: str,
        lengths: Optional[List[int]] = None,
    ) -> StatefulDataLoader:
        """
        Builds the sampler and dataloader over a map-style dataset: batches of the global
        batch size (which may change between epochs), or batches packed to ``max_tokens``
        when sample ``lengths`` are given.
        """
        collate = (
            partial(
                _get_component_from_path(collate_fn),
                padding_idx=self._tokenizer.pad_id,
                ignore_idx=self._loss_fn.ignore_index,
            )
            if not packed
            else padded_collate_packed
        )
        if lengths is not None:
            batch_sampler = ab.TokenBudgetBatchSampler(
                lengths,
                max_tokens=self._max_tokens,
                picking_order=self._tokens.sequence_picking_order,
                shuffle=shuffle,
                seed=0,
                max_batch_size=self._adaptive.max_batch_size,
                num_replicas=self._ranks.world_size,
                rank=self._ranks.rank,
            )
            return StatefulDataLoader(
                dataset=dataset,
                batch_sampler=batch_sampler,
                collate_fn=ab.truncating_collate(collate, self._max_tokens),
            )
        sampler = StatefulDistributedSampler(
            dataset, num_replicas=self._ranks.world_size, rank=self._ranks.rank, shuffle=shuffle, seed=0
        )
        batch_sampler = ab.ResizableBatchSampler(
            sampler, batch_size=self._batch.batch_size, samples_per_epoch=self._batch.samples_per_epoch
        )
        return StatefulDataLoader(dataset=dataset, batch_sampler=batch_sampler, collate_fn=collate)

    def _is_base_weight(self, key: str) -> bool:
        """Whether a state-dict key belongs in the random initial checkpoint (all do here)."""
        return True

    def _recipe_state(self) -> Dict[str, Any]:
        """What a resumed run needs besides the weights: torchtune's keys, the probe result
        and the batch state."""
        state = {
            training.SEED_KEY: self.seed,
            training.EPOCHS_KEY: self.epochs_run,
            training.TOTAL_EPOCHS_KEY: self.total_epochs,
            training.MAX_STEPS_KEY: self.max_steps_per_epoch,
            training.DATALOADER_KEY: self._dataloader.state_dict(),
            ab.BATCH_STATE_KEY: self._batch.state_dict(),
        }
        if self._probe_report is not None:
            state[ab.PROBE_STATE_KEY] = self._probe_report
        state[training.OPT_KEY] = self._optimizer_state_dict()
        return state

    def _model_state_dict(self) -> Dict[str, Any]:
        return self._model.state_dict()

    def _optimizer_state_dict(self) -> Dict[str, Any]:
        if not self._optimizer_in_bwd:
            return self._optimizer.state_dict()
        return self._optim_ckpt_wrapper.state_dict()

    def save_checkpoint(self, epoch: int) -> None:
        """
        Save state dict to file. The recipe save_checkpoint method is responsible for
        correctly creating the checkpoint dict and passing to the checkpointer.
        """
        # Every rank takes part in gathering the state; rank 0 writes it.
        ckpt_dict = {training.MODEL_KEY: self._model_state_dict()}
        if epoch + 1 < self.total_epochs:
            ckpt_dict.update(self._recipe_state())
        if self._ranks.is_main:
            self._checkpointer.save_checkpoint(
                ckpt_dict,
                epoch=epoch,
                intermediate_checkpoint=(epoch + 1 < self.total_epochs),
            )
        self._ranks.barrier()

    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return ab.next_token_loss(self._model, self._loss_fn, batch, self.activations_handling_ctx)

    def _forward_backward(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch; returns its summed loss and token count."""
        num_tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
        # Loss is normalized by default so we multiply by the number of tokens
        # This way we can normalize by the total number of tokens if we're accumulating gradients
        loss = self._loss_step(batch) * num_tokens
        loss.backward()
        return loss.detach(), num_tokens

    def _optimizer_step(self, global_tokens: float) -> Optional[torch.Tensor]:
        """Scales the accumulated gradients per token of all ranks, clips, steps and zeroes them."""
        grad_norm = None
        if not self._optimizer_in_bwd:
            # Data-parallel gradients arrive averaged over ranks: scale by world / all tokens.
            training.scale_grads(self._model, torch.tensor(self._ranks.world_size / global_tokens))
            if self._clip_grad_norm is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    self._model.parameters(), max_norm=float(self._clip_grad_norm)
                )
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _probe_step(self, batch: Dict[str, torch.Tensor]) -> None:
        """One full training step, as the loop below runs it, for the batch size probe."""
        _, num_tokens = self._forward_backward(batch)
        (global_tokens,) = self._ranks.sums(num_tokens)
        self._optimizer_step(global_tokens)

    def _memory_metrics(self) -> Dict[str, float]:
        if self._device.type != "cpu":
            return training.get_memory_stats(device=self._device)
        peak = peak_rss_bytes()
        return {} if peak is None else {"peak_memory_rss": peak / 2**30}

    def _zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)

    def _start_epoch(self, epoch: int) -> None:
        """Grows the batch for ``epoch`` and points the sampler at it.

        Rank 0 calls the batch increase function (with global batch sizes) and every rank
        takes its decision, so all ranks keep the same batch whatever the function does.
        """
        decision, error = None, None
        if self._ranks.is_main:
            try:
                growth = ab.per_rank_increase(self._growth.batch_increase_function, self._ranks.world_size)
                decision = self._batch.start_epoch(growth, epoch=epoch)
            except ab.BatchIncreaseFunctionError as e:
                error = str(e)
        decision, error = self._ranks.broadcast((decision, error))
        if error is not None:
            raise ab.BatchIncreaseFunctionError(error)
        if decision is not None:
            self._batch.batch_size = decision.batch_size
        if decision is not None and decision.requested != decision.previous:
            note = ""
            if decision.clamped:
                why = "an epoch's samples" if decision.bound == self._batch.samples_per_epoch else "the largest micro-batch"
                note = f" (clamped from {decision.requested} to {decision.bound}, {why})"
            per_rank = f" per rank, x{self._ranks.world_size} ranks" if self._ranks.distributed else ""
            log.info(f"Epoch {epoch}: batch_size {decision.previous} -> {decision.batch_size}{per_rank}{note}.")
        if self._max_tokens is None:
            self._dataloader.batch_sampler.batch_size = self._batch.batch_size
        self._dataloader.batch_sampler.set_epoch(epoch)
        if self._batch.grad_accum_steps > 1 and self._max_tokens is None:
            log.info(
                f"Epoch {epoch}: {self._batch.batch_size} samples a step in "
                f"{self._batch.grad_accum_steps} micro-batches of up to {self._batch.micro_batch_size}."
            )

    def train(self) -> None:
        """
        The core training loop. Each dataloader batch is one optimizer step, run in
        micro-batches of at most the largest size that fits. Supports training on subsets of
        the dataset using ``max_steps_per_epoch``.
        """
        if self._compile:
            log.info(
                "NOTE: torch.compile is enabled and model is compiled in first forward. Expect a relatively slow first iteration."
            )
        if not self._optimizer_in_bwd:
            self._optimizer.zero_grad()

        reset_peak_rss()
        self._profiler.start()
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            self._start_epoch(curr_epoch)
            steps_this_epoch = len(self._dataloader)
            if self._max_tokens is not None and self.max_steps_per_epoch is not None:
                steps_this_epoch = min(steps_this_epoch, self.max_steps_per_epoch)
            pbar = tqdm(total=steps_this_epoch, disable=not self._ranks.is_main)
            t0 = time.perf_counter()
            for idx, batch in enumerate(self._dataloader):
                utils.batch_to_device(batch, self._device)
                num_samples = ab.batch_rows(batch)
                padded_tokens = batch["tokens"].numel()
                if self._lr_progress is not None:
                    self._lr_progress.set_progress(self._batch.samples_seen)

                step = ab.accumulate_gradients(
                    self._forward_backward,
                    batch,
                    micro_batch_limit=self._batch.max_micro_batch_size,
                    zero_grad=self._zero_grad,
                    retry_on_oom=self._growth.retry_on_oom,
                    device=self._device,
                    log=log.warning,
                    agree_on_oom=self._ranks.any if self._ranks.distributed else None,
                )
                del batch
                # Across ranks; the LR scales with a rank's mean share, so it is the same on all.
                global_samples, global_tokens, padded_tokens, loss_sum = self._ranks.sums(
                    num_samples, step.num_tokens, padded_tokens, step.loss_sum
                )
                global_samples = int(global_samples)
                step_lr = None
                if self._lr_scaler is not None:
                    world = self._ranks.world_size
                    step_lr = self._lr_scaler.apply(samples=global_samples / world, tokens=int(global_tokens / world))
                grad_norm = self._optimizer_step(global_tokens)
                if step_lr is None:
                    step_lr = get_lr(self._optimizer if not self._optimizer_in_bwd else self._optim_ckpt_wrapper)
                if self._lr_scaler is not None:
                    self._lr_scaler.restore()
                if self._lr_scheduler is not None and self._lr_progress is None:
                    self._lr_scheduler.step()
                self._batch.record_step(
                    samples=num_samples, micro_batch_limit=step.micro_batch_limit, oom_retries=step.oom_retries
                )
                if step.oom_retries:
                    log.warning(
                        f"Step {self._batch.global_step}: recovered from out of memory in micro-batches "
                        f"of {step.micro_batch_sizes}; steps from now on use at most {self._batch.max_micro_batch_size}."
                    )
                self.global_step = self._batch.global_step

                loss_to_log = loss_sum / global_tokens
                pbar.update(1)
                pbar.set_description(f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_to_log}")

                if self.global_step % self._log_every_n_steps == 0 and self._ranks.is_main:
                    time_per_step = time.perf_counter() - t0
                    log_dict = {
                        "loss": loss_to_log,
                        "lr": step_lr,
                        "batch_size": global_samples,
                        "micro_batch_size": max(step.micro_batch_sizes),
                        "grad_accum_steps": len(step.micro_batch_sizes),
                        "samples_seen": self._batch.samples_seen * self._ranks.world_size,
                        "oom_retries": step.oom_retries,
                        "tokens_per_second_per_gpu": global_tokens / self._ranks.world_size / time_per_step,
                        "real_tokens": int(global_tokens),
                        "padded_tokens": int(padded_tokens),
                        "padding_fraction": 1 - global_tokens / padded_tokens,
                    }
                    if self._log_peak_memory_stats:
                        log_dict.update(self._memory_metrics())
                    if grad_norm is not None:
                        log_dict.update({"grad_norm": grad_norm})
                    self._metric_logger.log_dict(log_dict, step=self.global_step)
                    reset_peak_rss()

                t0 = time.perf_counter()
                self._profiler.step()
                if idx + 1 == steps_this_epoch:
                    break

            self.epochs_run += 1
            self.save_checkpoint(epoch=curr_epoch)

        self._profiler.stop()

    def cleanup(self) -> None:
        if self._metric_logger is not None:
            self._metric_logger.close()


def run_recipe(recipe_cls: type, cfg: DictConfig) -> None:
    """Builds, sets up, trains and cleans up a recipe; a setting to fix ends the run with one
    ``error:`` line and no traceback."""
    try:
        recipe = recipe_cls(cfg=cfg)
        recipe.setup(cfg=cfg)
    except (ab.ConfigError, ab.BatchSizeTooLargeError) as e:
        raise SystemExit(f"error: {e}") from None
    try:
        recipe.train()
    except (ab.BatchIncreaseFunctionError, ab.MicroBatchOutOfMemoryError) as e:
        # Checkpoints of finished epochs stay; the message says what to change.
        raise SystemExit(f"error: {e}") from None
    recipe.cleanup()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """
    Entry point for the recipe.

    Configurable parameters are read in the following order:
        - Parameters specified in config (see available configs through ``tune ls``)
        - Overwritten by arguments from the command-line
    """
    config.log_config(recipe_name="FullFinetuneRecipeSingleDevice", cfg=cfg)
    run_recipe(FullFinetuneRecipeSingleDevice, cfg)


if __name__ == "__main__":
    sys.exit(recipe_main())
