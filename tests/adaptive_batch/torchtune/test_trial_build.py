"""A recipe built again in a trial process from the run's own config: it reads what the run reads,
writes nothing of the run's, never probes, and trains the recipe's own probe step."""

import dataclasses
from pathlib import Path
import pickle

from omegaconf import OmegaConf
import pytest

from adaptive_batch.probe.child import child_trial
from adaptive_batch.torchtune.cli import load_recipe_class
from adaptive_batch.torchtune.config import adaptive_options, load_config
from adaptive_batch.torchtune.trial_build import RecipeTrialBuild
from tests.recipes.conftest import CONFIG, REPO


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run set up as the probe finds it: growth on (the tiny config's), a WandB-less logger."""
    out = tmp_path_factory.mktemp("run")
    # max_batch_size bounds growth here, so this setup does not probe
    cfg = load_config(str(REPO / CONFIG), [f"output_dir={out}", "plot=True", "max_batch_size=8"])
    recipe = load_recipe_class(cfg, None)(cfg=cfg)
    try:
        recipe.setup(cfg=cfg)
        cfg.max_batch_size = None  # as a run whose growth has no other bound than the probe's answer
        yield out, recipe, cfg
    finally:
        recipe.cleanup()


def test_a_trial_reads_the_runs_weights_and_data_and_never_probes_resumes_or_logs_elsewhere(run):
    out, recipe, cfg = run
    assert adaptive_options(cfg).needs_probe  # the run's own settings would probe
    with RecipeTrialBuild.of(recipe, cfg) as trial:
        trial_cfg = OmegaConf.create(trial.config_yaml)
        assert pickle.loads(pickle.dumps(trial)) == trial
    # once a trial probed inside its own setup, and its grandchild could not start
    assert not adaptive_options(trial_cfg).needs_probe
    assert trial_cfg.checkpointer.checkpoint_dir == f"{out}/init" and trial_cfg.checkpointer.checkpoint_files
    assert trial_cfg.dataset.data_dir == f"{out}/data"
    assert (trial_cfg.resume_from_checkpoint, trial_cfg.probe_cache, trial_cfg.plot) == (False, False, False)
    assert trial_cfg.metric_logger == {"_component_": "torchtune.training.metric_logging.DiskLogger"}
    assert not Path(trial.scratch_root).exists()  # the block removed its scratch root


@pytest.mark.slow
@pytest.mark.parametrize("by", ["module", "file"])
def test_a_trial_process_trains_the_recipes_step_and_writes_nothing_of_the_run(run, by):
    out, recipe, cfg = run
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with RecipeTrialBuild.of(recipe, cfg) as trial:
        if by == "file":  # a recipe run as `tune run recipes/x.py` is the main module: found by its file
            trial = dataclasses.replace(trial, module="__main__")
        added = child_trial(trial, headroom_bytes=2**30, steps=1)(2)
        root = Path(trial.scratch_root)
    assert 0 < added < 2**30
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert not root.exists()
