"""The probe report: one typed record, its versioned JSON, and the reports written before it."""

import json

import pytest
import torch

from adaptive_batch.memory.budget import MemoryBudget
from adaptive_batch.memory.device import DeviceCapacity
from adaptive_batch.probe.report import REPORT_FORMAT, CacheUse, ProbeReport, read_probe_report, write_probe_report
from adaptive_batch.probe.search import Trial
from adaptive_batch.probe.throughput import ThroughputChoice, ThroughputTrial

# A report as the recipes wrote it into batch_probe.json and recipe_state.pt before it was typed:
# no "format", a budget without its kind, trials without start_bytes.
UNVERSIONED = {
    "max_batch_size": 19, "budget_bytes": 501_000_000, "max_overshoot": 0.99, "total_seconds": 4.2,
    "stopped_by_time": False, "num_trials": 3, "batch_size": 16, "seq_len": 256, "device": "cpu",
    "estimate": {"kind": "operators", "predicted_max_batch_size": 19, "fixed_bytes": 1, "bytes_per_sample": 2},
    "trials": [
        {"batch_size": 1, "fits": True, "peak_bytes": 60_000_000, "seconds": 0.5, "oom": False, "phase": "estimate"},
        {"batch_size": 19, "fits": True, "peak_bytes": 490_000_000, "seconds": 1.5, "oom": False, "phase": "search"},
        {"batch_size": 20, "fits": False, "peak_bytes": None, "seconds": 0.2, "oom": True, "phase": "search"},
    ],
    "budget": {"budget_bytes": 501_000_000, "limit_bytes": 506_000_000, "safety_margin": 0.01, "source": "max_memory"},
    "capacity": {"device": "cpu", "headroom_bytes": 10**10, "source": "MemAvailable", "hard_limit": False},
    "throughput": {"batch_size": 16, "best_samples_per_second": 30.0, "tolerance": 0.02,
                   "trials": [{"batch_size": 16, "seconds_per_step": 0.5, "samples_per_second": 32.0}]},
    "verified_batch_size": 18, "world_size": 1, "ranks": [{"rank": 0}], "cache": {"hit": True, "path": "/c/p.json"},
    "max_tokens": 4096, "someday": "a key this version does not know",
}


def test_an_unversioned_report_reads_into_typed_records():
    report = ProbeReport.from_dict(UNVERSIONED)
    assert (report.max_batch_size, report.batch_size, report.largest_that_trains, report.max_tokens) == (19, 16, 18, 4096)
    assert report.trials[2] == Trial(batch_size=20, fits=False, peak_bytes=None, seconds=0.2, oom=True, phase="search")
    assert report.budget == MemoryBudget(501_000_000, 506_000_000, 0.01, "max_memory", kind="hard")
    assert report.capacity == DeviceCapacity("cpu", 10**10, "MemAvailable", False)
    assert report.throughput == ThroughputChoice(16, 30.0, 0.02, [ThroughputTrial(16, 0.5, 32.0)])
    assert report.cache == CacheUse(hit=True, path="/c/p.json")
    assert report.num_trials == 3 and report.max_overshoot == pytest.approx(490 / 501)


def test_the_json_form_round_trips_and_loads_with_weights_only(tmp_path):
    report = ProbeReport.from_dict(UNVERSIONED)
    data = report.to_dict()
    assert data["format"] == REPORT_FORMAT and ProbeReport.from_dict(data) == report
    torch.save({"batch_probe": data}, tmp_path / "state.pt")  # as a recipe state holds it
    assert ProbeReport.from_dict(torch.load(tmp_path / "state.pt", weights_only=True)["batch_probe"]) == report
    path = write_probe_report(report, str(tmp_path))
    assert read_probe_report(path) == report and json.loads(open(path).read())["budget"]["kind"] == "hard"


def test_fields_a_run_adds_are_written_only_when_set():
    """Format 1 wrote throughput, cache, global_batch and max_tokens only when set, and its
    readers take a key's presence for a value (a null max_tokens would be a token budget of None)."""
    bare = ProbeReport(max_batch_size=3, batch_size=3, budget_bytes=1).to_dict()
    assert not {"throughput", "cache", "global_batch", "max_tokens"} & set(bare)
    assert ProbeReport(max_batch_size=3, batch_size=3, budget_bytes=1, max_tokens=96).to_dict()["max_tokens"] == 96


def test_the_largest_that_trains_is_the_batch_where_no_check_ran():
    assert ProbeReport(max_batch_size=9, batch_size=8, budget_bytes=1).largest_that_trains == 8
    assert ProbeReport(max_batch_size=9, batch_size=8, budget_bytes=1, verified_batch_size=9).largest_that_trains == 9


@pytest.mark.parametrize(
    "change,message",
    [
        ({"format": REPORT_FORMAT + 1}, "written by a newer adaptive-batch"),
        ({"batch_size": "16"}, "batch_size='16' must be a whole number"),
        ({"max_batch_size": None}, "max_batch_size=None must be a whole number"),
        ({"budget_bytes": True}, "budget_bytes=True must be a whole number"),
        ({"trials": [{"batch_size": 1}]}, "a record of the report does not read"),
        ({"budget": {"bytes": 3}}, "a record of the report does not read"),
    ],
)
def test_a_report_that_does_not_read_is_one_line_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message) as info:
        ProbeReport.from_dict(dict(UNVERSIONED, **change))
    assert "\n" not in str(info.value)


def test_not_an_object():
    with pytest.raises(ValueError, match="a probe report is an object, not list"):
        ProbeReport.from_dict([1, 2])


def test_the_summary_line_names_this_ranks_own_budget():
    """Every rank searches against the smallest rank's budget; the line once printed that figure
    beside this rank's limit and margin, which do not add up to it."""
    mine = MemoryBudget(budget_bytes=99 * 2**20, limit_bytes=100 * 2**20, safety_margin=0.01, source="max_memory")
    line = ProbeReport(max_batch_size=3, batch_size=3, budget_bytes=50 * 2**20, budget=mine).describe()
    assert "budget 99.00 MiB = 100.00 MiB from max_memory less a 1% safety margin" in line, line
