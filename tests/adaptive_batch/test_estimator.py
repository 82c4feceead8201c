import pytest

from adaptive_batch import LinearMemoryEstimate


def test_fit_through_two_points_recovers_the_line():
    est = LinearMemoryEstimate.fit([(1, 1_000 + 300), (2, 1_000 + 600)])
    assert est.fixed_bytes == 1_000
    assert est.bytes_per_sample == 300
    assert est.peak_bytes(10) == 4_000


def test_least_squares_over_more_points():
    points = [(b, 500 + 100 * b + (7 if b % 2 else -7)) for b in range(1, 9)]
    est = LinearMemoryEstimate.fit(points)
    assert abs(est.bytes_per_sample - 100) <= 3
    assert abs(est.fixed_bytes - 500) <= 15


def test_prediction_is_the_largest_batch_under_the_budget():
    est = LinearMemoryEstimate(fixed_bytes=1_000, bytes_per_sample=300)
    assert est.max_batch_size(1_000 + 300 * 7) == 7
    assert est.max_batch_size(1_000 + 300 * 7 + 299) == 7
    assert est.max_batch_size(1_000 + 300 * 8) == 8


def test_prediction_zero_when_not_even_one_sample_fits():
    assert LinearMemoryEstimate(fixed_bytes=1_000, bytes_per_sample=300).max_batch_size(1_100) == 0
    assert LinearMemoryEstimate(fixed_bytes=1_000, bytes_per_sample=300).max_batch_size(500) == 0


def test_flat_or_shrinking_peaks_set_no_bound():
    assert LinearMemoryEstimate(fixed_bytes=1_000, bytes_per_sample=0).max_batch_size(10**9) is None
    assert LinearMemoryEstimate(fixed_bytes=1_000, bytes_per_sample=-5).max_batch_size(10**9) is None


def test_fit_needs_two_distinct_sizes():
    with pytest.raises(ValueError, match="two or more batch sizes"):
        LinearMemoryEstimate.fit([(2, 100), (2, 110)])
