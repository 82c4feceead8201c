# torchtune's lora_finetune_single_device recipe with adaptive batch size.
#
# Launch from the repository root (PYTHONPATH puts this `recipes` package before the one
# torchtune's wheel installs):
#   PYTHONPATH=. tune run recipes/lora_finetune_single_device.py \
#       --config configs/tiny/lora_single_device.yaml use_maximum_batch_size=True

import sys
from typing import Any, Dict

from omegaconf import DictConfig
from torch import nn
from torchtune import config, training, utils
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)

import adaptive_batch as ab
import adaptive_batch.torchtune as abt

# A sibling module: `recipes.` in the repository, `adaptive_batch_recipes.` when installed.
from .full_finetune_single_device import FullFinetuneRecipeSingleDevice, run_recipe

log = utils.get_logger("DEBUG")


class LoRAFinetuneRecipeSingleDevice(FullFinetuneRecipeSingleDevice):
    """LoRA finetuning on one device, with the batch size found before training and grown
    during it.

    torchtune's single-device LoRA recipe (frozen base weights, trainable adapters, adapter and
    merged checkpoints) on the same training loop as the full-finetune recipe here, so every
    adaptive-batch key works the same: ``use_maximum_batch_size``, ``batch_increase_function``,
    ``grow_with_accumulation``, ``retry_on_oom``, token budgets and LR scaling. The probe's
    trial steps update only the adapters, which is what this recipe's steps hold in memory.

    Args:
        cfg (DictConfig): OmegaConf object parsed from yaml file

    Raises:
        ConfigError: for any bad setting, before the model is built.
    """

    known_keys = abt.recipe_keys({"save_adapter_weights_only"})

    def __init__(self, cfg: DictConfig) -> None:
        if cfg.get("optimizer_in_bwd", False):
            raise ab.ConfigError(
                "optimizer_in_bwd=True: the LoRA recipe steps the optimizer after backward, as "
                "torchtune's does; set optimizer_in_bwd=False."
            )
        if abt.norm_layer_noise_scale(cfg):
            raise ab.ConfigError(
                "noise_scale_estimator='norm_layers' with LoRA: the norm layers are frozen, so they have no gradient "
                "to read; set noise_scale_estimator=micro_batches."
            )
        super().__init__(cfg)
        self._save_adapter_weights_only = abt.check_bool(
            "save_adapter_weights_only", cfg.get("save_adapter_weights_only", False)
        )
        self._adapter_state_dict = None

    def load_checkpoint(self, cfg_checkpointer: DictConfig) -> Dict[str, Any]:
        """Base weights, and on resume the adapter weights and recipe state."""
        checkpoint_dict = super().load_checkpoint(cfg_checkpointer)
        if self._resume_from_checkpoint:
            if training.ADAPTER_KEY not in checkpoint_dict:
                raise ab.ConfigError(
                    "resume_from_checkpoint=True but no adapter weights were found: resume from an "
                    "output_dir holding epoch_N/adapter_model.pt, or set checkpointer.adapter_checkpoint."
                )
            self._adapter_state_dict = checkpoint_dict[training.ADAPTER_KEY]
        return checkpoint_dict

    def _epoch_weight_files(self, cfg_checkpointer: DictConfig) -> Any:
        """The base weights, as configured: torchtune resumes the adapters from the newest
        epoch folder and the base model from ``checkpoint_dir``."""
        return cfg_checkpointer.checkpoint_files

    def _is_base_weight(self, key: str) -> bool:
        # The random initial checkpoint stands in for base weights: adapters start fresh.
        return "lora_" not in key and "magnitude" not in key

    def _select_trainable(self, model: nn.Module, cfg_model: DictConfig) -> None:
        """Only the adapters train."""
        self._lora_rank = cfg_model.lora_rank
        self._lora_alpha = cfg_model.lora_alpha
        self._lora_attn_modules = list(cfg_model.lora_attn_modules)
        self._apply_lora_to_mlp = cfg_model.apply_lora_to_mlp
        self._apply_lora_to_output = getattr(cfg_model, "apply_lora_to_output", False)
        self.adapter_params = get_adapter_params(model)
        self._is_dora = any("magnitude" in k for k in self.adapter_params.keys())
        set_trainable_params(model, self.adapter_params)
        log.info(f"LoRA model: {len(self.adapter_params)} adapter tensors train, the base weights are frozen.")

    def _load_model_weights(self, model: nn.Module, model_state_dict: Dict[str, Any]) -> None:
        """Base weights, then the adapters' on resume; checks that only adapter weights are
        missing from the base checkpoint."""
        base_missing, base_unexpected = model.load_state_dict(model_state_dict, strict=False)
        # Adapters that are initialised from the base weights (DoRA)
        if self._is_dora:
            for m in model.modules():
                if hasattr(m, "initialize_dora_magnitude"):
                    m.initialize_dora_magnitude()
        lora_missing = lora_unexpected = None
        if self._adapter_state_dict:
            lora_missing, lora_unexpected = model.load_state_dict(self._adapter_state_dict, strict=False)

        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=self._lora_attn_modules,
            apply_lora_to_mlp=self._apply_lora_to_mlp,
            apply_lora_to_output=self._apply_lora_to_output,
            base_missing=base_missing,
            base_unexpected=base_unexpected,
            lora_missing=lora_missing,
            lora_unexpected=lora_unexpected,
        )
        training.validate_expected_param_dtype(self.adapter_params.items(), dtype=self._dtype)

    def _trainable_state_dict(self) -> Dict[str, Any]:
        """A step checkpoint holds the adapters; the base weights come from checkpoint_files."""
        return {training.ADAPTER_KEY: get_adapter_state_dict(self._model.state_dict())}

    def _epoch_state(self, intermediate_checkpoint: bool) -> Dict[str, Any]:
        """Adapter weights, merged weights (unless ``save_adapter_weights_only``), and the
        recipe state while training is in progress."""
        ckpt_dict: Dict[str, Any] = self._recipe_state() if intermediate_checkpoint else {}
        ckpt_dict[training.ADAPTER_KEY] = get_adapter_state_dict(self._model.state_dict())
        if not self._save_adapter_weights_only:
            # A copy: get_merged_lora_ckpt adds the adapters into the base weights in place, and
            # on the CPU .cpu() would hand it the live model's own tensors.
            state_dict = {k: v.detach().to("cpu", copy=True) for k, v in self._model.state_dict().items()}
            ckpt_dict[training.MODEL_KEY] = get_merged_lora_ckpt(
                state_dict, rank=self._lora_rank, alpha=self._lora_alpha
            )
        ckpt_dict[training.ADAPTER_CONFIG] = {
            "r": self._lora_rank,
            "lora_alpha": self._lora_alpha,
            "target_modules": get_lora_module_names(
                self._lora_attn_modules, self._apply_lora_to_mlp, self._apply_lora_to_output
            ),
            "peft_type": "LORA",
        }
        return ckpt_dict


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """
    Entry point for the recipe.

    Configurable parameters are read in the following order:
        - Parameters specified in config (see available configs through ``tune ls``)
        - Overwritten by arguments from the command-line
    """
    config.log_config(recipe_name="LoRAFinetuneRecipeSingleDevice", cfg=cfg)
    run_recipe(LoRAFinetuneRecipeSingleDevice, cfg)


if __name__ == "__main__":
    abt.check_command_line(sys.argv[1:])  # a YAML or override error is one line, not a traceback
    sys.exit(recipe_main())
