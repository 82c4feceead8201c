"""The `adaptive-batch` console script, as installed with the package."""

import ast
import json
from pathlib import Path
import subprocess
import sys
import textwrap

import pytest

from adaptive_batch.torchtune.cli import main
from tests.recipes.conftest import REPO, SMALL_MODEL, run_in_process, tune_env

TINY = "configs/tiny/full_single_device.yaml"
# The throughput, plot, cache and install probes test the command, not the search: short sequences on a
# small model and a small budget make the same decisions with a fraction of the trial compute (about
# 0.75 MiB a sample over 1.2 MiB of state). The plan's agreement with the probe is tested at the
# config's own model and 256 tokens.
SMALL = ["tokenizer.max_seq_len=64", *SMALL_MODEL]


def cli(*args):
    """The command in this process, from the repository root."""
    return run_in_process(main, ["adaptive-batch", *args])


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    # A small budget: the same decisions as a large one, with a fraction of the trial compute.
    proc = cli("probe", "--config", TINY, f"output_dir={out}", "max_memory=192MiB")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc, json.loads((out / "batch_probe.json").read_text())


def test_probe_only_prints_trials_and_writes_the_report_without_training(probed):
    out, proc, report = probed
    assert "largest batch that fits: %d" % report["max_batch_size"] in proc.stdout
    assert "phase" in proc.stdout and "warmup" in proc.stdout
    assert not list(out.glob("epoch_*")) and not (out / "recipe_state").exists()  # no training, no checkpoint
    assert not [line for line in (out / "logs").glob("log_*.txt") if "Step" in line.read_text()]


def test_plan_agrees_with_the_probes_measured_peaks(probed):
    _, _, report = probed
    proc = cli("plan", "--config", TINY, "--device-memory", "192MiB", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert {"max_batch_size", "device_memory_bytes", "rows"} <= set(plan)
    assert plan["device_memory_bytes"] == 192 * 2**20
    assert abs(plan["max_batch_size"] - report["max_batch_size"]) <= 1
    line = plan["estimate"]
    for trial in report["trials"]:
        if trial["fits"] and trial["phase"] != "warmup":
            predicted = line["fixed_bytes"] + line["bytes_per_sample"] * trial["batch_size"]
            assert abs(predicted - trial["peak_bytes"]) / trial["peak_bytes"] < 0.05, trial
    row = plan["rows"][0]
    assert {"batch_size", "peak_bytes", "parameters", "gradients", "optimizer_state", "activations"} <= set(row)


def test_plan_table_and_plot_for_the_lora_config(tmp_path):
    pytest.importorskip("matplotlib")
    proc = cli("plan", "--config", "configs/tiny/lora_single_device.yaml", "--device-memory", "1GiB", "--plot", str(tmp_path / "plan.png"),
               "tokenizer.max_seq_len=null", *SMALL_MODEL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer_state" in proc.stdout and "largest batch under 1.00 GiB" in proc.stdout
    # left open, the sequence length is said, and no longer than the model's max_seq_len (a
    # plan at 2048 tokens was a traceback from the model's forward)
    assert "assumed: tokenizer.max_seq_len is null: planned at 256" in proc.stdout
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "--config", "configs/nope.yaml"], "--config 'configs/nope.yaml': no such file"),
        (["plan", "--config", TINY, "optimizer._component_=nosuch.Optim"], "optimizer._component_='nosuch.Optim' cannot be imported"),
        # were tracebacks from torchtune's instantiate
        (["plan", "--config", TINY, "model._component_=torchtune.models.llama3_2.nope"],
         "model._component_='torchtune.models.llama3_2.nope' cannot be imported"),
        (["probe", "--config", TINY, "model._component_=torchtune.models.llama3_2.llama3_2_1bb"],
         "model._component_='torchtune.models.llama3_2.llama3_2_1bb' cannot be imported"),
        (["plan", "--config", TINY, "batch_size=[1"], "override 'batch_size=[1' does not parse"),
        # was a plan per rank that ignored the global batch it could not split
        (["plan", "--config", TINY, "--world-size", "3", "global_batch_size=16"],
         "global_batch_size=16 does not divide among 3 ranks"),
        (["plan", "--config", TINY, "--device-memory", "lots"], "--device-memory='lots' cannot be parsed"),
        (["plan", "--config", TINY, "batch_size"], "override 'batch_size' is not key=value"),
        # the plan once read a typo and a batch of 0 without a word, where `probe` refused them
        (["plan", "--config", TINY, "max_memroy=5"], "unknown config key 'max_memroy': this recipe does not read it; did you mean 'max_memory'?"),
        (["plan", "--config", TINY, "batch_size=0"], "batch_size=0 must be a positive integer"),
        (["probe", "--config", TINY, "max_memory=lots"], "max_memory='lots' cannot be parsed"),
        (["plan", "--config", TINY, "--device-memory", "1e400"], "--device-memory='1e400' is not a finite size"),
        (["plan", "--config", TINY, "max_memory='1e400'"], "max_memory='1e400' is not a finite size"),
        (["plan", "--config", TINY, "--safety-margin", "nan"], "--safety-margin=nan must be a number in [0, 1)"),
        (["plan", "--config", TINY, "optimizer.lr=.nan"], "optimizer.lr=nan is not a finite number"),
        # a component its own values fail to build was a traceback of 40 lines; plan read no adaptive key
        (["plan", "--config", TINY, "optimizer.lr=fast"],
         "_component_='torch.optim.AdamW' could not be built from its section of the config (TypeError: '<=' not supported"),
        (["plan", "--config", TINY, "model.num_layerz=3"],
         "_component_='torchtune.models.llama3_2.llama3_2' could not be built from its section of the config "
         "(TypeError: llama3_2() got an unexpected keyword argument 'num_layerz')"),
        (["plan", "--config", TINY, "lr_scaling=cubic"], "lr_scaling='cubic' is not one of"),
        (["plan", "--config", TINY, "--plot", "/proc/no/plan.png"], "--plot (its directory)='/proc/no' cannot be written"),
        (["probe", "--config", TINY, "--plot", "configs"], "--plot='configs' is a directory"),
        (["plan", "--config", TINY, "tokenizer.max_seq_len=4096"],
         "tokenizer.max_seq_len=4096 is longer than model.max_seq_len=256"),
    ],
)
def test_bad_input_is_one_line(args, message):
    proc = cli(*args)
    assert proc.returncode == 1
    assert f"error: {message}" in proc.stderr and "Traceback" not in proc.stderr


def test_json_errors_are_a_json_object_on_stdout():
    # stdout was empty, so a script reading it got a JSON decode error instead of the reason
    proc = cli("plan", "--config", TINY, "--json", "max_memory=lots")
    assert proc.returncode == 1 and "error: max_memory='lots'" in proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["type"] == "ConfigError" and answer["error"].startswith("max_memory='lots' cannot be parsed")


def test_the_plan_splits_a_global_batch_among_the_ranks():
    proc = cli("plan", "--config", TINY, "--json", "--world-size", "2", "--device-memory", "256MiB", "global_batch_size=4096",
               *SMALL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    split = plan["global_batch"]
    assert split["per_rank"] == 2048 and split["micro_batch_limit"] == plan["max_batch_size"]
    assert split["gradient_accumulation_steps"] * split["micro_batch_size"] >= 2048


def test_unknown_option_is_a_usage_error():
    proc = cli("plan", "--config", TINY, "--bogus")
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr


def test_cache_hit_miss_and_invalidation(tmp_path):
    # a small model: the cache's decisions are the same at any size, its probes cheaper
    first = cli("probe", "--config", TINY, f"output_dir={tmp_path}", *SMALL, "max_memory=8MiB")
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads((tmp_path / "batch_probe.json").read_text())
    assert report["cache"]["hit"] is False and "probe trial 1" in first.stderr
    again = cli("probe", "--config", TINY, f"output_dir={tmp_path}", *SMALL, "max_memory=8MiB")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "probe cache hit" in again.stderr and "probe trial" not in again.stderr
    assert "from the probe cache" in again.stdout
    cached = json.loads((tmp_path / "batch_probe.json").read_text())
    assert cached["cache"]["hit"] is True and cached["max_batch_size"] == report["max_batch_size"]
    # --no-cache, a different budget: probe again
    forced = cli("probe", "--config", TINY, f"output_dir={tmp_path}", "--no-cache", *SMALL, "max_memory=8MiB")  # any order
    assert "probe trial 1" in forced.stderr and "probe cache hit" not in forced.stderr
    other = cli("probe", "--config", TINY, f"output_dir={tmp_path}", *SMALL, "max_memory=7MiB")
    assert "probe trial 1" in other.stderr
    # a corrupt entry is never trusted
    Path(report["cache"]["path"]).write_text("{not json")
    broken = cli("probe", "--config", TINY, f"output_dir={tmp_path}", *SMALL, "max_memory=8MiB")
    assert broken.returncode == 0 and "ignoring unreadable entry" in broken.stderr and "probe trial 1" in broken.stderr


def test_throughput_objective_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    proc = cli(
        "probe", "--config", TINY, f"output_dir={tmp_path}", "max_memory=8MiB", *SMALL, "batch_size_objective=throughput",
        "throughput_tolerance=0.5", "--plot", str(tmp_path / "cli.png"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "batch_probe.json").read_text())
    timed = report["throughput"]["trials"]
    assert [t["batch_size"] for t in timed][-1] == report["max_batch_size"]
    best = max(t["samples_per_second"] for t in timed)
    ok = [t["batch_size"] for t in timed if t["samples_per_second"] >= 0.5 * best]
    assert report["batch_size"] == min(ok)  # the smallest within 50% of the fastest
    assert "samples/s" in proc.stdout and "fastest within 50%" in proc.stdout
    assert (tmp_path / "cli.png").read_bytes()[:4] == b"\x89PNG"


def test_recipe_plot_key_writes_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    proc = cli("probe", "--config", TINY, f"output_dir={tmp_path}", "max_memory=7MiB", *SMALL, "plot=True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "batch_probe.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_plan_of_the_1b_config_needs_no_weights_and_no_gpu():
    # left open, the sequence length is assumed and said
    proc = cli("plan", "--config", "configs/llama3_2/1B_full_single_device.yaml", "--device-memory", "80GiB", "--json",
               "tokenizer.max_seq_len=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert any(note.startswith("tokenizer.max_seq_len is null: planned at 2048") for note in plan["assumptions"])
    params = plan["rows"][0]["parameters"]
    assert 2.4e9 < params < 2.6e9  # 1.24 B bf16 weights
    assert plan["rows"][0]["optimizer_state"] == pytest.approx(2 * params, rel=0.01)  # AdamW's two moments
    assert 1 <= plan["max_batch_size"] < 64 and plan["seq_len"] == 2048


@pytest.mark.slow
def test_an_ordinary_install_plans_and_probes_from_another_directory(tmp_path):
    """`pip install .` (not editable): the wheel carries the recipes as `adaptive_batch_recipes`
    and no top-level `recipes`, and the command finds the installed LoRA recipe by itself from
    any directory, with no PYTHONPATH to the repository."""
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("adaptive_batch-*.whl")
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == [
        "adaptive_batch", "adaptive_batch_recipes"
    ]
    work = tmp_path / "elsewhere"
    work.mkdir()
    config = str(REPO / "configs/tiny/lora_single_device.yaml")
    # One process (its start-up is most of the cost): where the packages come from, then the
    # command's plan and probe as `python -m adaptive_batch.torchtune.cli` runs them.
    script = textwrap.dedent(f"""
        import contextlib, io, runpy, sys
        import adaptive_batch, adaptive_batch_recipes
        print("from", adaptive_batch.__file__, adaptive_batch_recipes.__file__)
        for argv in (["plan", "--config", {config!r}, "--device-memory", "1GiB", "--json", *{SMALL!r}],
                     ["probe", "--config", {config!r}, "output_dir={work / 'out'}", "max_memory=8MiB", "--no-cache",
                      *{SMALL!r}]):
            sys.argv = ["adaptive-batch", *argv]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    runpy.run_module("adaptive_batch.torchtune.cli", run_name="__main__")
                except SystemExit as e:
                    assert not e.code, e.code
            print(argv[0], repr(out.getvalue()))
    """)
    env = dict(tune_env(), PYTHONPATH=str(site))
    run = subprocess.run([sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in run.stdout.splitlines()}
    assert all(path.startswith(str(site)) for path in lines["from"].split()), lines["from"]
    assert json.loads(ast.literal_eval(lines["plan"]))["max_batch_size"] >= 1
    assert "largest batch that fits" in ast.literal_eval(lines["probe"])
    assert "adapter tensors train, the base weights are frozen" in run.stderr  # the LoRA recipe's own step
    assert json.loads((work / "out" / "batch_probe.json").read_text())["max_batch_size"] >= 2


def _stock_config(tmp_path, name):
    """A torchtune 0.6.1 config copied from the installed wheel, as `tune cp` would."""
    import shutil

    import torchtune

    source = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "configs" / name
    target = tmp_path / Path(name).name
    shutil.copy(source, target)
    return str(target)


def test_a_stock_config_plans_with_only_max_seq_len_set(tmp_path):
    # 8-bit paged AdamW from bitsandbytes (not importable here) and optimizer_in_bwd=True, as shipped.
    config = _stock_config(tmp_path, "llama3_2/1B_full_single_device.yaml")
    proc = cli("plan", "--config", config, "--device-memory", "80GiB", "--json", "tokenizer.max_seq_len=1024")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    row = plan["rows"][0]
    assert 2.4e9 < row["parameters"] < 2.6e9  # 1.24 B bf16 weights
    assert row["optimizer_state"] == pytest.approx(row["parameters"], rel=0.02)  # two 8-bit moments per bf16 weight
    assert row["gradients"] < 0.2 * row["parameters"]  # freed in backward, one at a time
    assert plan["seq_len"] == 1024 and plan["tokens_per_step"] == 1024 * plan["max_batch_size"] > 0
    notes = " ".join(plan["assumptions"])
    assert "PagedAdamW8bit is not importable here" in notes and "16 decoder layers extrapolated" in notes


def test_a_stock_qlora_config_plans_its_nf4_weights(tmp_path):
    config = _stock_config(tmp_path, "llama3_2/1B_qlora_single_device.yaml")
    proc = cli("plan", "--config", config, "--device-memory", "24GiB", "--json", "tokenizer.max_seq_len=512")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    q = plan["rows"][0]
    # the decoder's linear weights go from 2 bytes to about 0.52; embeddings stay bf16: against
    # the 2.47 GB of bf16 weights the LoRA and full configs plan (the test above)
    assert 0.3 * 2.47e9 < q["parameters"] < 0.7 * 2.47e9
    assert any("NF4 base weights" in note for note in plan["assumptions"])
    assert plan["max_batch_size"] >= 1
