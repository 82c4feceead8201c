"""The config adapter: torchtune's keys and configs onto the library's options."""

from pathlib import Path

from omegaconf import OmegaConf
import pytest
import torchtune

from adaptive_batch import AdaptiveBatchOptions, ConfigError, double_every_epoch
from adaptive_batch.torchtune import (
    TORCHTUNE_KEYS,
    adaptive_options,
    load_config,
    recipe_keys,
)

REPO = Path(__file__).resolve().parents[3]
TORCHTUNE_CONFIGS = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "configs"


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs" / "tiny").glob("*.yaml")))
def test_every_key_of_our_configs_is_known_and_the_adaptive_ones_are_all_there(config):
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / config)
    extra = {"fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "save_adapter_weights_only"}
    assert set(cfg.keys()) <= recipe_keys(extra)
    # the configs spell every adaptive key out, even when off
    assert AdaptiveBatchOptions.keys() <= set(cfg.keys())


def test_torchtunes_own_recipe_keys_are_known():
    cfg = OmegaConf.load(TORCHTUNE_CONFIGS / "llama3_2" / "1B_full_single_device.yaml")
    assert set(cfg.keys()) <= TORCHTUNE_KEYS
    assert not set(cfg.keys()) & AdaptiveBatchOptions.keys()


def test_adaptive_options_from_a_config():
    cfg = load_config(str(REPO / "configs" / "tiny" / "full_single_device.yaml"), ["max_memory=1GiB", "lr_scaling=sqrt"])
    opts = adaptive_options(cfg)
    assert opts.probe.max_memory == "1GiB" and opts.lr_scaling.lr_scaling == "sqrt"
    assert opts.growth.batch_increase_function is double_every_epoch
    assert opts.probe.probe_cache_dir.endswith("probe_cache")  # interpolated from output_dir


def test_absent_keys_keep_the_defaults():
    assert adaptive_options(OmegaConf.create({"batch_size": 4})) == AdaptiveBatchOptions()


def test_parameterised_growth_component():
    cfg = OmegaConf.create(
        {"batch_increase_function": {"_component_": "adaptive_batch.multiply_every", "factor": 2, "every_n_epochs": 2}}
    )
    fn = adaptive_options(cfg).growth.batch_increase_function
    assert [fn(e, 4) for e in range(4)] == [0, 0, 4, 0]
    bad = OmegaConf.create({"batch_increase_function": {"_component_": "adaptive_batch.multiply_every", "factor": 0.5}})
    with pytest.raises(ConfigError, match="batch_increase_function: building 'adaptive_batch.multiply_every'"):
        adaptive_options(bad)


def test_a_bare_growth_factor_node_is_built_like_any_component():
    # was refused: a node with only _component_ named the function itself, so the factory
    # noise_scale_growth (every argument defaulted) was taken for a growth function
    node = {"_component_": "adaptive_batch.noise_scale_growth"}
    built = adaptive_options(OmegaConf.create({"batch_increase_function": node, "measure_noise_scale": True}))
    assert built.growth.batch_increase_function.__qualname__.startswith("noise_scale_growth.")
    # a growth function (arguments required) is still the function itself
    node = OmegaConf.create({"batch_increase_function": {"_component_": "adaptive_batch.double_every_epoch"}})
    assert adaptive_options(node).growth.batch_increase_function is double_every_epoch


TINY_CONFIG = str(REPO / "configs" / "tiny" / "full_single_device.yaml")


@pytest.mark.parametrize(
    "text,overrides,message",
    [
        (None, ["batch_size"], "override 'batch_size' is not key=value"),
        # these were tracebacks from the YAML parser
        ("batch_size: [1, 2\nepochs: 1\n", [], "is not valid YAML: line 2, column 7: did not find expected ',' or ']'"),
        ("- a\n- b\n", [], "holds a ListConfig, not a mapping of keys"),
        (b"\x7fELF\x02\x01\x01\x00\xd0\xff binary", [], "is not text (byte 8 is no UTF-8)"),  # a UnicodeDecodeError
        (None, ["batch_size=[1"], "override 'batch_size=[1' does not parse"),
        (None, ["~batch_sise"], "Could not find key batch_sise"),
    ],
)
def test_a_config_that_does_not_load_is_one_line(tmp_path, text, overrides, message):
    from adaptive_batch.torchtune import check_command_line

    path = TINY_CONFIG
    if text is not None:
        path = str(tmp_path / "bad.yaml")
        Path(path).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert message in str(info.value)
    with pytest.raises(SystemExit) as stop:  # what a recipe's __main__ runs first
        check_command_line(["--config", path, *overrides])
    assert str(stop.value.code).startswith("error: ") and message in str(stop.value.code)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "nope.yaml"), [])
    assert check_command_line(["--config", TINY_CONFIG, "batch_size=3", "~profiler.enabled"]) is None


def test_out_of_memory_building_a_component_is_not_blamed_on_its_settings():
    from adaptive_batch.torchtune.config import build

    node = OmegaConf.create({"_component_": "tests.adaptive_batch.torchtune.test_config._allocates_too_much"})
    with pytest.raises(ConfigError) as info:
        build("dataset", node)
    message = str(info.value)
    assert "dataset: building" in message and "ran out of memory (MemoryError)" in message
    assert "raise the memory limit" in message and "failed:" not in message


def _allocates_too_much():
    raise MemoryError()




def test_what_fits_is_a_trained_setting_only_where_the_probes_answer_is_trained():
    """Resumed with checkpointing off, the probe's saved answer trained at 2.4 times the budget;
    without the probe the same change trains the same rows."""
    from omegaconf import OmegaConf

    from adaptive_batch.torchtune.config import trained_settings

    probed = trained_settings(OmegaConf.create({"use_maximum_batch_size": True, "enable_activation_checkpointing": True}))
    assert probed["enable_activation_checkpointing"] is True and "enable_activation_offloading" in probed
    assert "enable_activation_checkpointing" not in trained_settings(OmegaConf.create({"enable_activation_checkpointing": True}))
