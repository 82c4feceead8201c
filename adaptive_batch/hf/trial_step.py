"""The Trainer's probe steps as its training will: the forward as Accelerate will wrap it, the
metrics a trainer's own step logs put back, and the worst case collated before any trial."""

from contextlib import contextmanager
import copy
from typing import Any, Iterator

from torch import nn
from transformers import Trainer

from adaptive_batch.data.worst_case import RepeatedSample
from adaptive_batch.errors import ConfigError


@contextmanager
def forward_as_accelerate_runs_it(accelerator: Any, model: nn.Module) -> Iterator[None]:
    """Runs ``model``'s forward, inside the block, as training will: under mixed precision
    Accelerate wraps it in autocast and casts its outputs to fp32 when ``train()`` prepares the
    model, after the probe (the Trainer's own autocast context does nothing in transformers 5).
    Without it the probe's bf16 steps ran in fp32: 1.84 GiB at 16 on an H200 where the Trainer's
    own steps took 1.37 GiB. A model already prepared, or no mixed precision, is left as it is.
    """
    if not getattr(accelerator, "native_amp", False) or hasattr(model, "_original_forward"):
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    own = vars(model).get("forward")  # a forward set on the instance, put back afterwards
    model.forward = convert_outputs_to_fp32(autocast(model.forward))
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


@contextmanager
def logged_metrics_kept(trainer: Trainer) -> Iterator[None]:
    """Puts back what a trainer's own step adds to its logged metrics (TRL's trainers keep
    entropy, token accuracy and a running token count), so the probe's steps are not logged."""
    kept = {name: copy.deepcopy(vars(trainer)[name]) for name in ("_metrics", "_total_train_tokens")
            if name in vars(trainer)}
    try:
        yield
    finally:
        vars(trainer).update(kept)


def worst_case_that_collates(worst_case: RepeatedSample, samples: str = "training") -> RepeatedSample:
    """``worst_case``, once it has collated a batch of one.

    Raises:
        ConfigError: where the collator fails on the longest sample (training's batches would fail
            the same way), before any trial.
    """
    try:
        worst_case(1)
    except Exception as e:  # noqa: BLE001 - whatever the user's collator raises
        raise ConfigError(
            f"the data collator could not collate the longest {samples} sample ({type(e).__name__}: {e}): {samples}'s "
            "batches would fail the same way; give the samples the fields the collator reads, or pass "
            "make_batch=f(b) -> a batch of b of your longest samples."
        ) from e
    return worst_case


__all__ = ["forward_as_accelerate_runs_it", "logged_metrics_kept", "worst_case_that_collates"]
