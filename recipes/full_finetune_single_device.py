# torchtune's full_finetune_single_device recipe with adaptive batch size.
#
# Launch from the repository root (PYTHONPATH puts this `recipes` package before the one
# torchtune's wheel installs):
#   PYTHONPATH=. tune run recipes/full_finetune_single_device.py \
#       --config configs/tiny/full_single_device.yaml use_maximum_batch_size=True

from functools import partial
import itertools
import math
import signal
import sys
import time
from typing import Any, Dict, Optional, Tuple, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
import torch
from torch import nn
from torch.optim import Optimizer
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training import PROFILER_KEY, DummyProfiler
from torchtune.training.lr_schedulers import get_lr
from tqdm import tqdm

import adaptive_batch as ab
import adaptive_batch.torchtune as abt

log = utils.get_logger("DEBUG")

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
        - ``batch_increase_interval``: growth every N steps, samples or tokens instead of
          every epoch; ``global_batch_size``: a fixed global batch whose micro-batch the
          probe chooses.
        - ``save_every_n_steps``: checkpoints inside an epoch (the last
          ``keep_last_n_checkpoints`` kept); ``resume_from_checkpoint`` continues from the
          newest one at the exact step.
        - Batch state in the recipe state: a resumed run continues with the same batch sizes.
        - Per-step ``batch_size``, ``micro_batch_size``, ``grad_accum_steps``,
          ``samples_seen`` and peak memory metrics, on CPU too (the process's peak RSS).

    Args:
        cfg (DictConfig): OmegaConf object parsed from yaml file

    Raises:
        ConfigError: for any bad setting, before the model is built.
    """

    known_keys = abt.recipe_keys()
    _save_adapter_weights_only = False  # the LoRA recipe's option

    def __init__(self, cfg: DictConfig) -> None:
        abt.check_known_keys(cfg.keys(), self.known_keys)
        # Numbers finite, paths writable, no file where a checkpoint goes: before any work.
        abt.check_run_settings(cfg)
        self._device = utils.get_device(device=cfg.device)
        self._check_combinations(cfg)
        self._adaptive_parts(cfg)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)

        # logging attributes
        self._output_dir = cfg.output_dir
        self._log_every_n_steps = cfg.get("log_every_n_steps", 1)
        self._log_peak_memory_stats = cfg.get("log_peak_memory_stats", False)

        # Training cfg: resume_from_checkpoint is True, False or "auto" (decided in load_checkpoint).
        self._resume_setting = cfg.resume_from_checkpoint
        self._resume_from_checkpoint = cfg.resume_from_checkpoint is True
        self._gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self._optimizer_in_bwd = cfg.optimizer_in_bwd
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._enable_activation_checkpointing = cfg.get("enable_activation_checkpointing", False)
        self._enable_activation_offloading = cfg.get("enable_activation_offloading", False)

        self.seed = training.set_seed(
            seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0
        # Last: one run at a time writes output_dir (the lock dies with the process).
        self._lock = abt.OutputDirLock(cfg.output_dir).acquire() if self._ranks.is_main else None
        self._metric_logger = None
        # A finished run resumed (a requeued job) trains and writes nothing: set, it is the line said.
        self.finished: Optional[str] = None
        if self._resume_setting is not False:
            self.finished = self._ranks.decide_on_main(
                lambda: abt.finished_run(cfg.checkpointer.output_dir, cfg.epochs), errors=(ab.ConfigError,)
            )

    def _check_combinations(self, cfg: DictConfig) -> None:
        """The combinations torchtune's recipe refuses, and the probe's own, before any work."""
        abt.check_stock_recipe_options(
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
            norm_layer_noise_scale=abt.norm_layer_noise_scale(cfg),
        )
        abt.check_profiler(cfg.get(PROFILER_KEY, None), self._device.type)

    def _adaptive_parts(self, cfg: DictConfig) -> None:
        """The controller (every adaptive decision: probe, growth, micro-batches, token budgets,
        LR coupling; the distributed recipe's ranks agree on each), the run state a checkpoint
        holds (with a fingerprint of what is trained) and the step checkpoints."""
        dataset_cfg = cfg.dataset if not isinstance(cfg.dataset, ListConfig) else cfg.dataset[0]
        self._batching = ab.AdaptiveBatchController(
            abt.adaptive_options(cfg),
            batch_size=cfg.batch_size,
            input_key="tokens",
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            device=self._device,
            output_dir=cfg.output_dir,
            max_seq_len=cfg.tokenizer.get("max_seq_len", None),
            packed=bool(dataset_cfg.get("packed", False)),
            optimizer_in_bwd=cfg.optimizer_in_bwd,
            ranks=ab.RankGroup(self._device),
            log=log.info,
            warn=log.warning,
        )
        self._ranks = self._batching.ranks
        self._run_state = ab.RunState(self._batching.session, settings=abt.trained_settings(cfg))
        self._step_checkpoints = ab.StepCheckpoints(
            f"{cfg.output_dir}/{abt.STEP_CHECKPOINTS_DIRNAME}",
            every_n_steps=cfg.get("save_every_n_steps", None),
            keep_last=cfg.get("keep_last_n_checkpoints", 2),
            ranks=self._ranks,
            log=log.info,
        )
        self._resume_step_state: Optional[Dict[str, Any]] = None
        if self._batching.options.probe_cache_dir is not None:
            abt.check_writable_dir("probe_cache_dir", self._batching.options.probe_cache_dir)
        if cfg.get("plot", False):
            abt.check_writable_file(
                "plot=True draws to", f"{cfg.output_dir}/batch_probe.png", fix="move it away, or set plot=False"
            )

    def load_checkpoint(self, cfg_checkpointer: DictConfig) -> Dict[str, Any]:
        """
        Extract the checkpoint state from file and validate. If resume_from_checkpoint
        is True, this also includes the recipe state: from the newest step checkpoint unless
        the last epoch's is newer; a step checkpoint replaces the weights and optimizer too.
        """
        if self._resume_setting is not False:
            try:
                epoch_step, unreadable = abt.epoch_checkpoint_step(
                    cfg_checkpointer.output_dir, cfg_checkpointer.get("recipe_checkpoint")
                ), None
            except abt.UnreadableEpochState as e:
                log.warning(f"The epoch recipe state {e.path} cannot be read ({e.reason}); looking to step checkpoints.")
                epoch_step, unreadable = -1, e
            self._resume_step_state = self._step_checkpoints.resume_state(epoch_step)
            if unreadable is not None and self._resume_step_state is None:
                raise unreadable  # auto must not start afresh over the epoch checkpoints
            saved = self._resume_step_state is not None or epoch_step >= 0
            if not saved and self._resume_setting is True:
                raise ab.ConfigError(
                    f"resume_from_checkpoint=True: {cfg_checkpointer.output_dir} holds no checkpoint to resume (no "
                    "readable step checkpoint, no epoch checkpoint's recipe_state.pt): set resume_from_checkpoint=False "
                    "to start the run (or auto, to resume when there is one), or point output_dir at the run to resume."
                )
            self._resume_from_checkpoint = saved
            if self._resume_setting == abt.RESUME_AUTO:
                log.info(f"resume_from_checkpoint=auto: {'resuming' if saved else 'nothing saved yet; starting the run'}.")
        from_epoch = self._resume_from_checkpoint and self._resume_step_state is None
        if from_epoch:
            cfg_checkpointer.checkpoint_files = self._epoch_weight_files(cfg_checkpointer)
        self._checkpointer = config.instantiate(cfg_checkpointer, should_load_recipe_state=from_epoch)
        checkpoint_dict = self._checkpointer.load_checkpoint()
        if self._resume_step_state is not None:
            checkpoint_dict.update(self._resume_step_state)

        if self._resume_from_checkpoint:
            self._update_recipe_state(checkpoint_dict)
        return checkpoint_dict

    def _epoch_weight_files(self, cfg_checkpointer: DictConfig) -> Any:
        """The weights a resume from the epoch checkpoint loads: the ones that epoch saved
        (torchtune 0.6.1 would read the config's ``checkpoint_files`` from ``output_dir``)."""
        files = abt.epoch_weight_files(
            cfg_checkpointer.output_dir, cfg_checkpointer.get("recipe_checkpoint"), cfg_checkpointer.checkpoint_files
        )
        log.info(f"Resuming from the epoch checkpoint: weights {files} in {cfg_checkpointer.output_dir}.")
        return files

    def _update_recipe_state(self, ckpt_dict: Dict[str, Any]) -> None:
        """
        Updates the recipe state from checkpoint; a run whose trained settings differ from the
        ones that wrote it is refused (``RunState.check_resume``).
        """
        # A resumed run keeps the batch size its first run probed, and where growth had got to.
        self._run_state.load_state_dict(ckpt_dict)
        self._run_state.check_resume()
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

    def setup(self, cfg: DictConfig) -> None:
        """
        Sets up the recipe state correctly. This includes setting recipe attributes based
        on the ``resume_from_checkpoint`` flag.
        """
        # Every rank waits for the main rank's cleanup before writing under output_dir.
        abt.claim_output_dir(cfg.output_dir, cfg.checkpointer.output_dir, self._step_checkpoints, self._ranks, log=log.info)
        # Tokenizer and data first: a bad path or argument stops the run before the model loads.
        self._tokenizer = abt.build("tokenizer", cfg.tokenizer)
        log.info("Tokenizer is initialized from file.")
        dataset, packed = self._setup_dataset(cfg.dataset)

        self._ensure_weights(cfg)
        ckpt_dict = self.load_checkpoint(cfg.checkpointer)
        if self._ranks.is_main:
            # After a resume's checks: a refused one leaves the run's config and logs as they were.
            self._metric_logger = abt.build("metric_logger", cfg.metric_logger)
            self._metric_logger.log_config(cfg)

        self._compile = cfg.compile
        self._model = self._setup_model(
            cfg_model=cfg.model,
            enable_activation_checkpointing=self._enable_activation_checkpointing,
            enable_activation_offloading=self._enable_activation_offloading,
            compile_model=self._compile,
            model_state_dict=ckpt_dict[training.MODEL_KEY],
        )

        self._optimizer = self._setup_optimizer(
            cfg_optimizer=cfg.optimizer,
            optimizer_in_bwd=cfg.optimizer_in_bwd,
            opt_state_dict=(
                ckpt_dict[training.OPT_KEY] if self._resume_from_checkpoint else None
            ),
        )
        # torchtune's checkpointer memory-maps the file: released here, not after setup, so the
        # probe below measures the memory training will have.
        del ckpt_dict

        self._setup_loss(cfg)

        # The batch (probed, resumed or configured) is settled before the dataloader is built with it.
        self._settle_batch(cfg, dataset)
        self.global_step = self._batching.global_step

        self._dataloader = self._setup_dataloader(
            dataset,
            packed=packed,
            shuffle=cfg.shuffle,
            collate_fn=cfg.get("collate_fn", "torchtune.data.padded_collate_sft"),
        )

        self._lr_scheduler = self._setup_lr_scheduler(
            cfg_lr_scheduler=cfg.get("lr_scheduler", None),
            num_training_steps=self._batching.lr_schedule_steps(self.total_epochs, len(self._dataloader)),
            last_epoch=self._batching.lr_last_epoch(),
        )
        self._attach_lr_and_step_checkpoints()
        self._profiler = self._setup_profiler(cfg.get(PROFILER_KEY, None))

    def _setup_loss(self, cfg: DictConfig) -> None:
        self._loss_fn = config.instantiate(cfg.loss)
        if self._compile:
            training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        log.info("Loss is initialized.")

    def _attach_lr_and_step_checkpoints(self) -> None:
        """The LR follows the batch; a step checkpoint holds the trainable weights, the recipe
        state and the position (restored here on a resume from one)."""
        optimizer = self._optimizer if not self._optimizer_in_bwd else self._optim_ckpt_wrapper
        # In backward there is an optimizer per parameter: the LR rule and schedule set them all.
        groups = self._optimizer if not self._optimizer_in_bwd else abt.ParamGroupsOf(self._optim_ckpt_wrapper.optim_map.values())
        self._batching.attach_lr(groups, self._lr_scheduler, read_lr=partial(get_lr, optimizer))
        self._step_checkpoints.attach(
            lambda: {**self._recipe_state(), **self._trainable_state_dict()},
            {training.DATALOADER_KEY: self._dataloader, abt.LR_SCHEDULER_KEY: self._lr_scheduler, abt.RNG_KEY: self._run_state.rng},
        )
        if self._resume_step_state is not None:
            self._step_checkpoints.restore_position(self._resume_step_state)
            self._resume_step_state = None

    def _ensure_weights(self, cfg: DictConfig) -> None:
        """With no ``checkpoint_files``, a seeded random initialisation written for the real
        checkpointer to load (rank 0 writes it)."""
        if cfg.checkpointer.get("checkpoint_files", None) is not None:
            return
        model_config = OmegaConf.to_container(cfg.model, resolve=True)
        if self._ranks.is_main:
            abt.write_random_init_checkpoint(
                lambda: config.instantiate(cfg.model), cfg.checkpointer.checkpoint_dir, self.seed,
                model_config=model_config, keep=self._is_base_weight,
            )
        self._ranks.barrier()
        cfg.checkpointer.checkpoint_files = [abt.initial_checkpoint_filename(self.seed, model_config)]
        log.info(f"No checkpoint_files given: initialised the model randomly with seed {self.seed}.")

    def _settle_batch(self, cfg: DictConfig, dataset: Any) -> None:
        """Has the controller settle the batch: probed (real training steps on worst-case
        batches), resumed or configured. Each rank trains on its share of the data (the sampler
        pads it to equal shares)."""
        lengths = None
        if self._batching.mode.uses_token_budget:
            lengths = abt.sample_lengths(
                dataset, input_key="tokens", cache_dir=f"{self._output_dir}/seqlen_cache",
                key={"dataset": OmegaConf.to_container(cfg.dataset), "tokenizer": OmegaConf.to_container(cfg.tokenizer)},
                log=log.info, warn=log.warning,
            )
        # measure_noise_scale's gradient copy (or hooks) exists before the probe, which counts it.
        self._batching.track_gradients(self._model, row_tokens=self._row_tokens)
        # Under a hard limit in address space each trial builds this recipe again in a fresh process.
        with abt.RecipeTrialBuild.of(self, cfg) as build:
            probe = partial(
                ab.probe_batch_size, target=self.probe_target(), seq_len=self._tokenizer.max_seq_len,
                cache_fields=self._probe_cache_fields(cfg), build=build,
                first_guess=abt.ConfigFirstGuess(cfg, micro_batches=self._batching.probe_micro_batches),
            )
            self._batching.settle(
                dataset_size=math.ceil(len(dataset) / self._ranks.world_size),
                max_steps_per_epoch=self.max_steps_per_epoch, probe=probe, lengths=lengths,
            )

    def probe_target(self) -> abt.ProbeTarget:
        """What the probe's trials train: this recipe's own step on worst-case batches."""
        make_batch = partial(
            abt.worst_case_text_batch, seq_len=self._tokenizer.max_seq_len,
            vocab_size=self._model.tok_embeddings.num_embeddings, device=self._device,
        )
        return abt.ProbeTarget(self._probe_step, make_batch, self._model, self._optimizer, self._device)

    def _probe_cache_fields(self, cfg: DictConfig) -> Dict[str, Any]:
        """What changes a step's memory, for the probe cache's key."""
        return {
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

    @property
    def probe_report(self) -> Optional[abt.ProbeReport]:
        """What ``batch_probe.json`` holds, or ``None`` when the run did not probe."""
        return self._batching.probe_report

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
                datasets=[abt.build(f"dataset[{i}]", c, self._tokenizer) for i, c in enumerate(cfg_dataset)]
            )
            return ds, getattr(ds, "packed", False)
        return abt.build("dataset", cfg_dataset, self._tokenizer), cfg_dataset.get("packed", False)

    def _setup_dataloader(
        self,
        dataset: Any,
        packed: bool,
        shuffle: bool,
        collate_fn: str,
    ) -> StatefulDataLoader:
        """
        Builds the dataloader over a map-style dataset with the controller's batch sampler:
        one dataloader batch is one optimizer step's batch (a number of samples that may grow
        between epochs, or a token budget); micro-batches split it.
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
        return StatefulDataLoader(
            dataset=dataset,
            batch_sampler=self._batching.batch_sampler(dataset, shuffle=shuffle),
            collate_fn=self._batching.collate(collate),
            # Its own generator: an iterator draws a seed at each epoch's start, from the global
            # RNG where the loader has none, so a run resumed mid-epoch (the RNG restored from its
            # step checkpoint) drew once more than the uninterrupted run, and dropout differed.
            generator=torch.Generator().manual_seed(self.seed),
        )

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
            **self._run_state.state_dict(),
        }
        state[training.OPT_KEY] = self._optimizer_state_dict()
        return state

    def _model_state_dict(self) -> Dict[str, Any]:
        return self._model.state_dict()

    def _optimizer_state_dict(self) -> Dict[str, Any]:
        if not self._optimizer_in_bwd:
            return self._optimizer.state_dict()
        return self._optim_ckpt_wrapper.state_dict()

    def _trainable_state_dict(self) -> Dict[str, Any]:
        """The weights a step checkpoint holds: all of them here (the LoRA recipe: adapters)."""
        return {training.MODEL_KEY: self._model_state_dict()}

    def save_checkpoint(self, epoch: int) -> None:
        """
        Save state dict to file. The recipe save_checkpoint method is responsible for
        correctly creating the checkpoint dict and passing to the checkpointer.
        """
        intermediate_checkpoint = epoch + 1 < self.total_epochs
        # Every rank takes part in gathering the state; rank 0 writes it aside and moves it
        # into place whole, and a failed write stops every rank.
        ckpt_dict = self._epoch_state(intermediate_checkpoint)
        files = self._ranks.decide_on_main(
            lambda: abt.save_epoch_checkpoint(
                self._checkpointer, ckpt_dict, epoch=epoch, intermediate_checkpoint=intermediate_checkpoint,
                adapter_only=self._save_adapter_weights_only,
            ),
            errors=(ab.CheckpointWriteError,),
        )
        # torchtune's own lines name the staging directory the files were written to first.
        log.info(f"Epoch {epoch} checkpoint in place in {self._output_dir}: {', '.join(files)}.")

    def _epoch_state(self, intermediate_checkpoint: bool) -> Dict[str, Any]:
        """An epoch checkpoint's state: the weights, and the recipe state unless it is the last."""
        ckpt_dict = {training.MODEL_KEY: self._model_state_dict()}
        if intermediate_checkpoint:
            ckpt_dict.update(self._recipe_state())
        return ckpt_dict

    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return abt.next_token_loss(self._model, self._loss_fn, batch, self.activations_handling_ctx)

    def _row_tokens(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Each sample's tokens that carry a loss (its labels from the second: the loss predicts
        each next token)."""
        return (batch["labels"][..., 1:] != self._loss_fn.ignore_index).sum(-1)

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
        """One full training step, as the loop below runs it, for the batch size probe: as many
        micro-batches of ``batch`` as the controller says a step holds (gradients alive between
        them), then the optimizer step."""
        num_tokens = 0
        for _ in range(self._batching.probe_micro_batches(batch["tokens"].shape[0])):
            # A copy each: the loss takes "labels" out of the batch it is given.
            num_tokens = num_tokens + self._forward_backward(dict(batch))[1]
        (global_tokens,) = self._ranks.sums(num_tokens)
        self._optimizer_step(global_tokens)

    def _memory_metrics(self) -> Dict[str, float]:
        if self._device.type != "cpu":
            return training.get_memory_stats(device=self._device)
        peak = abt.peak_rss_bytes()
        return {} if peak is None else {"peak_memory_rss": peak / 2**30}

    def _zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)

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

        abt.reset_peak_rss()
        self._profiler.start()
        with abt.StopSignals(self._ranks, log=log.warning) as signals:
            self._train_epochs(signals)
        self._profiler.stop()

    def _train_epochs(self, signals: abt.StopSignals) -> None:
        """The epochs left, each ending with its checkpoint; a SIGTERM or SIGINT stops the run
        after the step it arrives in."""
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            # Growth by epoch happens here; a run resumed mid-epoch gets the steps it has left.
            steps = self._batching.start_epoch(curr_epoch, self._dataloader)
            t0 = time.perf_counter()
            # Closed (its line ended) before the epoch checkpoint or whatever stops the run.
            # No monitor thread: its 8 MiB stack, started after the probe measured the process,
            # would come out of the found batch's room under an address-space limit.
            tqdm.monitor_interval = 0
            with tqdm(total=steps, disable=not self._ranks.is_main) as pbar:
                for idx, batch in enumerate(itertools.islice(self._dataloader, steps)):
                    self._record_memory_history(curr_epoch, idx, before_step=True)
                    utils.batch_to_device(batch, self._device)
                    step = self._batching.step(
                        batch, forward_backward=self._forward_backward, optimizer_step=self._optimizer_step,
                        zero_grad=self._zero_grad,
                    )
                    del batch
                    self.global_step = step.global_step
                    pbar.update(1)
                    pbar.set_description(f"{curr_epoch + 1}|{self.global_step}|Loss: {step.loss}")
                    if self.global_step % self._log_every_n_steps == 0 and self._ranks.is_main:
                        self._log_step(step, seconds=time.perf_counter() - t0)
                    self._record_memory_history(curr_epoch, idx, before_step=False)
                    abt.fault_point("after_step")
                    saved = self._step_checkpoints.after_step(self.global_step)
                    signum = signals.stop_requested()
                    if signum is not None:
                        self._stop(signum, saved)
                    t0 = time.perf_counter()
                    self._profiler.step()
            self.epochs_run += 1
            self.save_checkpoint(epoch=curr_epoch)
            abt.fault_point("after_epoch")

    def _stop(self, signum: int, saved: Optional[str]) -> None:
        """Saves a step checkpoint (when they are on and this step has none) and stops the run.

        Raises:
            RunStopped: always, saying what was saved and how to resume.
        """
        if saved is None and self._step_checkpoints.every_n_steps is not None:
            saved = self._step_checkpoints.save_now(self.global_step)
        name = signal.Signals(signum).name
        if saved is not None:
            kept = f"saved {saved}; resume with the same command and resume_from_checkpoint=True (or auto)"
        else:
            kept = (
                f"no step checkpoint (save_every_n_steps is unset): a resume with resume_from_checkpoint=True starts "
                f"epoch {self.epochs_run} again from {'its checkpoint' if self.epochs_run else 'the start'}"
            )
        raise ab.RunStopped(f"{name} after step {self.global_step}: {kept}.", signum)

    def _log_step(self, step: ab.StepOutcome, seconds: float) -> None:
        log_dict = {"loss": step.loss, "lr": step.lr, **self._batching.step_metrics(step, seconds=seconds)}
        if self._log_peak_memory_stats:
            log_dict.update(self._memory_metrics())
        if step.grad_norm is not None:
            log_dict.update({"grad_norm": step.grad_norm})
        self._metric_logger.log_dict(log_dict, step=self.global_step)
        abt.reset_peak_rss()

    def _record_memory_history(self, epoch: int, idx: int, *, before_step: bool) -> None:
        """torchtune's CUDA memory snapshot of the profiler's active steps, first epoch only:
        started before step ``wait + warmup``, stopped after step ``wait + warmup + active``."""
        if epoch != 0 or not self.profiler_profile_memory or self._device.type != "cuda":
            return
        start = self.profiler_wait_steps + self.profiler_warmup_steps
        if before_step and idx == start:
            torch.cuda.memory._record_memory_history()
        elif not before_step and idx == start + self.profiler_active_steps:
            torch.cuda.memory._record_memory_history(enabled=None)

    def cleanup(self) -> None:
        if self._metric_logger is not None:
            self._metric_logger.close()
        self.release()

    def release(self) -> None:
        """Lets another run use ``output_dir`` (however this one ended)."""
        if self._lock is not None:
            self._lock.release()


def run_recipe(recipe_cls: type, cfg: DictConfig) -> None:
    """Builds, sets up, trains and cleans up a recipe; a setting to fix ends the run with one
    ``error:`` line and no traceback."""
    try:
        recipe = recipe_cls(cfg=cfg)
    except (ab.ConfigError, ab.BatchSizeTooLargeError) as e:
        raise SystemExit(f"error: {e}") from None
    try:
        if recipe.finished is None:
            with abt.StopAtOnce("setup (the batch-size probe included)", "nothing was trained or saved; run the same command again"):
                recipe.setup(cfg=cfg)
            recipe.train()
        else:
            log.info(recipe.finished)
        recipe.cleanup()
    except (ab.ConfigError, ab.BatchSizeTooLargeError, ab.MicroBatchOutOfMemoryError) as e:
        # Checkpoints of finished epochs and steps stay; the message says what to change.
        raise SystemExit(f"error: {e}") from None
    except ab.CheckpointWriteError as e:
        raise SystemExit(f"error: {e}. {abt.saved_checkpoints(cfg.output_dir)}") from None
    except ab.RunStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        raise SystemExit(128 + e.signum) from None
    finally:
        recipe.release()


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
    abt.check_command_line(sys.argv[1:])  # a YAML or override error is one line, not a traceback
    sys.exit(recipe_main())
