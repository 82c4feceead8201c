import pytest

from adaptive_batch import (
    check_adaptive_batch_options,
    check_known_keys,
    check_stock_recipe_options,
    ConfigError,
    default_safety_margin,
)

GOOD = dict(
    batch_size=4,
    use_maximum_batch_size=True,
    max_memory="1GiB",
    memory_safety_margin=None,
    batch_size_rounding="none",
    max_batch_size=None,
    device_type="cpu",
    device_capacity_bytes=8 * 1024**3,
)

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


def test_good_options():
    opts = check_adaptive_batch_options(**GOOD)
    assert opts.max_memory_bytes == 1024**3
    assert opts.memory_safety_margin == default_safety_margin("cpu") == 0.01
    assert default_safety_margin("cuda") == 0.05


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="unknown config key 'batch_sise'.*did you mean 'batch_size'"):
        check_known_keys(["batch_size", "batch_sise"], ["batch_size", "epochs"])
    with pytest.raises(ConfigError, match="known keys: batch_size, epochs"):
        check_known_keys(["zzz"], ["batch_size", "epochs"])
    check_known_keys(["epochs"], ["batch_size", "epochs"])


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("use_maximum_batch_size", "yes", "use_maximum_batch_size='yes' must be true or false"),
        ("use_maximum_batch_size", 1, "use_maximum_batch_size=1 must be true or false"),
        ("batch_size", 0, "batch_size=0 must be a positive integer"),
        ("batch_size", -3, "batch_size=-3 must be a positive integer"),
        ("batch_size", 2.5, "batch_size=2.5 must be a positive integer"),
        ("batch_size", True, "batch_size=True must be a positive integer"),
        ("max_memory", "lots", "max_memory='lots' cannot be parsed"),
        ("max_memory", 0, "max_memory=0 must be greater than zero"),
        ("max_memory", "-1GiB", "max_memory='-1GiB' cannot be parsed"),
        ("max_memory", "64GiB", "larger than the device"),
        ("memory_safety_margin", 1.0, "memory_safety_margin=1.0 must be a number in"),
        ("memory_safety_margin", -0.1, "memory_safety_margin=-0.1"),
        ("batch_size_rounding", "nearest", "batch_size_rounding='nearest' is not one of"),
        ("max_batch_size", 0, "max_batch_size=0 must be a positive integer or null"),
        ("batch_size_objective", "fastest", "batch_size_objective='fastest' is not one of"),
        ("throughput_tolerance", 1.0, "throughput_tolerance=1.0 must be a number in [0, 1)"),
        ("throughput_tolerance", "2%", "throughput_tolerance='2%' must be a number"),
        ("probe_cache", "no", "probe_cache='no' must be true or false"),
        ("probe_cache_dir", 5, "probe_cache_dir=5 must be a directory path or null"),
        ("plot", "yes", "plot='yes' must be true or false"),
    ],
)
def test_bad_adaptive_values(key, value, message):
    with pytest.raises(ConfigError) as info:
        check_adaptive_batch_options(**{**GOOD, key: value})
    assert message in str(info.value)


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


def test_stock_good():
    check_stock_recipe_options(**STOCK)


TOKENS = dict(
    max_tokens=2048,
    sequence_picking_order="dataloader",
    min_batch_size=1,
    max_batch_size=None,
    long_sample_policy="truncate",
    lr_scaling="none",
    lr_scaling_unit="samples",
    lr_scaling_reference=None,
    batch_size=4,
    packed=False,
)


def test_good_token_options_default_reference_is_batch_size():
    from adaptive_batch import check_token_batch_options

    opts = check_token_batch_options(**{**TOKENS, "lr_scaling": "sqrt"})
    assert opts.lr_scaling_reference == 4.0 and opts.max_tokens == 2048
    # the LR was set for the global batch: batch_size x accumulation steps
    opts = check_token_batch_options(**{**TOKENS, "max_tokens": None, "gradient_accumulation_steps": 3})
    assert opts.lr_scaling_reference == 12.0


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(max_tokens=0), "max_tokens=0 must be a positive integer or null"),
        (dict(max_tokens="lots"), "max_tokens='lots'"),
        (dict(sequence_picking_order="longest"), "sequence_picking_order='longest' is not one of"),
        (dict(min_batch_size=0), "min_batch_size=0 must be a positive integer"),
        (dict(min_batch_size=8, max_batch_size=4), "min_batch_size=8 is larger than max_batch_size=4"),
        (dict(long_sample_policy="drop"), "long_sample_policy='drop'"),
        (dict(packed=True), "max_tokens=2048 with dataset.packed=True"),
        (dict(lr_scaling="cubic"), "lr_scaling='cubic'"),
        (dict(lr_scaling_unit="bytes"), "lr_scaling_unit='bytes'"),
        (dict(lr_scaling_reference=-1), "lr_scaling_reference=-1"),
        (dict(lr_scaling="linear", lr_scaling_unit="tokens"), "lr_scaling_unit=tokens needs lr_scaling_reference"),
        (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=2 with max_tokens=2048"),
    ],
)
def test_bad_token_options(changes, message):
    from adaptive_batch import check_token_batch_options

    with pytest.raises(ConfigError) as info:
        check_token_batch_options(**{**TOKENS, **changes})
    assert message in str(info.value)
