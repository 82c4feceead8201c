"""The distributed (FSDP2) recipe on CPU (gloo): through the real `tune run --nproc_per_node 2` once, and torchrun's launch of it elsewhere."""

import json
import math
from pathlib import Path
import shutil

import pytest

from tests.recipes.conftest import FIXED, SMALL_MODEL, read_metric_log, run_tune, run_tune_until_killed

# Each test launches torchrun with 2 worker processes.
pytestmark = pytest.mark.slow

DIST = dict(recipe="recipes/full_finetune_distributed.py", config="configs/tiny/full_distributed.yaml", nproc=2)
PROBE = [*SMALL_MODEL, "use_maximum_batch_size=True", "max_batch_size=12", FIXED, "max_steps_per_epoch=1"]
COSINE = [
    "lr_scheduler._component_=torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "lr_scheduler.num_warmup_steps=1",
]
# 2 ranks of 2 samples; growth doubles the global batch from epoch 1 and stops on request. Rows
# of 64 tokens on a 2-layer model 64 wide: what these runs check is which steps they train, not
# the size of the model or of its rows.
GROWTH = [
    "tokenizer.max_seq_len=64", *SMALL_MODEL,
    "batch_increase_function=my_growth.double_or_stop", "grow_with_accumulation=True", "epochs=3",
    "max_steps_per_epoch=3", "lr_scaling=linear", *COSINE,
]
# The runs on ranks, with step checkpoints every step (two kept) and the noise scale measured at
# every step (a step of one micro-batch split in two), its moving averages saved with them.
RANKS = [*GROWTH, "batch_size=2", "max_batch_size=4", "save_every_n_steps=1", "keep_last_n_checkpoints=2",
         "measure_noise_scale=True", "noise_scale_split_step=True"]


def _first_failure_lines(stderr, context=25):
    """The lines around the first traceback or ``error:`` line of any rank."""
    lines = stderr.splitlines()
    first = next((i for i, line in enumerate(lines) if "Traceback" in line or "error:" in line), len(lines))
    return lines[max(0, first - 5):first + context]


def probe_report(output_dir):
    return json.loads((output_dir / "batch_probe.json").read_text())


def test_each_rank_probes_its_own_budget_and_the_smallest_sets_the_batch(tmp_path):
    # One launch, two budgets. Rank 0 fits a larger batch than rank 1; lockstep trials make the
    # run take what fits on rank 1, as if every rank had rank 1's budget.
    # The user's own launch, `tune run --nproc_per_node 2` (the other tests launch through torchrun).
    proc = run_tune(tmp_path, *PROBE, "global_batch_size=24", env={"ADAPTIVE_BATCH_MAX_MEMORY": "32MiB,24MiB"},
                    via_tune=True, **DIST)
    # A rank that fails first is the one to read: the tail is the other rank's "connection closed".
    assert proc.returncode == 0, "\n".join(_first_failure_lines(proc.stderr)) + "\n...\n" + proc.stderr[-2000:]
    report = probe_report(tmp_path)
    rank0, rank1 = report["ranks"]
    assert report["world_size"] == 2 and (rank0["rank"], rank1["rank"]) == (0, 1)
    assert rank0["budget_bytes"] > rank1["budget_bytes"]
    # Lockstep: both ranks ran the same trial sizes, whatever their own outcome was.
    assert [t["batch_size"] for t in rank0["trials"]] == [t["batch_size"] for t in rank1["trials"]]
    found = report["batch_size"]
    assert any(t["fits_here"] and t["batch_size"] > found for t in rank0["trials"])
    # rank 1's largest fit: found fits there and found + 1, tried, does not
    fits_on_rank1 = {t["batch_size"]: t["fits_here"] for t in rank1["trials"]}
    assert fits_on_rank1.get(found) is True and fits_on_rank1.get(found + 1) is False
    assert any(t["batch_size"] == found + 1 and not t["fits"] for t in report["trials"])
    assert f"the batch to use is {found}" in proc.stderr
    # A global batch of 24 fixed, 12 a rank, accumulated in micro-batches no larger than the found
    # batch; the logged batch is summed over ranks.
    plan = report["global_batch"]
    assert plan["global_batch_size"] == 24 and plan["micro_batch_size"] <= found
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] * 2 == 24
    (row,) = read_metric_log(tmp_path)
    assert row["batch_size"] == 24 and row["micro_batch_size"] == plan["micro_batch_size"]
    assert row["grad_accum_steps"] == plan["gradient_accumulation_steps"] >= 2

    # Under FSDP2 the peak is nearly flat at batch 1-2: the line predicted 59 and that trial
    # took 2.8x the budget. Now the search grows from the largest fit within 1.25x, on each rank
    # against its own budget.
    assert report["max_overshoot"] <= 1.25
    for rank in report["ranks"]:
        assert rank["max_overshoot"] <= 1.25, rank
        for trial in rank["trials"]:
            assert trial["peak_bytes"] is None or trial["peak_bytes"] <= 1.25 * rank["budget_bytes"], trial

    # The planner's share of one rank under FSDP2 (fake process group, nothing allocated)
    # against what the ranks measured, at the batch sizes near the answer.
    from adaptive_batch.torchtune.cli import main
    from tests.recipes.conftest import run_in_process

    # the plan of the same step: with global_batch_size=24 two micro-batches before the optimizer step
    plan = run_in_process(main, ["adaptive-batch", "plan", "--config", DIST["config"], "--world-size", "2", "--json",
                                 "--device-memory", "24MiB", "--safety-margin", "0.01", "global_batch_size=24",
                                 *SMALL_MODEL])
    assert plan.returncode == 0, plan.stderr[-3000:]
    planned = json.loads(plan.stdout)
    # the same answer: both count what a rank holds (a rank's count once held every layer unsharded)
    assert planned["world_size"] == 2 and planned["max_batch_size"] == found
    (b1, p1), (b2, p2) = sorted((r["batch_size"], r["peak_bytes"]) for r in planned["measured"])[-2:]
    measured = {t["batch_size"]: t["peak_bytes"] for t in rank0["trials"] if t["peak_bytes"]}
    near = [b for b in measured if b >= found // 2]
    assert len(near) >= 2
    for b in near:
        predicted = p1 + (p2 - p1) * (b - b1) / (b2 - b1)  # the line through its two largest fake steps
        assert abs(predicted - measured[b]) <= 0.01 * measured[b], (b, predicted, measured[b])


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, schedules):
    out = tmp_path_factory.mktemp("dist") / "whole"
    proc = run_tune(out, *RANKS, extra_path=schedules, **DIST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_two_ranks_match_one_device_with_the_same_global_batch(tmp_path, schedules, whole_run):
    single = run_tune(tmp_path, *GROWTH, "batch_size=4", "max_batch_size=8", extra_path=schedules)
    assert single.returncode == 0, single.stderr[-3000:]
    dist_rows, one_rows = read_metric_log(whole_run), read_metric_log(tmp_path)
    # Global batches 4 x 3 steps, then 8 and 4, then 16 clamped to an epoch's 12.
    assert [r["batch_size"] for r in dist_rows] == [4, 4, 4, 8, 4, 12] == [r["batch_size"] for r in one_rows]
    for key in ("samples_seen", "real_tokens", "lr"):
        assert [r[key] for r in dist_rows] == pytest.approx([r[key] for r in one_rows], rel=1e-6), key
    # The same samples and per-token normalisation; FSDP's reduce-scatter and the ranks' split
    # steps (micro-batches of one sample, padded to their own length) only reorder float sums,
    # ~1e-5 in the loss, which Adam carries into later losses (up to ~1.3e-4); other samples or
    # another normalisation differ by 1e-2 or more.
    assert [r["loss"] for r in dist_rows] == pytest.approx([r["loss"] for r in one_rows], rel=3e-4)
    assert all(math.isfinite(r["gradient_noise_scale"]) and r["gradient_noise_scale"] > 0 for r in dist_rows)


def test_killed_then_stopped_and_resumed_twice_equals_the_uninterrupted_run(tmp_path, schedules, whole_run):
    """SIGKILL inside epoch 1, resumed from the step checkpoint; that run stopped by the growth
    function at epoch 2 and resumed from the epoch checkpoint: the steps equal the uninterrupted run's."""
    run_tune_until_killed(tmp_path, *RANKS, after=tmp_path / "step_checkpoints" / "step_4.pt", extra_path=schedules,
                          **DIST)
    # The kill may land inside a save (a temporary left, or a third file not yet pruned): the
    # finished checkpoints are whole either way, and the resumed run tidies up.
    assert list(Path(tmp_path, "step_checkpoints").glob("step_*.pt"))
    stopped = run_tune(
        tmp_path, *RANKS, "resume_from_checkpoint=True", f"metric_logger.log_dir={tmp_path}/logs_1",
        env={"STOP_AT_EPOCH": "2"}, extra_path=schedules, **DIST,
    )
    assert stopped.returncode != 0 and "Resuming from the step checkpoint" in stopped.stderr
    # Rank 0 called the function with the global batch; every rank stops with its message.
    message = (
        "error: batch_increase_function my_growth.double_or_stop at epoch=2, current_batch_size=8 "
        "raised RuntimeError: preempted"
    )
    assert stopped.stderr.count(message) == 2, stopped.stderr[-3000:]
    assert len(list(Path(tmp_path, "step_checkpoints").glob("step_*.pt"))) == 2  # keep_last_n_checkpoints=2
    assert not list(Path(tmp_path, "step_checkpoints").glob(".*"))  # no temporary left
    # Without step checkpoints the epoch checkpoint is the one resumed.
    shutil.rmtree(tmp_path / "step_checkpoints")
    resumed = run_tune(
        tmp_path, *RANKS, "resume_from_checkpoint=True", "checkpointer.checkpoint_files=[epoch_1/model-00001-of-00001.bin]",
        f"metric_logger.log_dir={tmp_path}/logs_2", extra_path=schedules, **DIST,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from the step checkpoint" not in resumed.stderr
    expected = read_metric_log(whole_run)
    got = read_metric_log(tmp_path, "logs_1") + read_metric_log(tmp_path, "logs_2")
    start = int(got[0]["step"]) - 1
    assert start >= 4 and [r["step"] for r in got] == [r["step"] for r in expected[start:]]
    for key in ("batch_size", "micro_batch_size", "grad_accum_steps", "samples_seen", "tokens_seen", "lr"):
        assert [r[key] for r in got] == [r[key] for r in expected[start:]], key
    # the loss, and the noise scale's moving averages carried through the step checkpoint
    for key in ("loss", "gradient_noise_scale"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected[start:]], rel=1e-6), key


# One launch proves the wiring on ranks: a value only rank 1 rejects, and rank 0 stops with
# rank 1's line instead of waiting for it. The checks themselves (a list of the wrong length, an
# unparsable or non-finite value) are unit tests: tests/adaptive_batch/test_distributed.py and
# the single-device recipe's bad-input table.
def test_bad_input_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    proc = run_tune(tmp_path, "use_maximum_batch_size=True", env={"ADAPTIVE_BATCH_MAX_MEMORY": "1GiB,lots"}, **DIST)
    assert proc.returncode != 0
    expected = "error: rank 1: ADAPTIVE_BATCH_MAX_MEMORY (this rank's value of '1GiB,lots')='lots' cannot be parsed"
    assert proc.stderr.count(expected) == 2, proc.stderr[-3000:]
    assert not (tmp_path / "batch_probe.json").exists()


def test_one_ranks_budget_under_batch_one_is_named_with_its_own_fix_on_every_rank(tmp_path):
    proc = run_tune(tmp_path, "use_maximum_batch_size=True", env={"ADAPTIVE_BATCH_MAX_MEMORY": "512MiB,24MiB"}, **DIST)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]
    assert lines[0].startswith("error: rank 1: batch size 1 does not fit: one training step needs ")
    assert "Raise rank 1's value in ADAPTIVE_BATCH_MAX_MEMORY" in lines[0] and "Raise max_memory" not in lines[0]


@pytest.mark.parametrize("override,expected", [
    ("fsdp_cpu_offload=True", "error: fsdp_cpu_offload=True: offloaded parameters live in CPU memory"),
    ("optimizer_in_bwd=True", "error: optimizer_in_bwd=True: the distributed recipe scales gradients"),
])
def test_settings_the_distributed_recipe_refuses_stop_before_any_process_group(tmp_path, override, expected):
    # Checked before the process group is set up: each rank stops alike, so one process shows it.
    proc = run_tune(tmp_path, override, recipe=DIST["recipe"], config=DIST["config"])
    assert proc.returncode == 1 and expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "batch_probe.json").exists()


def test_only_a_fresh_launch_that_lost_a_rank_to_sigsegv_runs_again():
    """The one retry (tests/recipes/conftest.py): torchrun's report of a rank killed by SIGSEGV, in
    a launch that does not resume; never another failure, never a resume's."""
    from tests.recipes.conftest import _rank_segfaulted

    report = "rank      : 1 (local_rank: 1)\n  exitcode  : -11 (pid: 3359)"
    assert _rank_segfaulted(report, ["epochs=1"])
    assert not _rank_segfaulted(report.replace("-11", "1"), ["epochs=1"])
    assert not _rank_segfaulted(report, ["resume_from_checkpoint=True"])
