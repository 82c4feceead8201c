"""The recipe through the real `tune run` on the tiny config, on CPU."""

import json
import math
import os
import shutil
import threading
import traceback

import pytest
import torch

from adaptive_batch.memory.budget import FRESH_PROCESS_MARGIN
from tests.recipes.conftest import FIXED, SMALL_MODEL, read_metric_log, run_tune

BAD_INPUTS = [
    (["use_maximum_batch_size=maybe"], "use_maximum_batch_size='maybe' must be true or false"),
    (["use_maximum_batch_size=1"], "use_maximum_batch_size=1 must be true or false"),
    (["max_memory=lots"], "max_memory='lots' cannot be parsed"),
    (["max_memory=0"], "max_memory=0 must be greater than zero"),
    (["max_memory=-2"], "max_memory=-2 must be greater than zero"),
    (["max_memory=100TiB"], "larger than the device"),
    (["batch_size=0"], "batch_size=0 must be a positive integer"),
    (["batch_size=two"], "batch_size='two' must be a positive integer"),
    (["batch_sise=8"], "unknown config key 'batch_sise'"),
    (["memory_safety_margin=2"], "memory_safety_margin=2 must be a number in [0, 1)"),
    (["batch_size_rounding=up"], "batch_size_rounding='up' is not one of"),
    (["dtype=fp16"], "dtype='fp16'"),
    (["optimizer_in_bwd=True", "gradient_accumulation_steps=2"], "gradient_accumulation_steps=2 with optimizer_in_bwd=True"),
    (["enable_activation_offloading=True"], "enable_activation_offloading=True on device='cpu'"),
    (["use_maximum_batch_size=True", "tokenizer.max_seq_len=null"], "tokenizer.max_seq_len=null"),
    # was a ValueError from the model's forward at the first step
    (["tokenizer.max_seq_len=4096"], "tokenizer.max_seq_len=4096 is longer than model.max_seq_len=256"),
    (["profiler.enabled=True", "profiler.profile_memory=True"], "profiler.profile_memory=True on device='cpu'"),
    (["batch_increase_function=nosuch_module.grow"], "no module 'nosuch_module' can be imported"),
    (["batch_increase_function=adaptive_batch.schedule.growth.nope"], "has no attribute 'nope'"),
    (["batch_increase_function=adaptive_batch.schedule.growth.KEY"], "is a str, not a function"),
    (["batch_increase_function=adaptive_batch.schedule.growth.function_name"], "cannot be called as f(epoch, current_batch_size)"),
    (["grow_with_accumulation=maybe"], "grow_with_accumulation='maybe' must be true or false"),
    (["retry_on_oom=2"], "retry_on_oom=2 must be true or false"),
    (["optimizer_in_bwd=True", "batch_increase_function=null", "retry_on_oom=True"], "retry_on_oom=True with optimizer_in_bwd=True"),
    (["batch_increase_interval=10 minutes"], "batch_increase_interval='10 minutes' is not an interval"),
    (["batch_increase_interval=5 steps", "batch_increase_function=null"], "without a batch_increase_function: nothing would grow"),
    (["global_batch_size=6", "gradient_accumulation_steps=2"], "gradient_accumulation_steps=2 with global_batch_size=6"),
    (["global_batch_size=-4"], "global_batch_size=-4 must be"),
    (["save_every_n_steps=0"], "save_every_n_steps=0 must be"),
    (["keep_last_n_checkpoints=none"], "keep_last_n_checkpoints='none' must be"),
    (["resume_from_checkpoint=latest"], "resume_from_checkpoint='latest': use True (resume), False (start afresh) or auto"),
    (["noise_scale_estimator=layers"], "noise_scale_estimator='layers': use one of 'micro_batches', 'norm_layers'"),
    (["measure_noise_scale=True", "noise_scale_estimator=norm_layers", "compile=True"],
     "noise_scale_estimator='norm_layers' with compile=True"),
    (["optimizer_in_bwd=True", "batch_increase_function=null", "retry_on_oom=False", "measure_noise_scale=True"],
     "measure_noise_scale=True with optimizer_in_bwd=True"),
]


@pytest.mark.parametrize("overrides,message", BAD_INPUTS, ids=[o[0] for o, _ in BAD_INPUTS])
def test_bad_input_fails_before_the_model_is_built(tmp_path, overrides, message):
    out = tmp_path / "out"
    proc = run_tune(out, *overrides)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert message in line
    # nothing was built or written: no initial checkpoint, no logs
    assert not (out / "init").exists() and not (out / "logs").exists()


def _a_file(tmp_path, name="a_file"):
    path = tmp_path / name
    path.write_text("not a directory")
    return path


# What a user who brings bad values would try (issue 12): each a single line, before any work.
# Each entry: overrides built from the test's tmp_path, and what the line must say.
HOSTILE_INPUTS = {
    "max_memory overflows": (lambda t: ["max_memory=1e400"], "max_memory=inf is not a finite number"),
    "max_memory quoted overflow": (lambda t: ["max_memory='1e400'"], "max_memory='1e400' is not a finite size"),
    "max_memory one byte": (lambda t: ["max_memory=1"], "max_memory=1 is 1 bytes, too small"),
    "max_memory 1.5 bytes": (lambda t: ["max_memory='1.5'"], "max_memory='1.5' is neither a fraction"),
    "probe cache dir is a file": (
        lambda t: ["use_maximum_batch_size=True", f"probe_cache_dir={_a_file(t)}"],
        "is a file, not a directory",
    ),
    "probe cache dir cannot be made": (
        lambda t: ["use_maximum_batch_size=True", f"probe_cache_dir={_a_file(t)}/cache"],
        "cannot be written",
    ),
    "output dir is a file": (lambda t: [f"output_dir={_a_file(t)}"], "is a file, not a directory"),
    "output dir cannot be made": (lambda t: [f"output_dir={_a_file(t)}/out"], "output_dir="),
    "log dir is a file": (lambda t: [f"metric_logger.log_dir={_a_file(t)}"], "metric_logger.log_dir="),
    "dataset dir is a file": (lambda t: [f"dataset.data_dir={_a_file(t)}"], "dataset: building 'adaptive_batch.torchtune.pydoc_text_dataset' failed"),
    "dataset negative min_chars": (lambda t: ["dataset.min_chars=-1"], "dataset.min_chars=-1 must be zero or more"),
    "tokenizer component missing": (
        lambda t: ["tokenizer._component_=adaptive_batch.torchtune.no_such_tokenizer"],
        "tokenizer._component_='adaptive_batch.torchtune.no_such_tokenizer' cannot be imported",
    ),
    "max_seq_len zero": (lambda t: ["tokenizer.max_seq_len=0"], "tokenizer.max_seq_len=0 must be an integer of at least 2"),
    "max_steps zero": (lambda t: ["max_steps_per_epoch=0"], "max_steps_per_epoch=0 must be a positive integer"),
    "seed not a number": (lambda t: ["seed=abc"], "seed='abc' must be a non-negative integer"),
    "epochs infinite": (lambda t: ["epochs=.inf"], "epochs=inf is not a finite number"),
    "lr reference NaN": (lambda t: ["lr_scaling=linear", "lr_scaling_reference=.nan"], "lr_scaling_reference=nan is not a finite"),
    "lr reference infinite": (lambda t: ["lr_scaling=linear", "lr_scaling_reference=.inf"], "lr_scaling_reference=inf is not a finite"),
    "optimizer lr NaN": (lambda t: ["optimizer.lr=.nan"], "optimizer.lr=nan is not a finite number"),
    "margin NaN": (lambda t: ["memory_safety_margin=.nan"], "memory_safety_margin=nan is not a finite"),
    # were tracebacks from torchtune's instantiate and its YAML parser
    "model component missing": (
        lambda t: ["model._component_=torchtune.models.llama3_2.nope"],
        "model._component_='torchtune.models.llama3_2.nope' cannot be imported",
    ),
    "config not YAML": (lambda t: ["+config=batch_size: [1, 2\nepochs: 1\n"], "is not valid YAML: line 2, column 7"),
    "override does not parse": (lambda t: ["batch_size=[1"], "override 'batch_size=[1' does not parse"),
    "weight decay scaling of zero": (
        lambda t: ["lr_scaling=linear", "weight_decay_scaling=timescale", "optimizer.weight_decay=0.0"],
        "weight_decay=0: scaling zero changes nothing",
    ),
    "weight decay scaling of Adam's default zero": (
        lambda t: ["weight_decay_scaling=timescale", "optimizer._component_=torch.optim.Adam"],
        "torch.optim.Adam's weight_decay=0",
    ),
    "plot path is a directory": (
        lambda t: ["plot=True", f"output_dir={t / 'o'}", f"+mkdir={t / 'o' / 'batch_probe.png'}"],
        "batch_probe.png' is a directory: move it away, or set plot=False",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_INPUTS))
def test_hostile_input_is_one_line_before_any_work(tmp_path, case):
    build, message = HOSTILE_INPUTS[case]
    overrides = build(tmp_path)
    for item in [o for o in overrides if o.startswith("+mkdir=")]:
        os.makedirs(item.split("=", 1)[1])
        overrides.remove(item)
    config = {}
    for item in [o for o in overrides if o.startswith("+config=")]:
        (tmp_path / "bad.yaml").write_text(item.split("=", 1)[1])
        config = dict(config=str(tmp_path / "bad.yaml"))
        overrides.remove(item)
    proc = run_tune(tmp_path / "out", *overrides, **config)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert message in line, line
    # no model was built: no initial checkpoint written anywhere
    assert not list(tmp_path.rglob("init"))


def test_a_file_where_an_epoch_checkpoint_goes_stops_the_run_before_training(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "epoch_0").write_text("someone's notes")
    proc = run_tune(out)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "holds a file named epoch_0" in proc.stderr
    assert (out / "epoch_0").read_text() == "someone's notes" and not (out / "init").exists()


def test_typo_names_the_closest_key(tmp_path):
    proc = run_tune(tmp_path, "use_maximum_batchsize=True")
    assert proc.returncode == 1 and "did you mean 'use_maximum_batch_size'" in proc.stderr


def test_bad_input_through_the_real_cli_exits_nonzero_with_one_line(tmp_path):
    proc = run_tune(tmp_path, "max_memory=lots")
    assert proc.returncode != 0
    assert "error: max_memory='lots' cannot be parsed" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("probed")
    # two steps: the second is Adam's first with moments, which a probe that touched them changes
    proc = run_tune(out, FIXED, "use_maximum_batch_size=True", "max_memory=256MiB", "max_steps_per_epoch=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_probe_result_is_logged_written_and_used(probed_run):
    out, proc = probed_run
    report = json.loads((out / "batch_probe.json").read_text())
    found = report["max_batch_size"]
    assert found >= 2 and report["batch_size"] == found
    assert report["seq_len"] == 256 and report["device"] == "cpu"
    assert report["budget"]["limit_bytes"] == 256 * 1024**2
    assert report["budget_bytes"] == int(256 * 1024**2 * (1 - 0.01))
    trials = {t["batch_size"]: t for t in report["trials"] if t["phase"] != "warmup"}
    assert trials[found]["fits"] and trials[found]["peak_bytes"] <= report["budget_bytes"]
    # one over: measured over the budget, or stopped by the probe's own address-space limit
    over = trials[found + 1]
    assert not over["fits"] and (over["oom"] or over["peak_bytes"] > report["budget_bytes"])
    assert report["trial_address_space_limit"] is not None and report["max_overshoot"] <= 1.25
    assert set(report["estimate"]) == {
        "fixed_bytes", "bytes_per_sample", "predicted_max_batch_size", "kind", "operators", "binding_operator"
    }
    # the first guess, fake steps of the config's model at batch 2 and 3 (the byte vocabulary's
    # batch 1 runs other operators), is the answer: the warmup at 2 (what it adds checked against
    # the fake step at 2), the guess and the size above it
    assert report["estimate"]["kind"] == "operators" and report["estimate"]["predicted_max_batch_size"] == found
    assert report["first_guess"]["batch_size"] == found and report["first_guess"]["source"] == "fake steps"
    assert [t["batch_size"] for t in report["trials"]] == [2, found, found + 1]
    assert report["total_seconds"] >= report["first_guess"]["seconds"] > 0 and 0 < report["epoch_share"] < 1
    assert {"forward", "backward", "optimizer"} == set(report["trials"][1]["phase_peak_bytes"])
    assert f"training with batch_size={found}" in proc.stderr + proc.stdout
    # judged by tensor bytes, far below the machine, with no limit over the process: the probe sets
    # no allocator option (they made every step map its blocks afresh); a worker that set them for
    # an earlier run puts glibc's thresholds back for training
    assert "M_MMAP_THRESHOLD=256KiB" not in proc.stderr + proc.stdout
    rows = read_metric_log(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["batch_size"] == found
        assert {"loss", "lr", "tokens_per_second_per_gpu", "peak_memory_rss"} <= set(r)
        assert math.isfinite(r["loss"])
    assert not [f for f in os.listdir(out) if f.startswith(".probe_snapshot")]


def test_probing_leaves_training_identical(probed_run, tmp_path):
    out, _ = probed_run
    found = json.loads((out / "batch_probe.json").read_text())["batch_size"]
    proc = run_tune(tmp_path, FIXED, f"batch_size={found}", "max_steps_per_epoch=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    probed = [r["loss"] for r in read_metric_log(out)]
    plain = [r["loss"] for r in read_metric_log(tmp_path)]
    assert probed == plain  # bitwise: same weights, optimizer, RNG and data order


def test_training_starts_no_thread(tmp_path, monkeypatch):
    """A thread started after the probe measured the process takes its stack (8 MiB of address
    space) from the found batch's room: under a 1 GiB RLIMIT_AS, tqdm's monitor thread made the
    found 39 fail its second step."""
    started = []
    start = threading.Thread.start

    def recording_start(thread):
        if any(frame.name == "_train_epochs" for frame in traceback.extract_stack()):
            started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    proc = run_tune(tmp_path, FIXED, "max_steps_per_epoch=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metric_log(tmp_path)) == 2 and started == []


def test_batch_one_too_large_says_needed_and_available(tmp_path):
    proc = run_tune(tmp_path, "use_maximum_batch_size=True", "max_memory=20MB")
    assert proc.returncode != 0
    assert "error: batch size 1 does not fit" in proc.stderr
    assert "bytes) is available" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "batch_probe.json").exists()


# A step of 24 samples of 256 tokens holds about 24 MiB of tensors a sample (the trials' slope on
# this config), twice the 256 MiB of headroom; 6 a micro-batch hold about 170 MiB.
OVER_THE_LIMIT, HEADROOM_TINY = 24, 256 * 2**20


@pytest.mark.slow
def test_a_step_past_a_real_limit_is_split_and_trains_what_the_whole_batch_trains(tmp_path):
    """A batch past an outside RLIMIT_AS runs out of memory in the training process (a real
    allocator failure: with retry_on_oom=False that ends the run, as the 152K model's run one over
    its answer shows). With retry_on_oom (the default) the run recovers: the step that ran out of
    memory is rerun in halves, nothing lost, and later steps keep the smaller micro-batch. That the
    probe's answer trains under a real limit is the 152K test's."""
    retried_out = tmp_path / "retried"
    proc = run_tune(retried_out, FIXED, f"batch_size={OVER_THE_LIMIT}", "max_steps_per_epoch=2",
                    headroom_bytes=HEADROOM_TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "out of memory in a step of" in proc.stderr and "recovered from out of memory" in proc.stderr
    assert "DefaultCPUAllocator: can't allocate memory" in proc.stderr
    retried = read_metric_log(retried_out)
    assert len(retried) == 2 and all(r["batch_size"] == OVER_THE_LIMIT for r in retried)
    assert retried[0]["oom_retries"] >= 1 and sum(r["oom_retries"] for r in retried[1:]) == 0
    assert all(r["grad_accum_steps"] >= 2 and r["micro_batch_size"] < OVER_THE_LIMIT for r in retried)
    # the same updates as the unsplit batch run without a limit, to float tolerance
    reference_out = tmp_path / "reference"
    proc = run_tune(reference_out, FIXED, f"batch_size={OVER_THE_LIMIT}", "max_steps_per_epoch=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = read_metric_log(reference_out)
    assert all(r["grad_accum_steps"] == 1 for r in reference)
    assert [r["loss"] for r in retried] == pytest.approx([r["loss"] for r in reference], rel=1e-4)


def test_resumed_run_keeps_the_probed_batch_size(tmp_path):
    first = run_tune(
        tmp_path, *SMALL_MODEL, FIXED, "use_maximum_batch_size=True", "max_memory=16MiB", "epochs=2", "max_steps_per_epoch=1"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    found = json.loads((tmp_path / "batch_probe.json").read_text())["batch_size"]
    (tmp_path / "batch_probe.json").unlink()
    # What a kill inside epoch 1 leaves: epoch 0's checkpoint, nothing of epoch 1's.
    shutil.rmtree(tmp_path / "epoch_1")
    (tmp_path / "run_finished.json").unlink()
    # The epoch checkpoint records the run's shape and a fingerprint of what it trained.
    (recipe_state,) = tmp_path.glob("**/recipe_state.pt")
    run = torch.load(recipe_state, weights_only=True)["adaptive_batch_run"]
    assert run["world_size"] == 1 and run["seq_len"] == 256 and run["dataset_size"] > 0
    assert run["fingerprint"]["max_memory"] == '"16MiB"' and "probe_cache_dir" not in run["fingerprint"]
    # torchtune 0.6.1 resumes from files named relative to output_dir
    resume = ["resume_from_checkpoint=True", "checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.bin]"]
    # A smaller budget would find a smaller batch and train something else than the checkpoint's
    # run: refused in one line, before the model is built.
    refused = run_tune(
        tmp_path, *SMALL_MODEL, FIXED, "use_maximum_batch_size=True", "max_memory=12MiB", "epochs=2", "max_steps_per_epoch=1", *resume
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr and "Model is initialized" not in refused.stderr
    assert ('error: resume_from_checkpoint=True: max_memory was "16MiB" in the run that wrote the checkpoint and is '
            '"12MiB" now; it changes what is trained (the batch probed under it; with a global_batch_size it may '
            'change: it sets the micro-batch alone): put it back to resume, or start a new output_dir.') in refused.stderr
    # The same settings resume with the recipe state's batch, no probing.
    resumed = run_tune(
        tmp_path, *SMALL_MODEL, FIXED, "use_maximum_batch_size=True", "max_memory=16MiB", "epochs=2", "max_steps_per_epoch=1", *resume
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"using the probed batch_size={found} from the recipe state" in resumed.stderr
    assert "probe trial" not in resumed.stderr
    assert not (tmp_path / "batch_probe.json").exists()


# Sequences of 64 tokens under 0.622 GiB of headroom, the config's embedding at width 64 (a step
# costs a quarter of width 256's, and its chunked loss runs other operators at batch 1, which
# once made the first guess 13 where 6 fit): the tied 152K x 64 embedding, its gradient and AdamW's
# moments take ~150 MiB, and each sample's logits and their gradient ~75 MiB more. The trials get
# ~569 MiB: 6 adds 532, 7 about 606, half a sample either side (at 0.65 GiB, 9 MiB short of 7, a
# fresh process that does not probe, with a few MiB more room than the probing one, trained 7).
SEQ_152K = ("tokenizer.max_seq_len=64", "model.embed_dim=64", "model.intermediate_dim=192")
HEADROOM_152K = int(0.622 * 2**30)


@pytest.mark.slow
def test_real_vocabulary_under_a_real_limit_trials_in_fresh_processes_find_the_truth(tmp_path):
    """Qwen2.5's 151,936-token vocabulary, tied, under an outside RLIMIT_AS. Each trial builds the
    recipe again from the run's config in a fresh process and runs training's first steps there,
    so no out-of-memory trial scars the run's own process (in-process, the trial at the truth once
    failed and the probe found one less). The answer trains here and one more than the trials'
    answer fails in a fresh process."""
    config = "configs/tiny/qwen2_5_vocab152k_full_single_device.yaml"
    scratch = tmp_path / "tmp"  # where the trials' scratch folders go, and are removed from
    scratch.mkdir()
    proc = run_tune(
        tmp_path / "run", "use_maximum_batch_size=True", "retry_on_oom=False", "probe_cache=False", *SEQ_152K,
        "max_steps_per_epoch=2", config=config, headroom_bytes=HEADROOM_152K, env={"TMPDIR": str(scratch)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "batch_probe.json").read_text())
    found, trained = report["max_batch_size"], report["batch_size"]
    assert report["trials_in_fresh_processes"] and report["budget"]["safety_margin"] == FRESH_PROCESS_MARGIN
    assert "each trial runs 3 steps in a fresh process" in proc.stderr
    # the trials' own setup says nothing: the run's setup lines appear once
    assert proc.stderr.count("Tokenizer is initialized") == 1
    # the answer is also checked in this process, which may step it down by one
    assert found >= 3 and found - 1 <= trained <= found
    # a line through the address space of two trials, then at most one out of memory
    assert sum(not t["fits"] for t in report["trials"]) <= 1
    # the answer trains under the same limit in the process that probed, with no split steps...
    rows = read_metric_log(tmp_path / "run")
    assert [r["batch_size"] for r in rows] == [trained] * 2 and all(r["oom_retries"] == 0 for r in rows)
    assert not list(scratch.glob("adaptive-batch-trial-*")), "a trial left its scratch folder"
    # ...and is the true maximum: one more does not train in a fresh process under that limit
    over = run_tune(
        tmp_path / "over", f"batch_size={found + 1}", "retry_on_oom=False", *SEQ_152K, config=config, headroom_bytes=HEADROOM_152K
    )
    assert over.returncode != 0 and "DefaultCPUAllocator: can't allocate memory" in over.stderr
