# torchtune's full_finetune_distributed recipe (FSDP2) with adaptive batch size.
#
# Launch from the repository root, one node with 2 processes (gloo on CPU, NCCL on CUDA):
#   PYTHONPATH=. tune run --nproc_per_node 2 recipes/full_finetune_distributed.py \
#       --config configs/tiny/full_distributed.yaml use_maximum_batch_size=True
#
# Several nodes: the same command on every node with torchrun's rendezvous options, e.g.
#   PYTHONPATH=. tune run --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \
#       --rdzv_endpoint HOST:29500 --rdzv_id JOB recipes/full_finetune_distributed.py --config ...

from functools import partial
import logging
import os
import sys
from typing import Any, Dict

from omegaconf import DictConfig
import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer
from torchtune import config, modules, training, utils

import adaptive_batch as ab
import adaptive_batch.torchtune as abt

# A sibling module: `recipes.` in the repository, `adaptive_batch_recipes.` when installed.
from .full_finetune_single_device import FullFinetuneRecipeSingleDevice, run_recipe

log = utils.get_logger("DEBUG")




class FullFinetuneRecipeDistributed(FullFinetuneRecipeSingleDevice):
    """Full finetuning with FSDP2 on several processes, with the batch size found before training.

    The single-device recipe's adaptive features on torchtune's distributed engine: the model
    is sharded with ``fully_shard`` before the probe, so the probe measures each rank's real
    footprint. ``batch_size`` is per rank, as in torchtune: the global batch is
    micro-batch x accumulation steps x ranks.

        - Probing runs in lockstep: every trial's outcome (fits, over budget, out of memory) is
          agreed by all ranks, so they take the same branches, and the batch is the largest
          that fits on every rank. Each rank may have its own budget: ``max_memory``, or the
          ``ADAPTIVE_BATCH_MAX_MEMORY`` environment variable (one value, or one per local rank).
          Rank 0 writes ``batch_probe.json`` with every rank's budget and trials.
        - ``batch_increase_function`` is called on rank 0 with global batch sizes; every rank
          takes its decision.
        - Every rank runs the same micro-batches per step; an out-of-memory error caught on
          one rank restarts the step in smaller micro-batches on all of them.
        - Checkpoints hold the full (gathered) model and optimizer state and the batch state;
          rank 0 writes them.

    Args:
        cfg (DictConfig): OmegaConf object parsed from yaml file

    Raises:
        ConfigError: for any bad setting, before the model is built.
    """

    known_keys = abt.recipe_keys({"fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers"})

    def __init__(self, cfg: DictConfig) -> None:
        abt.check_known_keys(cfg.keys(), self.known_keys)
        if cfg.get("fsdp_cpu_offload", False):
            raise ab.ConfigError(
                "fsdp_cpu_offload=True: offloaded parameters live in CPU memory the probe does not "
                "budget for; set fsdp_cpu_offload=False."
            )
        if cfg.get("optimizer_in_bwd", False):
            raise ab.ConfigError(
                "optimizer_in_bwd=True: the distributed recipe scales gradients by the tokens of "
                "all ranks before the step; set optimizer_in_bwd=False."
            )
        device = utils.get_device(device=cfg.device)
        if not dist.is_initialized():
            dist.init_process_group(training.get_distributed_backend(device.type))
        if dist.get_rank() != 0:
            log.setLevel(logging.WARNING)
        # A bad value on one rank (its ADAPTIVE_BATCH_MAX_MEMORY, its device's capacity) stops
        # every rank with the same line: none is left waiting in a collective.
        ranks = ab.RankGroup(device)
        cfg.max_memory = ranks.check_together(
            lambda: abt.rank_max_memory(
                cfg.get("max_memory", None),
                capacity_bytes=abt.device_capacity(device).headroom_bytes if device.type in ("cpu", "cuda") else None,
            )
        )
        ranks.check_together(lambda: FullFinetuneRecipeSingleDevice.__init__(self, cfg))
        self._reshard_after_forward = cfg.get("fsdp_reshard_after_forward", True)
        self._custom_sharded_layers = cfg.get("custom_sharded_layers", None)
        log.info(f"Data parallel over {self._ranks.world_size} ranks ({dist.get_backend()}).")

    def _setup_model(
        self,
        cfg_model: DictConfig,
        enable_activation_checkpointing: bool,
        enable_activation_offloading: bool,
        compile_model: bool,
        model_state_dict: Dict[str, Any],
    ) -> nn.Module:
        """Builds the model on the meta device, shards it with FSDP2 and loads each rank's
        shard of the full state dict."""
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg_model)
        self._select_trainable(model, cfg_model)

        if compile_model:
            training.compile_model(model, verbose=self._ranks.is_main)
        if enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )

        mesh = init_device_mesh(self._device.type, mesh_shape=(self._ranks.world_size,), mesh_dim_names=("dp",))
        training.shard_model(
            model=model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=self._custom_sharded_layers)],
            cpu_offload=False,
            reshard_after_forward=self._reshard_after_forward,
            dp_mesh=mesh["dp"],
        )
        with training.set_default_dtype(self._dtype), self._device:
            for m in model.modules():
                # RoPE caches are not in the state dict.
                if hasattr(m, "rope_init"):
                    m.rope_init()
        training.load_from_full_model_state_dict(model, model_state_dict, self._device, strict=True)
        training.validate_no_params_on_meta_device(model)
        self.activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, enable_activation_offloading
        )
        log.info(f"Model is sharded over {self._ranks.world_size} ranks with precision {self._dtype}.")
        self._ranks.barrier()
        return model

    def _load_optimizer_state(self, optimizer: Optimizer, opt_state_dict: Dict[str, Any]) -> None:
        training.load_from_full_optimizer_state_dict(self._model, optimizer, opt_state_dict, self._device)

    def _model_state_dict(self) -> Dict[str, Any]:
        return training.gather_cpu_state_dict(self._model, self._ranks.is_main, device=self._device)

    def _optimizer_state_dict(self) -> Dict[str, Any]:
        return training.get_full_optimizer_state_dict(
            self._model, self._optimizer, self._ranks.is_main, device=self._device
        )

    def cleanup(self) -> None:
        super().cleanup()
        # The ranks tear the process group down together: a rank that destroyed it while rank 0
        # was still writing the last checkpoint once died at exit with SIGABRT ("terminate called
        # without an active exception"), failing a finished run.
        dist.barrier()
        dist.destroy_process_group()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """
    Entry point for the recipe.

    Configurable parameters are read in the following order:
        - Parameters specified in config (see available configs through ``tune ls``)
        - Overwritten by arguments from the command-line
    """
    if int(os.environ.get("RANK", "0")) == 0:  # before the process group exists
        config.log_config(recipe_name="FullFinetuneRecipeDistributed", cfg=cfg)
    run_recipe(FullFinetuneRecipeDistributed, cfg)


if __name__ == "__main__":
    abt.check_command_line(sys.argv[1:])  # a YAML or override error is one line, not a traceback
    if "LOCAL_RANK" not in os.environ:  # `tune run` without torchrun: this process is the caller's
        sys.exit(recipe_main())
    try:
        code = recipe_main()
    except SystemExit as e:
        code = e.code
    abt.exit_past_teardown(code)
