"""The Trainer's training step built again in a trial process, from the run's own parts.

Under a hard limit in address space the probe's trials run in fresh processes
(:mod:`adaptive_batch.probe.children`), as the recipes' do: a trial that runs out of memory in the
process that trains leaves its heap worse than a fresh one's (the Trainer answered 15 where 16
trains in fresh processes). :class:`TrainerTrialBuild` holds what a trial needs to make the same
step: the Trainer's class (a composition with TRL's ``SFTTrainer`` included) and arguments, the
model's class, configuration, dtype and frozen parameters (random weights take the memory trained
ones do), the collator, the tokenizer or processor, the loss function, the optimizer's class and
arguments where they were given, and the worst-case batch. Where one of them cannot be sent to another process the trials stay in
the caller's, and a line says why.
"""

from dataclasses import dataclass
import logging
import pickle
from typing import Any, Callable, Tuple, Union
import warnings

import torch

from adaptive_batch.probe.target import ProbeTarget


class _AtTheLoop(Exception):
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
    # Imported once in the server the trial processes are forked from, not in each of them.
    preload = ("transformers", "adaptive_batch.hf.trainer")

    @classmethod
    def of(cls, trainer: Any, make_batch: Callable[[int], Any]) -> Union["TrainerTrialBuild", str]:
        """The build of ``trainer``'s step, or why there is none (a line's end)."""
        from adaptive_batch.hf.trainer import AdaptiveBatchTrainer

        model = trainer.model
        if type(trainer).__init__ is not AdaptiveBatchTrainer.__init__:
            return f"{type(trainer).__name__} has an __init__ of its own, which a trial process cannot call"
        if trainer.optimizer is not None:
            return "the optimizer was passed to the Trainer (optimizers=...), and a trial process cannot make it again"
        if not hasattr(type(model), "_from_config") or getattr(model, "config", None) is None:
            return f"the model ({type(model).__name__}) is not a transformers model built from its config"
        if getattr(model, "peft_config", None) or getattr(model, "is_quantized", False) or getattr(model, "hf_device_map", None):
            return "the model has adapters, quantized weights or a device map, which its config does not make again"
        build = cls(
            trainer_class=type(trainer), model_class=type(model), model_config=model.config,
            model_dtype=next(model.parameters()).dtype,
            frozen=tuple(name for name, p in model.named_parameters() if not p.requires_grad),
            args=trainer.args, data_collator=trainer.data_collator, processing_class=trainer.processing_class,
            compute_loss_func=getattr(trainer, "compute_loss_func", None),
            optimizer_cls_and_kwargs=getattr(trainer, "optimizer_cls_and_kwargs", None), make_batch=make_batch,
        )
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
        try:
            trainer.train()  # its preparations (activation checkpointing, NEFTune), up to its loop
        except _AtTheLoop:
            pass
        trainer._forward_as_trained.__enter__()  # for the process's life: it ends with the trial
        return trainer.trial_target(self.make_batch)


def stop_at_the_loop(trainer: Any) -> None:
    """In a trial process, ends ``train()`` where its loop would begin.

    Raises:
        _AtTheLoop: when ``trainer`` is a trial's.
    """
    if getattr(trainer, "_stop_at_the_loop", False):
        raise _AtTheLoop()
