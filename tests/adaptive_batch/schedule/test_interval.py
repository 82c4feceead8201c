import pytest

from adaptive_batch import ConfigError
from adaptive_batch.schedule.growth import GrowthOptions
from adaptive_batch.schedule.interval import GrowthInterval, parse_interval


@pytest.mark.parametrize("value,unit,every", [
    ("epoch", "epoch", 1), ("100 steps", "steps", 100), ("1 step", "steps", 1),
    ("50000 samples", "samples", 50000), (" 7  tokens ", "tokens", 7),
    ("2 Steps", "steps", 2), ("Epoch", "epoch", 1),  # "2 step" was taken and "2 Steps" refused
])
def test_parses_every_form(value, unit, every):
    assert parse_interval(value) == GrowthInterval(unit=unit, every=every)


@pytest.mark.parametrize("value", ["0 steps", "-3 steps", "10 minutes", "steps", "10", 10, None, "1.5 steps", "epochs"])
def test_bad_intervals_name_the_key_and_the_forms(value):
    with pytest.raises(ConfigError, match=r"batch_increase_interval=.* is not an interval: use epoch, or a positive count"):
        parse_interval(value)


def test_every_n_epochs_is_pointed_to_the_functions_own_interval():
    with pytest.raises(ConfigError, match=r"'2 epochs' is not an interval: .* to grow every N epochs, keep epoch and give "
                                          r"the growth function every_n_epochs"):
        parse_interval("2 epochs")


def test_growth_options_hold_it_parsed():
    assert GrowthOptions(batch_increase_interval="3 samples").batch_increase_interval == GrowthInterval("samples", 3)
    assert GrowthOptions().batch_increase_interval.per_epoch


def test_boundary_index_counts_the_unit_from_zero():
    every = GrowthInterval("tokens", 1000)
    assert every.index(steps=99, samples=99, tokens=0) == 0
    assert every.index(steps=1, samples=1, tokens=999) == 0
    assert every.index(steps=1, samples=1, tokens=3000) == 3
    assert GrowthInterval("steps", 2).index(steps=5, samples=0, tokens=0) == 2
    assert GrowthInterval("samples", 2).describe(3) == "interval 3 (6 samples)"
    assert str(GrowthInterval("steps", 2)) == "2 steps" and str(GrowthInterval()) == "epoch"
