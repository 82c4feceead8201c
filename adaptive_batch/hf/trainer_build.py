"""The Trainer's training step built again in a trial process, from the run's own parts.

Under a hard limit in address space the probe's trials run in fresh processes
(:mod:`adaptive_batch.probe.children`), as the recipes' do: a trial that runs out of memory in the
process that trains leaves its heap worse than a fresh one's. :class:`TrainerTrialBuild` holds
what a trial needs to make the same step: the Trainer's class and arguments (less evaluation,
saving and reporting), the model's class, configuration, dtype and frozen parameters (random
weights take the memory trained ones do), the collator, the tokenizer or processor, the loss
function, the optimizer's class and arguments where they were given, and the worst-case batch.
Where one of them cannot be sent to another process, or a class in the Trainer's order has an
``__init__`` of its own (TRL's trainers need their dataset), the trials stay in the caller's, and
a line says why.
"""

import contextlib
import copy
from dataclasses import dataclass
import logging
import pickle
import sys
from typing import Any, Callable, Optional, Tuple, Union
import warnings

import torch

from adaptive_batch.probe.child import TrialProcessNotStartedError
from adaptive_batch.probe.target import ProbeTarget


class _AtTheLoop(BaseException):  # not an Exception: a handler of those in train() must not take it
    """Raised from a trial Trainer's loop: ``train()`` has made the model what it trains."""


@dataclass(frozen=True)
class TrainerTrialBuild:
    """Picklable: builds, in a trial process, ``trainer_class`` on a fresh ``model_class`` and
    returns the probe target of its own training step (see :meth:`of`)."""

    trainer_class: type
    model_class: type
    model_config: Any
    model_dtype: torch.dtype
    frozen: Tuple[str, ...]
    args: Any
    data_collator: Any
    processing_class: Any
    compute_loss_func: Any
    optimizer_cls_and_kwargs: Any
    make_batch: Callable[[int], Any]
    # The run grows past the answer in micro-batches: its trials run two, as its steps will.
    grows_by_accumulation: bool = False
    # Imported once in the server the trial processes are forked from, not in each of them.
    preload = ("transformers", "adaptive_batch.hf.trainer")

    @classmethod
    def of(cls, trainer: Any, make_batch: Callable[[int], Any]) -> Union["TrainerTrialBuild", str]:
        """The build of ``trainer``'s step, or why there is none (a line's end)."""
        model = trainer.model
        own_init = _init_of_its_own(type(trainer))
        if own_init is not None:
            return f"{own_init.__name__} has an __init__ of its own, which a trial process cannot call as the run did"
        if getattr(trainer, "_optimizer_passed", False):
            return "the optimizer was passed to the Trainer (optimizers=...), and a trial process cannot make it again"
        if not hasattr(type(model), "_from_config") or getattr(model, "config", None) is None:
            return f"the model ({type(model).__name__}) is not a transformers model built from its config"
        if getattr(model, "peft_config", None) or getattr(model, "is_quantized", False) or getattr(model, "hf_device_map", None):
            return "the model has adapters, quantized weights or a device map, which its config does not make again"
        dtypes = {p.dtype for p in model.parameters()}
        if len(dtypes) > 1:
            return f"the model's parameters have several dtypes ({sorted(map(str, dtypes))}), which its config does not make again"
        build = cls(
            trainer_class=type(trainer), model_class=type(model), model_config=model.config, model_dtype=dtypes.pop(),
            frozen=tuple(name for name, p in model.named_parameters() if not p.requires_grad),
            args=_args_for_a_trial(trainer.args), data_collator=trainer.data_collator,
            processing_class=trainer.processing_class, compute_loss_func=getattr(trainer, "compute_loss_func", None),
            optimizer_cls_and_kwargs=getattr(trainer, "optimizer_cls_and_kwargs", None), make_batch=make_batch,
            grows_by_accumulation=trainer.trials_grow_by_accumulation(),
        )
        in_a_notebook = [part for part in (type(trainer), make_batch, trainer.data_collator)
                         if getattr(part, "__module__", None) == "__main__" or type(part).__module__ == "__main__"]
        if in_a_notebook and not hasattr(sys.modules["__main__"], "__file__"):
            return "a part of it is defined in a notebook or an interactive session, which a trial process cannot import"
        try:
            pickle.dumps(build)
        except Exception as e:  # noqa: BLE001 - whatever pickling raises, the trials stay here
            return f"a part of the Trainer cannot be sent to a trial process ({type(e).__name__}: {e})"
        return build

    def __call__(self) -> ProbeTarget:
        # The trial's own lines would repeat the run's setup once a trial: only errors show.
        logging.disable(logging.WARNING)
        warnings.simplefilter("ignore")
        model = self.model_class._from_config(self.model_config, dtype=self.model_dtype)
        for name, param in model.named_parameters():
            if name in self.frozen:
                param.requires_grad_(False)
        trainer = self.trainer_class(model=model, args=self.args, data_collator=self.data_collator,
                                     processing_class=self.processing_class, compute_loss_func=self.compute_loss_func,
                                     optimizer_cls_and_kwargs=self.optimizer_cls_and_kwargs, probe_eval=False)
        trainer._stop_at_the_loop = True
        trainer._trials_grow_by_accumulation = self.grows_by_accumulation
        try:
            trainer.train()  # its preparations (activation checkpointing, NEFTune), up to its loop
        except _AtTheLoop:
            pass
        # Held on the trainer: the forward stays wrapped (autocast) for the trial process's life.
        trainer._trial_forward = contextlib.ExitStack()
        trainer._trial_forward.enter_context(trainer._forward_as_trained)
        self.make_batch(1)  # a batch maker that cannot run here fails as the build, not as a trial
        return trainer.trial_target(self.make_batch)


def _init_of_its_own(trainer_class: type) -> Optional[type]:
    """The first class in ``trainer_class``'s order with an ``__init__`` other than
    ``AdaptiveBatchTrainer``'s and ``Trainer``'s (a user's subclass, TRL's ``SFTTrainer``, which
    needs its dataset), or ``None``."""
    from transformers import Trainer

    from adaptive_batch.hf.trainer import AdaptiveBatchTrainer

    for klass in trainer_class.__mro__:
        if klass in (AdaptiveBatchTrainer, Trainer):
            continue
        if "__init__" in vars(klass) and issubclass(klass, Trainer):
            return klass
    return None


def _args_for_a_trial(args: Any) -> Any:
    """The run's arguments less what a trial must not do: evaluate (it has no evaluation
    data), save, load the best model, push to the Hub or report to a tracker."""
    trial = copy.copy(args)
    for name, value in (("eval_strategy", "no"), ("save_strategy", "no"), ("load_best_model_at_end", False),
                        ("push_to_hub", False), ("report_to", [])):
        if hasattr(trial, name):
            setattr(trial, name, value)
    return trial


def stop_at_the_loop(trainer: Any) -> None:
    """In a trial process, ends ``train()`` where its loop would begin.

    Raises:
        _AtTheLoop: when ``trainer`` is a trial's.
    """
    if getattr(trainer, "_stop_at_the_loop", False):
        raise _AtTheLoop()


def why_trials_stay_here(error: RuntimeError) -> str:
    """What kept the trials from fresh processes, for the line that says they run here."""
    if isinstance(error, TrialProcessNotStartedError):
        return ("the trial processes could not import this script (run again as their main module, it does not stop "
                "at `if __name__ == \"__main__\":`; call trainer.train() under that guard for trials in fresh processes)")
    return f"a trial process could not build this Trainer ({str(error).strip().splitlines()[-1]})"
