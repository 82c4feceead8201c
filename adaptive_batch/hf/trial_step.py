"""The Trainer's probe steps as its training will: the forward as Accelerate will wrap it, the
metrics a trainer's own step logs put back, and the worst case collated before any trial."""

from contextlib import contextmanager
import copy
from typing import Any, Callable, Iterator

from torch import nn
from transformers import Trainer

from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.data.worst_case import RepeatedSample
from adaptive_batch.errors import ConfigError
from adaptive_batch.rng import rng_state, set_rng_state


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


def a_batch_maker_of_rows(make_batch: Callable[[int], Any]) -> Callable[[int], Any]:
    """The user's ``make_batch``, once ``make_batch(2)`` gave a batch of 2 samples (the trials
    count and split its rows as the Trainer's batches').

    Raises:
        ConfigError: for a batch with no tensor of 2 rows (a string, a batch of another size),
            before any trial.
    """
    rng = rng_state()  # a batch maker may draw random numbers; the run's draws stay its own
    try:
        batch = make_batch(2)  # its own errors are its own
    finally:
        set_rng_state(rng)
    try:
        rows = BatchLayout().rows(batch)
    except ValueError:
        rows = None
    if rows != 2:
        got = f"{rows} rows" if rows is not None else "no tensor with a dimension of samples"
        raise ConfigError(
            f"make_batch: make_batch(2) returned a {type(batch).__name__} with {got}: it must return the collated batch "
            "of the b samples it is given, as the model takes it, e.g. make_batch=lambda b: collator([longest_sample] * b)."
        )
    return make_batch


__all__ = ["a_batch_maker_of_rows", "forward_as_accelerate_runs_it", "logged_metrics_kept", "worst_case_that_collates"]
