"""The config adapter: torchtune's keys and configs onto the library's options."""

from pathlib import Path

from omegaconf import OmegaConf
import pytest
import torchtune

from adaptive_batch import AdaptiveBatchOptions, ConfigError, double_every_epoch
from adaptive_batch.torchtune import (
    TORCHTUNE_KEYS,
    adaptive_options,
    check_profiler,
    check_stock_recipe_options,
    load_config,
    recipe_keys,
)

REPO = Path(__file__).resolve().parents[3]
TORCHTUNE_CONFIGS = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "configs"

STOCK = dict(
    dtype="fp32",
    device_type="cpu",
    optimizer_in_bwd=False,
    gradient_accumulation_steps=1,
    clip_grad_norm=None,
    enable_activation_checkpointing=False,
    enable_activation_offloading=False,
    collate_fn="torchtune.data.padded_collate_sft",
    compile_model=False,
    use_maximum_batch_size=False,
)


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


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(dtype="fp16"), "dtype='fp16'"),
        (dict(optimizer_in_bwd=True, clip_grad_norm=1.0), "clip_grad_norm=1.0 with optimizer_in_bwd=True"),
        (dict(optimizer_in_bwd=True, gradient_accumulation_steps=4), "gradient_accumulation_steps=4 with optimizer_in_bwd"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps=0 must be a positive integer"),
        (dict(enable_activation_offloading=True), "enable_activation_offloading=True on device='cpu'"),
        (dict(enable_activation_offloading=True, device_type="cuda"), "needs enable_activation_checkpointing=True"),
        (dict(collate_fn="torchtune.data.left_pad_sequence"), "inference only"),
        (dict(compile_model=True, device_type="npu"), "compile=True on device='npu'"),
        (dict(use_maximum_batch_size=True, optimizer_in_bwd=True), "use_maximum_batch_size=True with optimizer_in_bwd=True"),
    ],
)
def test_stock_incompatibilities(changes, message):
    with pytest.raises(ConfigError) as info:
        check_stock_recipe_options(**{**STOCK, **changes})
    assert message in str(info.value)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(dtype="bf16", optimizer_in_bwd=True),
        dict(enable_activation_offloading=True, enable_activation_checkpointing=True, device_type="cuda"),
        dict(gradient_accumulation_steps=8, clip_grad_norm=1.0, compile_model=True),
    ],
)
def test_stock_combinations_torchtune_runs_are_accepted(changes):
    assert check_stock_recipe_options(**{**STOCK, **changes}) is None


def test_memory_profiling_off_cuda_is_refused():
    on = OmegaConf.create({"enabled": True, "profile_memory": True})
    with pytest.raises(ConfigError, match="profiler.profile_memory=True on device='cpu'"):
        check_profiler(on, "cpu")
    check_profiler(on, "cuda")
    check_profiler(OmegaConf.create({"enabled": False, "profile_memory": True}), "cpu")
    check_profiler(None, "cpu")


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "nope.yaml"), [])
    with pytest.raises(ConfigError, match="override 'batch_size' is not key=value"):
        load_config(str(REPO / "configs" / "tiny" / "full_single_device.yaml"), ["batch_size"])


def test_writable_dir_check_leaves_nothing_and_names_what_is_in_the_way(tmp_path):
    from adaptive_batch.torchtune.checks import check_writable_dir

    target = tmp_path / "a" / "b" / "c"
    assert check_writable_dir("output_dir", str(target)) == str(target)
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing left
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_writable_dir("output_dir", str(blocker))
    with pytest.raises(ConfigError, match=r"cannot be written \('.*file' is a file\)"):
        check_writable_dir("output_dir", str(blocker / "sub"))


def test_writable_dir_check_is_safe_when_ranks_run_it_at_once(tmp_path):
    # Two ranks check the same missing directory together (the distributed recipe does).
    import threading

    from adaptive_batch.torchtune.checks import check_writable_dir

    errors = []

    def check():
        try:
            for _ in range(200):
                check_writable_dir("probe_cache_dir", str(tmp_path / "out" / "probe_cache"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=check) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
