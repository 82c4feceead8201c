"""A recipe's training parts built again in a trial process, from the run's own config.

Under a hard limit in address space the probe's trials run in fresh processes
(:mod:`adaptive_batch.probe.children`); each builds what it trains with :class:`RecipeTrialBuild`:
the recipe's own constructor and setup on the run's config, with the weights, data and tokenizer
the run reads and everything it would write sent to a scratch folder of the trial's own (its
metric log a plain disk log there), never probing (neither asked for nor for growth's bound), then
the recipe's own probe step (``probe_target()``).
"""

from contextlib import contextmanager
from dataclasses import dataclass
import importlib
import inspect
import logging
from pathlib import Path
import shutil
import tempfile
from typing import Any, Dict, Iterator
import warnings

from omegaconf import DictConfig, OmegaConf

from adaptive_batch.probe.target import ProbeTarget

# What a recipe's setup writes under: a trial's go to its scratch folder, never the run's.
_WRITTEN_KEYS = ("output_dir", "checkpointer.output_dir", "profiler.output_dir")
# What a trial must not do: probe (growth with no max_batch_size probes too), resume, save, draw,
# cache, or log anywhere but its scratch folder (a run's WandB logger would open a run a trial).
_TRIAL_SETTINGS: Dict[str, Any] = {
    "use_maximum_batch_size": False, "batch_increase_function": None, "batch_increase_interval": "epoch",
    "grow_with_accumulation": False, "resume_from_checkpoint": False, "save_every_n_steps": None, "plot": False,
    "probe_cache": False, "probe_cache_dir": None, "profiler.enabled": False,
    "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger"},
}


@dataclass(frozen=True)
class RecipeTrialBuild:
    """Picklable: builds, in a trial process, the recipe ``class_name`` of ``module`` (or of
    the file ``recipe_file`` when the module cannot be imported by name, as under ``tune run``)
    on ``config_yaml``, and returns its probe target. Each trial writes under a folder of its own
    in ``scratch_root``, which :meth:`of` removes with everything in it (a crashed trial's too)."""

    module: str
    class_name: str
    recipe_file: str
    config_yaml: str
    scratch_root: str
    # Imported once in the server the trial processes are forked from, not in each of them.
    preload = ("torchtune", "torchtune.training", "adaptive_batch.torchtune")

    @classmethod
    @contextmanager
    def of(cls, recipe: Any, cfg: DictConfig) -> Iterator["RecipeTrialBuild"]:
        """The build of ``recipe``'s class on ``cfg`` as it stands after the recipe's weights
        were settled (the files it loads, resolved), for the block: its scratch root goes after."""
        trial = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        for key, value in _TRIAL_SETTINGS.items():
            if "." not in key or OmegaConf.select(trial, key.rsplit(".", 1)[0]) is not None:
                OmegaConf.update(trial, key, value, merge=False, force_add=True)
        recipe_cls = type(recipe)
        root = tempfile.mkdtemp(prefix="adaptive-batch-trials-")
        try:
            yield cls(module=recipe_cls.__module__, class_name=recipe_cls.__qualname__,
                      recipe_file=_defining_file(recipe_cls), config_yaml=OmegaConf.to_yaml(trial), scratch_root=root)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def __call__(self) -> ProbeTarget:
        # The trial's own lines would repeat the run's setup once a trial: only errors show.
        logging.disable(logging.WARNING)
        warnings.simplefilter("ignore")
        scratch = tempfile.mkdtemp(dir=self.scratch_root)
        cfg = OmegaConf.create(self.config_yaml)
        for key in _WRITTEN_KEYS:
            if key == "output_dir" or OmegaConf.select(cfg, key) is not None:
                OmegaConf.update(cfg, key, f"{scratch}/{key.replace('.', '_')}", force_add=True)
        OmegaConf.update(cfg, "metric_logger.log_dir", f"{scratch}/logs", force_add=True)
        recipe = self._recipe_class()(cfg=cfg)
        recipe.setup(cfg=cfg)
        return recipe.probe_target()

    def _recipe_class(self) -> type:
        if self.module not in ("__main__", "__mp_main__"):
            try:
                return getattr(importlib.import_module(self.module), self.class_name)
            except ImportError:
                pass
        from adaptive_batch.torchtune.cli import load_recipe_file

        return getattr(load_recipe_file(Path(self.recipe_file)), self.class_name)


def _defining_file(cls: type) -> str:
    """The file ``cls`` was defined in, from its own methods' code: ``tune run`` runs a recipe as
    ``__main__`` without registering it (``runpy.run_module``), so its module names the launcher."""
    for value in vars(cls).values():
        if inspect.isfunction(value):
            return str(Path(value.__code__.co_filename).resolve())
    return str(Path(inspect.getfile(cls)).resolve())
