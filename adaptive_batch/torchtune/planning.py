"""Plans a torchtune config's memory with fake tensors: nothing allocated, no weights needed."""

from typing import Optional

import torch
from omegaconf import DictConfig
from torchtune import config, modules, training
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from adaptive_batch.planner import MemoryPlan, plan_memory
from adaptive_batch.torchtune.loss import next_token_loss
from adaptive_batch.validation import ConfigError


def plan_from_config(
    cfg: DictConfig,
    *,
    device_memory_bytes: Optional[int],
    safety_margin: float,
    max_batch_size: Optional[int] = None,
) -> MemoryPlan:
    """Plans the config's model, optimizer, loss, dtype, sequence length and activation
    checkpointing with fake tensors.

    Raises:
        ConfigError: when the config leaves the sequence length open, or sets what the
            planner cannot model (``optimizer_in_bwd``).
    """
    seq_len = cfg.tokenizer.get("max_seq_len", None)
    if seq_len is None:
        raise ConfigError(
            "tokenizer.max_seq_len=null: the plan needs the longest sequence a batch can hold; "
            "set tokenizer.max_seq_len, e.g. tokenizer.max_seq_len=2048."
        )
    if cfg.get("optimizer_in_bwd", False):
        raise ConfigError(
            "optimizer_in_bwd=True: the planner models a step that keeps all gradients until the "
            "optimizer step; set optimizer_in_bwd=False (adaptive batching needs it off too)."
        )
    dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=torch.device("cpu"))
    loss_fn = config.instantiate(cfg.loss)
    activation_checkpointing = bool(cfg.get("enable_activation_checkpointing", False))

    def build_model() -> torch.nn.Module:
        with training.set_default_dtype(dtype):
            model = config.instantiate(cfg.model)
        adapters = get_adapter_params(model)
        if adapters:  # LoRA: only the adapters train
            set_trainable_params(model, adapters)
        if activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if hasattr(loss_fn, "num_output_chunks"):
            model.set_num_output_chunks(loss_fn.num_output_chunks)
        return model

    def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return config.instantiate(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])

    def forward_backward(model: torch.nn.Module, batch: dict) -> None:
        next_token_loss(model, loss_fn, dict(batch)).backward()

    return plan_memory(
        build_model=build_model,
        build_optimizer=build_optimizer,
        forward_backward=forward_backward,
        seq_len=int(seq_len),
        device_memory_bytes=device_memory_bytes,
        safety_margin=safety_margin,
        max_batch_size=max_batch_size,
    )
