"""Plans a torchtune config's memory with fake tensors: nothing allocated, no weights needed."""

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Union

from omegaconf import DictConfig, OmegaConf
import torch
from torchtune import config, modules, training
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from adaptive_batch.errors import ConfigError
import adaptive_batch.logs as logs
from adaptive_batch.memory.device import format_bytes
from adaptive_batch.probe.fake_step import KnownStateOptimizer
from adaptive_batch.probe.plan import MemoryPlan, plan_memory
from adaptive_batch.probe.search import FirstGuess
from adaptive_batch.schedule.global_batch import micro_batches_per_trial
from adaptive_batch.torchtune.checks import check_seq_len, model_max_seq_len
from adaptive_batch.torchtune.loss import next_token_loss

# The sequence length planned when a config leaves tokenizer.max_seq_len open (torchtune's
# stock configs do): a common fine-tuning length; the plan says it assumed it.
DEFAULT_SEQ_LEN = 2048

# State bytes per trainable element of optimizers that may not import on the planning machine
# (bitsandbytes needs CUDA): two 8-bit moments (plus one float32 scale per 2048-element block
# of each), or two float32 ones; bitsandbytes keeps tensors under 4096 elements in 32-bit
# state. Paged state is counted as resident on the device.
KNOWN_OPTIMIZER_STATE = {
    "bitsandbytes.optim.PagedAdamW8bit": (2 + 8 / 2048, 8.0),
    "bitsandbytes.optim.AdamW8bit": (2 + 8 / 2048, 8.0),
    "bitsandbytes.optim.Adam8bit": (2 + 8 / 2048, 8.0),
    "bitsandbytes.optim.PagedAdam8bit": (2 + 8 / 2048, 8.0),
    "bitsandbytes.optim.PagedAdamW": (8.0, 8.0),
    "bitsandbytes.optim.PagedAdamW32bit": (8.0, 8.0),
    "bitsandbytes.optim.PagedAdam": (8.0, 8.0),
    "bitsandbytes.optim.Lion8bit": (1 + 4 / 2048, 4.0),
    "bitsandbytes.optim.PagedLion8bit": (1 + 4 / 2048, 4.0),
}
_BNB_MIN_8BIT_SIZE = 4096


def _optimizer_factory(cfg_optimizer: DictConfig, assumptions: List[str]) -> Callable[[list], torch.optim.Optimizer]:
    """Builds the config's optimizer for a list of parameters, or a stand-in with its known
    state size when it cannot be imported here.

    Raises:
        ConfigError: for an optimizer that neither imports nor has a known state size.
    """
    from torchtune.config._utils import _get_component_from_path

    component = str(cfg_optimizer.get("_component_", ""))
    try:
        _get_component_from_path(component)
    except Exception as e:  # noqa: BLE001 - any import failure
        if component not in KNOWN_OPTIMIZER_STATE:
            raise ConfigError(
                f"optimizer._component_={component!r} cannot be imported here ({type(e).__name__}: {e}) and its "
                f"state size is not known to the planner (known: {', '.join(sorted(KNOWN_OPTIMIZER_STATE))}); "
                "install it, or plan with optimizer._component_=torch.optim.AdamW."
            ) from None
        per, small = KNOWN_OPTIMIZER_STATE[component]
        assumptions.append(
            f"optimizer {component} is not importable here: planned from its state size, {per:.3g} bytes per "
            f"trainable element ({small:.0f} for tensors under {_BNB_MIN_8BIT_SIZE} elements)"
        )
        return lambda params: KnownStateOptimizer(
            params, bytes_per_element=per, small_bytes_per_element=small, small_numel=_BNB_MIN_8BIT_SIZE
        )
    return lambda params: config.instantiate(cfg_optimizer, params)


def _nf4_base_weights(cfg_model: DictConfig, dtype: torch.dtype, assumptions: List[str]) -> "tuple[DictConfig, Dict[str, int]]":
    """QLoRA: fake tensors cannot hold torchao's NF4 weights, so the model is planned with
    dense base weights (``quantize_base=False``) and the difference taken off, with the
    dequantized copy of the largest weight a linear makes in forward and backward added.

    Returns:
        The model config to plan and the bytes to adjust by category (empty: no NF4 weights).
    """
    try:
        from torchao.dtypes.nf4tensor import NF4Tensor
    except ImportError:
        return cfg_model, {}
    with training.set_default_dtype(dtype), torch.device("meta"):
        model = config.instantiate(cfg_model)
    quantized = [p for p in model.parameters() if isinstance(p, NF4Tensor)]
    if not quantized:
        return cfg_model, {}
    stored = sum(t.numel() * t.element_size() for p in quantized for t in _inner_tensors(p))
    dense = sum(p.numel() for p in quantized) * dtype.itemsize
    largest = max(p.numel() for p in quantized) * dtype.itemsize
    assumptions.append(
        f"NF4 base weights (QLoRA): {sum(p.numel() for p in quantized) / 1e9:.2f}B elements stored in "
        f"{stored / 2**30:.2f} GiB, planned dense and taken off; one dequantized weight "
        f"({largest / 2**20:.0f} MiB) added as a temporary"
    )
    return OmegaConf.merge(cfg_model, {"quantize_base": False}), {"parameters": stored - dense, "activations": largest}


def _inner_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    names, _ = t.__tensor_flatten__()
    return [getattr(t, name) for name in names]


def _with_the_noise_scales_copy(cfg: DictConfig, step: "_RecipeStep", world_size: int, adjust_bytes: Dict[str, int],
                                assumptions: List[str]) -> Dict[str, int]:
    """``adjust_bytes`` with the copy of the gradients ``measure_noise_scale`` holds through the
    run (the micro-batch estimator's: fp32, each rank's share of the trainable parameters), said
    in ``assumptions``; the probe counts it, and the plan once answered one more than it."""
    if not cfg.get("measure_noise_scale", False) or cfg.get("noise_scale_estimator", "micro_batches") != "micro_batches":
        return adjust_bytes
    with torch.device("meta"):  # counted, not allocated
        trainable = sum(p.numel() for p in step.build_model().parameters() if p.requires_grad)
    copy = trainable * 4 // world_size
    assumptions.append(f"measure_noise_scale=True holds an fp32 copy of the trainable gradients through the run "
                       f"({format_bytes(copy)} a rank), counted with the gradients")
    return {**adjust_bytes, "gradients": adjust_bytes.get("gradients", 0) + copy}


def plan_from_config(
    cfg: DictConfig,
    *,
    device_memory_bytes: Optional[int],
    safety_margin: float,
    max_batch_size: Optional[int] = None,
    extrapolate_layers: bool = True,
    world_size: int = 1,
    device_type: Optional[str] = None,
) -> MemoryPlan:
    """Plans the config's model, optimizer, loss, dtype, sequence length, activation
    checkpointing and optimizer-in-backward with fake tensors, as torchtune's recipe runs them.

    What the config leaves open or names but cannot be imported here is filled in and said in
    ``plan.assumptions``: ``tokenizer.max_seq_len`` (:data:`DEFAULT_SEQ_LEN`), bitsandbytes
    optimizers (:data:`KNOWN_OPTIMIZER_STATE`).

    With ``world_size`` above 1 the plan is one rank's share under FSDP2, sharded as
    torchtune's distributed recipes shard (``training.shard_model`` with the config's
    ``custom_sharded_layers`` and ``fsdp_reshard_after_forward``); the batch is per rank. On
    CUDA (``device_type``, default the config's ``device``) the step's cuBLAS workspaces are added.

    Raises:
        ConfigError: for an optimizer that cannot be imported and has no known state size, a
            ``world_size`` below 1, several ranks with ``optimizer_in_bwd``, or a bad
            ``tokenizer.max_seq_len`` (:func:`check_seq_len`).
    """
    _check_ranks(cfg, world_size)
    assumptions: List[str] = []
    seq_len = _planned_seq_len(cfg, assumptions)
    if cfg.get("enable_activation_offloading", False):
        assumptions.append(
            "enable_activation_offloading=True is not modelled: the checkpointed activations torchtune moves to the "
            "CPU are counted on the device, so the plan overstates the peak"
        )
    dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=torch.device("cpu"))
    make_optimizer = _optimizer_factory(cfg.optimizer, assumptions)
    cfg_model, adjust_bytes = _nf4_base_weights(cfg.model, dtype, assumptions)
    step = _RecipeStep(cfg, cfg_model, dtype, config.instantiate(cfg.loss), make_optimizer)
    return plan_memory(
        build_model=step.build_model,
        build_optimizer=step.build_optimizer,
        forward_backward=step.forward_backward,
        seq_len=seq_len,
        device_memory_bytes=device_memory_bytes,
        safety_margin=safety_margin,
        max_batch_size=max_batch_size,
        optimizer_in_backward=step.optimizer_in_bwd,
        extrapolate_layers=extrapolate_layers,
        assumptions=assumptions,  # the list the noise scale's line joins (the next argument)
        adjust_bytes=_with_the_noise_scales_copy(cfg, step, world_size, adjust_bytes, assumptions),
        device_type=str(device_type or cfg.get("device", "cpu")),
        world_size=world_size,
        shard=step.shard,
        micro_batches=partial(
            micro_batches_per_trial, gradient_accumulation_steps=int(cfg.get("gradient_accumulation_steps", 1) or 1),
            global_batch_size=cfg.get("global_batch_size", None), world_size=world_size,
            grow_with_accumulation=bool(cfg.get("grow_with_accumulation", False)),
        ),
    )


@dataclass(frozen=True)
class ConfigFirstGuess:
    """The probe's first guess for a recipe's config: fake steps of the config's model, loss,
    optimizer, dtype and sequence length at batch 2 and 3
    (:func:`~adaptive_batch.probe.first_guess.guess_max_batch_size`), made only when the probe
    asks. Where the fake steps would not be the recipe's step, no guess: the probe measures its
    own line, and the answer is the same.

    Attributes:
        cfg: the recipe's config.
        micro_batches: the micro-batches a probe trial at a batch size runs (the run's).
    """

    cfg: DictConfig
    micro_batches: Callable[[int], int] = lambda batch_size: 1

    def __call__(self, budget_bytes: int, max_batch_size: Optional[int]) -> Optional[FirstGuess]:
        """The guess for ``budget_bytes`` and the cap, or ``None`` (said in one line) where the
        fake steps would not be the recipe's step.

        Raises:
            ConfigError: for a bad ``tokenizer.max_seq_len`` or an optimizer that cannot be built.
            Whatever a fake step raises (:func:`~adaptive_batch.probe.first_guess.guess_max_batch_size`).
        """
        from adaptive_batch.probe.first_guess import guess_max_batch_size  # fake tensors: only when asked

        cfg = self.cfg
        dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=torch.device("cpu"))
        reason = self._why_not(dtype)
        if reason is not None:
            logs.info(f"probe: no first guess from fake steps: {reason}; the real steps measure the line.")
            return None
        step = _RecipeStep(cfg, cfg.model, dtype, config.instantiate(cfg.loss), _optimizer_factory(cfg.optimizer, []))
        return guess_max_batch_size(
            build_model=step.build_model, build_optimizer=step.build_optimizer, forward_backward=step.forward_backward,
            seq_len=int(check_seq_len(cfg)), budget_bytes=budget_bytes, max_batch_size=max_batch_size,
            micro_batches=self.micro_batches,
        )

    def _why_not(self, dtype: torch.dtype) -> Optional[str]:
        """Why the fake steps would not be the recipe's step, or ``None``."""
        cfg = self.cfg
        for key in ("compile", "optimizer_in_bwd", "enable_activation_offloading"):
            if cfg.get(key, False):
                return f"{key}=True is not what a fake step runs"
        if check_seq_len(cfg) is None:
            return "tokenizer.max_seq_len is null"
        if _nf4_base_weights(cfg.model, dtype, [])[1]:
            return "fake tensors cannot hold NF4 base weights"
        return None


def _check_ranks(cfg: DictConfig, world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"--world-size={world_size!r} must be a positive integer: the number of data-parallel ranks.")
    if world_size > 1 and cfg.get("optimizer_in_bwd", False):
        raise ConfigError(
            f"--world-size={world_size} with optimizer_in_bwd=True: the sharded plan tracks one optimizer; "
            "set optimizer_in_bwd=False (torchtune's distributed configs leave it off)."
        )


def _planned_seq_len(cfg: DictConfig, assumptions: List[str]) -> int:
    """The config's sequence length, or :data:`DEFAULT_SEQ_LEN` (said in ``assumptions``)."""
    seq_len = check_seq_len(cfg)
    if seq_len is None:
        model_max = model_max_seq_len(cfg)
        seq_len = DEFAULT_SEQ_LEN if model_max is None else min(DEFAULT_SEQ_LEN, model_max)
        assumptions.append(
            f"tokenizer.max_seq_len is null: planned at {seq_len} tokens a sample "
            "(set tokenizer.max_seq_len=N to plan another length)"
        )
    return int(seq_len)


@dataclass
class _RecipeStep:
    """The model, optimizer, step and sharding a torchtune recipe builds from ``cfg``."""

    cfg: DictConfig
    cfg_model: DictConfig
    dtype: torch.dtype
    loss_fn: Any
    make_optimizer: Callable[[list], torch.optim.Optimizer]

    @property
    def optimizer_in_bwd(self) -> bool:
        return bool(self.cfg.get("optimizer_in_bwd", False))

    def build_model(self) -> torch.nn.Module:
        with training.set_default_dtype(self.dtype):
            model = config.instantiate(self.cfg_model)
        adapters = get_adapter_params(model)
        if adapters:  # LoRA: only the adapters train
            set_trainable_params(model, adapters)
        if self.cfg.get("enable_activation_checkpointing", False):
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if hasattr(self.loss_fn, "num_output_chunks"):
            model.set_num_output_chunks(self.loss_fn.num_output_chunks)
        return model

    def build_optimizer(self, params: list) -> Union[torch.optim.Optimizer, List[torch.optim.Optimizer]]:
        if self.optimizer_in_bwd:  # torchtune: one optimizer per parameter, stepped in backward
            return [self.make_optimizer([p]) for p in params]
        return self.make_optimizer(params)

    def forward_backward(self, model: torch.nn.Module, batch: dict) -> None:
        next_token_loss(model, self.loss_fn, dict(batch)).backward()

    def shard(self, model: torch.nn.Module, mesh: Any) -> None:
        training.shard_model(
            model=model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=self.cfg.get("custom_sharded_layers", None))],
            cpu_offload=False,
            reshard_after_forward=bool(self.cfg.get("fsdp_reshard_after_forward", True)),
            dp_mesh=mesh,
        )
