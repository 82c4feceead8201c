"""TrainerTrialBuild: the Trainer's step made again from its parts, as a trial process makes it."""

import logging
import pickle
import warnings

import pytest
import torch

import adaptive_batch.hf.trainer as trainer_module
from adaptive_batch.hf import AdaptiveBatchTrainer
from adaptive_batch.data.worst_case import RepeatedSample
from adaptive_batch.hf.trainer_build import TrainerTrialBuild
from adaptive_batch.memory.tracker import measure_peak_bytes
from adaptive_batch.probe.child import TrialBuildError, TrialProcessNotStartedError
from tests.adaptive_batch.hf.test_trainer import _trainer


@pytest.fixture
def in_this_process():
    """A build silences logging and warnings for the trial process's life: here, for the test's."""
    with warnings.catch_warnings():
        yield
    logging.disable(logging.NOTSET)


def _warm_step_peak(target, batch_size):
    """The tensor peak of a step after one warm step (the optimizer's state exists)."""
    target.train_step(target.make_batch(batch_size))
    state = [*target.model.parameters(), *(v for s in target.optimizer.state.values() for v in s.values()
                                           if isinstance(v, torch.Tensor))]
    return measure_peak_bytes(lambda: target.train_step(target.make_batch(batch_size)), torch.device("cpu"), state)


def test_the_build_makes_a_step_that_costs_what_the_trainers_own_costs(tmp_path, in_this_process):
    # the optimizer named by class and arguments is the one a trial process makes
    trainer = _trainer(tmp_path, per_device=8, accumulation=2, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
    trainer.model.model.embed_tokens.weight.requires_grad_(False)  # frozen parts stay frozen
    make_batch = RepeatedSample.longest(trainer.train_dataset, trainer.data_collator)
    build = TrainerTrialBuild.of(trainer, make_batch)
    assert isinstance(build, TrainerTrialBuild), build
    built = pickle.loads(pickle.dumps(build))()  # what a trial process does
    own = trainer.trial_target(make_batch)
    trainer.model.train()
    assert type(built.model) is type(trainer.model) and built.model is not trainer.model
    assert [n for n, p in built.model.named_parameters() if not p.requires_grad] == ["model.embed_tokens.weight"]
    assert type(built.optimizer) is type(own.optimizer) is torch.optim.SGD
    assert _warm_step_peak(built, 4) == pytest.approx(_warm_step_peak(own, 4), rel=0.01)


def test_in_mixed_precision_the_built_forward_stays_wrapped_as_training_runs_it(tmp_path, in_this_process):
    """The build entered the autocast wrap without keeping it: it was undone at once, and trials in
    fresh processes ran a bf16 run's steps in fp32."""
    trainer = _trainer(tmp_path, training={"bf16": True})
    built = TrainerTrialBuild.of(trainer, RepeatedSample.longest(trainer.train_dataset, trainer.data_collator))()
    assert "forward" in vars(built.model)  # the instance's forward: the wrap, still in place
    with torch.no_grad():
        out = built.model(**built.make_batch(2))
    assert out.logits.dtype == torch.float32 and built.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32


def test_what_a_trial_process_cannot_make_again_keeps_the_trials_here_and_says_why(tmp_path):
    make_batch = RepeatedSample.longest(_trainer(tmp_path / "a").train_dataset, lambda samples: samples)
    model = _trainer(tmp_path / "b").model
    passed_optimizer = _trainer(tmp_path / "b", optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    assert "optimizers=" in TrainerTrialBuild.of(passed_optimizer, make_batch)
    mixed = _trainer(tmp_path / "m")
    mixed.model.lm_head.to(torch.bfloat16)
    assert "several dtypes" in TrainerTrialBuild.of(mixed, make_batch)

    class OwnInit(AdaptiveBatchTrainer):
        def __init__(self, *args, extra, **kwargs):
            super().__init__(*args, **kwargs)

    own_init = _trainer(tmp_path / "c")
    own_init.__class__ = OwnInit
    assert "__init__ of its own" in TrainerTrialBuild.of(own_init, make_batch)
    # a batch maker whose collate is a lambda cannot be pickled
    assert "cannot be sent to a trial process" in TrainerTrialBuild.of(_trainer(tmp_path / "d"), make_batch)


@pytest.mark.parametrize("failure, line", [
    (TrialProcessNotStartedError("the trial process at batch 1 exited with code 1 before its trial ran"),
     'could not import this script (run again as their main module, it does not stop at `if __name__ == "__main__":`'),
    (TrialBuildError("the trial process at batch 1 could not build what it trains:\nTraceback ...\n"
                     "OSError: Can't load tokenizer for 'tiny'\n"),
     "a trial process could not build this Trainer (OSError: Can't load tokenizer for 'tiny')"),
], ids=["unguarded-script", "build-fails"])
def test_where_trial_processes_cannot_run_the_trials_stay_here_with_a_line(tmp_path, monkeypatch, failure, line):
    real = trainer_module.find_max_batch_size
    builds, margins = [], []

    def trials_in_processes_fail(*args, build=None, **kwargs):
        builds.append(build)
        margins.append(kwargs.get("safety_margin"))
        if build is not None:
            raise failure
        return real(*args, build=None, **kwargs)

    monkeypatch.setattr(trainer_module, "find_max_batch_size", trials_in_processes_fail)
    monkeypatch.setattr(trainer_module, "address_space_limit", lambda: 2**40)  # a hard CPU limit
    trainer = _trainer(tmp_path, max_memory="20MiB", probe_eval=False)
    trainer.train()
    assert isinstance(builds[0], TrainerTrialBuild) and builds[1] is None
    assert margins == [None, None]  # the margins of where each ran: nothing else ran here
    assert any(line in said for said in trainer.lines), trainer.lines
    assert 1 < trainer.adaptive_batch["max_micro_batch_size"] < 16 and trainer.state.global_step == 2


def test_after_evaluation_trials_here_the_training_check_keeps_the_in_process_margin(tmp_path, monkeypatch):
    """The evaluation probe has no build: its trials (out-of-memory ones too) run in the process
    that trains, whose heap the training answer's check then holds 1% back for."""
    real = trainer_module.find_max_batch_size
    margins = []

    def recording(step, *args, build=None, **kwargs):
        margins.append((step.__name__, build is not None, kwargs.get("safety_margin")))
        return real(step, *args, build=None, **kwargs)

    monkeypatch.setattr(trainer_module, "find_max_batch_size", recording)
    monkeypatch.setattr(trainer_module, "address_space_limit", lambda: 2**40)  # a hard CPU limit
    _trainer(tmp_path, max_memory="20MiB").train()
    assert margins == [("_eval_step", False, None), ("_train_step", True, 0.01)]
