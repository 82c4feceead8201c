"""The first batch and the largest micro-batch, from the probe's report and the settings."""

import pytest

from adaptive_batch import ConfigError, ProbeOptions
from adaptive_batch.logs import lines_to
from adaptive_batch.probe.report import ProbeReport
from adaptive_batch.run.start import global_batch_plan, starting_batch
from adaptive_batch.schedule.growth import GrowthOptions

GROW = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch")


def probed(**fields):
    """A probe report as its JSON holds it (read as a resumed run or the cache reads one)."""
    return ProbeReport.from_dict({"budget_bytes": 2**30, "max_batch_size": fields.get("batch_size"), **fields})


def start(report=None, probe=ProbeOptions(), growth=GrowthOptions(), batch_size=4, accumulation=1):
    lines, warnings = [], []
    with lines_to(lines.append, warnings.append):
        got = starting_batch(batch_size=batch_size, gradient_accumulation_steps=accumulation, report=report,
                             probe=probe, growth=growth)
    return got, lines, warnings


def test_without_growth_the_probed_batch_is_the_micro_batch():
    assert start()[0] == (4, 4)
    assert start(accumulation=3)[0] == (12, 4)
    (got, lines, _) = start(report=probed(batch_size=10, max_batch_size=11), accumulation=2)
    assert got == (20, 10) and "training with batch_size=10" in lines[0]


def test_with_growth_the_largest_fit_rounded_bounds_the_micro_batch_and_the_start():
    report = probed(batch_size=5, max_batch_size=13, verified_batch_size=13)
    rounded = ProbeOptions(batch_size_rounding="power_of_two")
    assert start(report, rounded, GROW)[0] == (4, 8)
    (got, _, warnings) = start(report, rounded, GROW, batch_size=16)
    assert got == (8, 8) and "starting at 8" in warnings[0]
    with_accumulation = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch",
                                      grow_with_accumulation=True)
    assert start(report, rounded, with_accumulation, batch_size=16)[0] == (16, 8)


def test_a_batch_over_max_batch_size_is_refused_only_where_nothing_it_bounds_runs():
    """batch_size=8 with max_batch_size=4 trained 8 a step; a token budget draws up to
    max_batch_size samples whatever batch_size says, so there it stands."""
    capped = ProbeOptions(max_batch_size=4)
    with pytest.raises(ConfigError, match=r"batch_size=8 is over max_batch_size=4, the bound of the probe and of "
                                          r"growth, neither of which runs"):
        start(probe=capped, batch_size=8)
    assert starting_batch(batch_size=8, gradient_accumulation_steps=1, report=None, probe=capped,
                          growth=GrowthOptions(), token_budget=True) == (8, 8)
    # With growth too (it started at 4, said as the largest batch that fits, where none was measured),
    # unless growth trains it in micro-batches.
    with pytest.raises(ConfigError, match=r"batch_size=16 x gradient_accumulation_steps=1 is over max_batch_size=4"):
        start(probe=capped, growth=GROW, batch_size=16)
    # a checkpoint of a version that started there resumes (its batch state replaces the start)
    assert starting_batch(batch_size=16, gradient_accumulation_steps=1, report=None, probe=capped, growth=GROW,
                          resuming=True) == (4, 4)
    by_accumulation = GrowthOptions(batch_increase_function=GROW.batch_increase_function, grow_with_accumulation=True)
    assert start(probe=capped, growth=by_accumulation, batch_size=16)[0] == (16, 4)
    (got, lines, warnings) = start(probed(batch_size=4, max_batch_size=4), ProbeOptions(), GROW, batch_size=16)
    assert got == (4, 4) and "is over the largest batch that fits, 4: starting at 4" in warnings[0]
    assert [line for line in lines if "starting at" in line] == [
        "batch_increase_function: starting at 4 samples a step, micro-batches of up to 4; growth stops there."]


def test_growth_is_bounded_by_the_verified_batch_not_the_search():
    """On an H100 the search found 173 and 173 failed within 10 consecutive steps (the answer
    was 170), yet growth was bounded by 173."""
    report = probed(batch_size=170, max_batch_size=173, verified_batch_size=170)
    (got, lines, _) = start(report, ProbeOptions(), GROW, batch_size=2)
    assert got == (2, 170) and "micro-batches of up to 170" in lines[0]
    # A report without the field (a cache entry from before it) falls back to the batch it chose.
    assert start(probed(batch_size=9, max_batch_size=13), ProbeOptions(), GROW)[0] == (4, 9)


def test_a_global_batch_splits_into_micro_batches_of_at_most_the_probed_one():
    plan = global_batch_plan(24, world_size=2, dataset_size=100, batch_size=4, report=probed(batch_size=5),
                             throughput_tolerance=0.02)
    assert plan.per_rank == 12 and plan.micro_batch_limit <= 5
    unprobed = global_batch_plan(24, world_size=2, dataset_size=100, batch_size=4, report=None,
                                 throughput_tolerance=0.02)
    assert unprobed.micro_batch_limit <= 4
    with pytest.raises(ConfigError, match="more than the 10 samples a rank has"):
        global_batch_plan(24, world_size=2, dataset_size=10, batch_size=4, report=None, throughput_tolerance=0.02)
