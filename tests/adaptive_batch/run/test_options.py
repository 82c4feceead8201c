"""The settings and their combination rules: those on the settings alone fire when the options
are built, those on the run in validate(), each one line naming the keys and the fix."""

import pytest
import torch

from adaptive_batch import AdaptiveBatchOptions, ConfigError, ProbeOptions
from adaptive_batch.data.token_budget import TokenBatchOptions
from adaptive_batch.run.options import RUN_RULES, RunContext, SETTING_RULES
from adaptive_batch.schedule.growth import GrowthOptions
from adaptive_batch.schedule.noise_scale import NoiseScaleOptions

CPU = torch.device("cpu")
GROW = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch")


def test_keys_are_the_sections_fields():
    keys = AdaptiveBatchOptions.keys()
    assert {"use_maximum_batch_size", "max_memory", "batch_increase_function", "max_tokens", "lr_scaling"} <= keys
    assert len(keys) == 29  # + noise_scale_split_step, weight_decay_scaling, probe_time_budget, noise_scale_estimator, probe_first_guess
    opts = AdaptiveBatchOptions.from_flat({"max_tokens": 64, "lr_scaling": "sqrt", "plot": False})
    assert opts.tokens.max_tokens == 64 and opts.lr_scaling.lr_scaling == "sqrt" and opts.probe == ProbeOptions()
    with pytest.raises(ConfigError, match="unknown adaptive-batch setting 'max_tokenz'"):
        AdaptiveBatchOptions.from_flat({"max_tokenz": 64})


@pytest.mark.parametrize(
    "sections,message",
    [
        (dict(probe=ProbeOptions(max_batch_size=4), tokens=TokenBatchOptions(min_batch_size=8)),
         "min_batch_size=8 is larger than max_batch_size=4"),
        (dict(tokens=TokenBatchOptions(max_tokens=2048), growth=GROW), "with max_tokens=2048: token-budget batches"),
        (dict(growth=GrowthOptions(batch_increase_interval="5 steps")), "without a batch_increase_function"),
    ],
)
def test_rules_on_the_settings_alone_fire_when_the_options_are_built(sections, message):
    with pytest.raises(ConfigError) as info:
        AdaptiveBatchOptions(**sections)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "sections,run,message",
    [
        (dict(probe=ProbeOptions(max_memory="100TiB")), {}, "larger than the device"),
        (dict(tokens=TokenBatchOptions(max_tokens=2048)), dict(packed=True), "max_tokens=2048 with dataset.packed=True"),
        (dict(tokens=TokenBatchOptions(max_tokens=2048)), dict(gradient_accumulation_steps=2),
         "gradient_accumulation_steps=2 with max_tokens=2048"),
        (dict(growth=GROW), dict(optimizer_in_bwd=True), "with optimizer_in_bwd=True: both split steps"),
        (dict(growth=GrowthOptions(retry_on_oom=True)), dict(optimizer_in_bwd=True), "retry_on_oom=True with optimizer_in_bwd=True"),
        (dict(growth=GrowthOptions(retry_on_oom=False), noise=NoiseScaleOptions(measure_noise_scale=True)),
         dict(optimizer_in_bwd=True), "measure_noise_scale=True with optimizer_in_bwd=True"),
        (dict(probe=ProbeOptions(use_maximum_batch_size=True)), dict(max_seq_len=None), "tokenizer.max_seq_len=null"),
        (dict(growth=GROW), dict(max_seq_len=None), "tokenizer.max_seq_len=null"),
        (dict(probe=ProbeOptions(use_maximum_batch_size=True)), dict(device=torch.device("meta")),
         "device='meta': the probe measures memory on cpu and cuda only"),
    ],
)
def test_rules_on_the_run_fire_in_validate(sections, run, message):
    options = AdaptiveBatchOptions(**sections)  # fine on their own
    context = RunContext(**{"device": CPU, "max_seq_len": 16, **run})
    with pytest.raises(ConfigError) as info:
        options.validate(context)
    assert message in str(info.value)


def test_good_settings_pass_every_rule_and_the_lists_hold_them_all():
    options = AdaptiveBatchOptions(probe=ProbeOptions(use_maximum_batch_size=True), growth=GROW)
    options.validate(RunContext(CPU, max_seq_len=16))
    assert options.needs_probe and options.growing
    assert len(SETTING_RULES) == 5 and len(RUN_RULES) == 7
    assert not AdaptiveBatchOptions(probe=ProbeOptions(max_batch_size=8), growth=GROW).needs_probe
