"""The LoRA recipe through the real `tune run` on the tiny LoRA config, on CPU."""

import json

import torch

from tests.recipes.conftest import SMALL_MODEL, read_metric_log, run_tune

RECIPE = "recipes/lora_finetune_single_device.py"
CONFIG = "configs/tiny/lora_single_device.yaml"


def test_probe_bounds_growth_and_only_adapters_train(tmp_path):
    proc = run_tune(
        tmp_path, *SMALL_MODEL, "use_maximum_batch_size=True", "max_memory=32MiB", "epochs=2", "max_steps_per_epoch=2",
        recipe=RECIPE, config=CONFIG,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "batch_probe.json").read_text())
    assert report["max_batch_size"] >= 8  # the bound is above the doubled batch
    rows = read_metric_log(tmp_path)
    assert [r["batch_size"] for r in rows] == [4, 4, 8]  # an epoch of 2 x 4 samples; doubled in epoch 1
    assert all(r["lr"] == 1e-3 for r in rows)  # lr_scaling: none leaves the LR as configured
    # adapters and merged weights for each epoch; the base weights never changed
    base = torch.load(next((tmp_path / "init").glob("*.pt")), weights_only=True)
    assert not any("lora" in k for k in base)
    adapter = torch.load(tmp_path / "epoch_1/adapter_model.pt", weights_only=True)
    assert adapter and all("lora" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_b" in k)  # lora_b starts at 0: it trained
    merged = torch.load(tmp_path / "epoch_1/model-00001-of-00001.bin", weights_only=True)
    assert set(merged) == set(base)
    assert torch.equal(merged["tok_embeddings.weight"], base["tok_embeddings.weight"])  # not adapted: unchanged
    assert not torch.equal(merged["layers.0.attn.q_proj.weight"], base["layers.0.attn.q_proj.weight"])


def test_lora_bad_input_fails_before_the_model_is_built(tmp_path):
    for overrides, message in [
        (["optimizer_in_bwd=True"], "optimizer_in_bwd=True: the LoRA recipe"),
        (["save_adapter_weights_only=maybe"], "save_adapter_weights_only='maybe' must be true or false"),
        (["batch_increase_function=my_growth.nope"], "no module 'my_growth' can be imported"),
        (["measure_noise_scale=True", "noise_scale_estimator=norm_layers"], "the norm layers are frozen"),
    ]:
        out = tmp_path / overrides[0].split("=")[0]
        proc = run_tune(out, *overrides, recipe=RECIPE, config=CONFIG)
        assert proc.returncode == 1 and "error: " in proc.stderr and message in proc.stderr
        assert not (out / "init").exists()
