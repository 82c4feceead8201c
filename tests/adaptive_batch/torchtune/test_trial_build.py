"""A recipe built again in a trial process from the run's own config: it reads what the run reads,
writes nothing of the run's, and trains the recipe's own probe step."""

import dataclasses
import pickle

from omegaconf import OmegaConf
import pytest

from adaptive_batch.probe.child import child_trial
from adaptive_batch.torchtune.cli import load_recipe_class
from adaptive_batch.torchtune.config import load_config
from adaptive_batch.torchtune.trial_build import RecipeTrialBuild
from tests.recipes.conftest import CONFIG, FIXED, REPO


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # the parts the probe would train, without probing (a trial builds from this state)
    cfg = load_config(str(REPO / CONFIG), [f"output_dir={out}", FIXED, "plot=True", "probe_cache=True"])
    recipe = load_recipe_class(cfg, None)(cfg=cfg)
    try:
        recipe.setup(cfg=cfg)
        yield out, RecipeTrialBuild.of(recipe, cfg)
    finally:
        recipe.cleanup()


def test_a_trial_reads_the_runs_weights_and_data_and_neither_probes_nor_resumes(build):
    out, trial = build
    cfg = OmegaConf.create(trial.config_yaml)
    assert cfg.checkpointer.checkpoint_dir == f"{out}/init" and cfg.checkpointer.checkpoint_files
    assert cfg.dataset.data_dir == f"{out}/data"
    assert (cfg.use_maximum_batch_size, cfg.resume_from_checkpoint, cfg.probe_cache, cfg.plot) == (False, False, False, False)
    assert pickle.loads(pickle.dumps(trial)) == trial


@pytest.mark.slow
@pytest.mark.parametrize("by", ["module", "file"])
def test_a_trial_process_trains_the_recipes_step_and_writes_nothing_of_the_run(build, by):
    out, trial = build
    if by == "file":  # a recipe run as `tune run recipes/x.py` is the main module: found by its file
        trial = dataclasses.replace(trial, module="__main__")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    added = child_trial(trial, headroom_bytes=2**30, steps=1)(2)
    assert 0 < added < 2**30
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
