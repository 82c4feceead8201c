"""A recipe config's first guess: fake steps of its model, or none where they would not be its step."""

from pathlib import Path

from omegaconf import OmegaConf
import pytest

from adaptive_batch.logs import lines_to
from adaptive_batch.torchtune.planning import ConfigFirstGuess
from tests.recipes.conftest import SMALL_MODEL

REPO = Path(__file__).resolve().parents[3]


def _config(name, *dotlist, **overrides):
    cfg = OmegaConf.merge(OmegaConf.load(REPO / "configs" / "tiny" / name), OmegaConf.from_dotlist(list(dotlist)))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_a_lora_configs_guess_trains_the_adapters_alone_and_a_global_batch_counts_two_micro_batches():
    """Only the adapters have gradients and optimizer state, so LoRA's guess is above the full
    model's at the same budget; a trial of two micro-batches (a global batch) holds more."""
    budget = 64 * 2**20
    full = ConfigFirstGuess(_config("full_single_device.yaml", *SMALL_MODEL))(budget, None)
    lora = ConfigFirstGuess(_config("lora_single_device.yaml", *SMALL_MODEL))(budget, None)
    two = ConfigFirstGuess(_config("full_single_device.yaml", *SMALL_MODEL), micro_batches=lambda b: 2)(budget, None)
    assert full is not None and lora is not None and two is not None
    assert lora.batch_size > full.batch_size >= two.batch_size > 1
    capped = ConfigFirstGuess(_config("full_single_device.yaml", *SMALL_MODEL))(budget, 5)
    assert capped.batch_size == 5


@pytest.mark.parametrize("overrides,reason", [
    ({"compile": True}, "compile=True is not what a fake step runs"),
    ({"optimizer_in_bwd": True}, "optimizer_in_bwd=True is not what a fake step runs"),
    ({"tokenizer.max_seq_len": None}, "tokenizer.max_seq_len is null"),
])
def test_no_guess_where_the_fake_step_is_not_the_recipes_step(overrides, reason):
    lines = []
    with lines_to(lines.append):
        assert ConfigFirstGuess(_config("full_single_device.yaml", **overrides))(512 * 2**20, None) is None
    assert lines == [f"probe: no first guess from fake steps: {reason}; the real steps measure the line."]


def test_no_guess_for_nf4_base_weights():
    lines = []
    with lines_to(lines.append):
        assert ConfigFirstGuess(_config("lora_single_device.yaml", **{"model.quantize_base": True}))(2**30, None) is None
    assert "fake tensors cannot hold NF4 base weights" in lines[0]


def test_a_cuda_plan_holds_the_steps_two_cublas_workspaces_and_a_cpu_plan_none(monkeypatch):
    """Fake tensors make no cuBLAS workspace; a card's step holds one per thread (forward, backward)."""
    from adaptive_batch.torchtune.planning import plan_from_config

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # 128 KiB each, as torch reads it
    cfg = _config("full_single_device.yaml", *SMALL_MODEL)
    cpu = plan_from_config(cfg, device_memory_bytes=None, safety_margin=0.0)
    cuda = plan_from_config(cfg, device_memory_bytes=None, safety_margin=0.0, device_type="cuda")
    assert cuda.row_at(4).peak_bytes - cpu.row_at(4).peak_bytes == 2 * 128 * 1024
    assert any("cuBLAS workspaces of 0.125 MiB" in a for a in cuda.assumptions)
    assert not any("cuBLAS" in a for a in cpu.assumptions)


@pytest.mark.parametrize("name, trainable", [("full_single_device.yaml", None), ("lora_single_device.yaml", "adapters")])
def test_the_noise_scales_copy_of_the_trainable_gradients_is_planned(name, trainable):
    """The probe counts the micro-batch estimator's fp32 copy of the gradients; the plan answered
    one more than the probe (17 where 16 trained). On the small model: a fake step costs what its
    operators do, and the copy's size is the model's trainable parameters at any size."""
    import torch

    from adaptive_batch.torchtune.planning import _RecipeStep, plan_from_config
    from torchtune import config

    plain = plan_from_config(_config(name, *SMALL_MODEL), device_memory_bytes=None, safety_margin=0.0)
    cfg = _config(name, *SMALL_MODEL, measure_noise_scale=True)
    noisy = plan_from_config(cfg, device_memory_bytes=None, safety_margin=0.0)
    step = _RecipeStep(cfg, cfg.model, torch.float32, config.instantiate(cfg.loss), lambda params: None)
    with torch.device("meta"):
        model = step.build_model()
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert (trainable == "adapters") == (counted < sum(p.numel() for p in model.parameters()))
    assert noisy.row_at(4).peak_bytes - plain.row_at(4).peak_bytes == 4 * counted
    assert any("fp32 copy of the trainable gradients" in a for a in noisy.assumptions)
    if trainable is None:  # no copy where it reads each example's norm-layer gradients
        layers = _config(name, *SMALL_MODEL, measure_noise_scale=True, noise_scale_estimator="norm_layers")
        assert plan_from_config(layers, device_memory_bytes=None, safety_margin=0.0).row_at(4).peak_bytes == (
            plain.row_at(4).peak_bytes)


@pytest.mark.parametrize("config, expected", [
    (None, 32 * 2**20),  # torch's default on Hopper
    (":4096:2:16:8", (4096 * 2 + 16 * 8) * 1024),
    (":0:0", 0),
])
def test_a_cublas_workspace_is_the_config_pairs_summed(monkeypatch, config, expected):
    from adaptive_batch.memory.device import cublas_workspace_bytes

    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert cublas_workspace_bytes() == expected
