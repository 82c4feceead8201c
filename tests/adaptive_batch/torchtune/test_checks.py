"""The config checks: every refusal of a run's settings before anything expensive, one line each."""

from pathlib import Path

from omegaconf import OmegaConf
import pytest

from adaptive_batch import ConfigError
from adaptive_batch.torchtune import check_profiler, check_stock_recipe_options, load_config

REPO = Path(__file__).resolve().parents[3]
TINY_CONFIG = str(REPO / "configs" / "tiny" / "full_single_device.yaml")

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


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("model._component_", "torchtune.models.llama3_2.llama3_2_1bb", "did you mean 'torchtune.models.llama3_2.llama3_2_1b'?"),
        ("model._component_", "torchtune.models.llama3_2.nope", "'torchtune.models.llama3_2' has no 'nope'"),
        ("optimizer._component_", "nosuch.Optim", "check the spelling, and that its package is installed"),
        ("loss._component_", "", "must be a dotted path"),
    ],
)
def test_a_component_that_does_not_import_is_one_line(key, value, message):
    from adaptive_batch.torchtune.checks import check_components

    cfg = load_config(TINY_CONFIG, [f"{key}={value}"] if value else [])
    if not value:
        OmegaConf.update(cfg, key, "")
    with pytest.raises(ConfigError) as info:
        check_components(cfg)
    assert str(info.value).startswith(f"{key}={value!r} ") and message in str(info.value)
    check_components(load_config(TINY_CONFIG, []))


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
