import pytest

from adaptive_batch.memory.estimator import LinearMemoryEstimate, OperatorMemoryEstimate, PhaseMemoryEstimate


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


# A large vocabulary at small batches: the optimizer step over the embedding (flat) sets the
# step's peak at batch 1 and 2, the backward (steep) beyond. Numbers in MiB, scripted.
FLAT_THEN_STEEP = {
    b: {"forward": 300 + 160 * b, "backward": 700 + 300 * b, "optimizer": 1_300} for b in range(1, 20)
}


def test_one_line_through_step_peaks_is_flat_the_phase_lines_are_not():
    step_peaks = [(b, max(FLAT_THEN_STEEP[b].values())) for b in (1, 2)]
    line = LinearMemoryEstimate.fit(step_peaks)
    assert line.bytes_per_sample == 0 and line.max_batch_size(3_000) is None  # the line sets no bound
    phases = PhaseMemoryEstimate.fit([(b, FLAT_THEN_STEEP[b]) for b in (1, 2)])
    assert phases.phases["backward"].bytes_per_sample == 300 and phases.phases["optimizer"].bytes_per_sample == 0
    assert phases.max_batch_size(3_000) == 7  # 700 + 300 * 7 = 2_800, 8 would be 3_100
    assert all(phases.peak_bytes(b) == max(FLAT_THEN_STEEP[b].values()) for b in range(1, 20))
    assert phases.binding_phase(1) == "optimizer" and phases.binding_phase(7) == "backward"
    assert (phases.fixed_bytes, phases.bytes_per_sample) == (700, 300)
    assert set(phases.to_dict()["phases"]) == {"forward", "backward", "optimizer"}


def test_a_flat_phase_over_the_budget_allows_nothing():
    phases = PhaseMemoryEstimate.fit([(b, {"backward": 100 + 10 * b, "optimizer": 5_000}) for b in (1, 2)])
    assert phases.max_batch_size(4_000) == 0
    assert PhaseMemoryEstimate.fit([(b, {"optimizer": 500}) for b in (1, 2)]).max_batch_size(4_000) is None
    with pytest.raises(ValueError, match="same phases measured"):
        PhaseMemoryEstimate.fit([])


def test_operator_lines_find_the_peak_wherever_it_falls():
    # three operators: the optimizer's temporaries (flat, high), logits (steep), the rest
    def timeline(b):
        return [200 + 10 * b, 250 + 400 * b, 1_300, 220 + 20 * b]

    est = OperatorMemoryEstimate.fit((2, timeline(2)), (3, timeline(3)))
    assert est.per_sample == (10, 400, 0, 20) and est.fixed == (200, 250, 1_300, 220)
    assert all(est.peak_bytes(b) == max(timeline(b)) for b in range(1, 30))
    assert est.max_batch_size(3_000) == 6  # 250 + 400 * 6 = 2_650; 7 would be 3_050
    assert est.max_batch_size(1_200) == 0  # the flat operator alone is over
    d = est.to_dict(6)
    assert (d["fixed_bytes"], d["bytes_per_sample"], d["operators"], d["binding_operator"]) == (250, 400, 4, 1)
    assert est.to_dict(1)["binding_operator"] == 2  # at batch 1 the optimizer's operator is highest


def test_operator_lines_need_the_same_operators():
    with pytest.raises(ValueError, match="same operators"):
        OperatorMemoryEstimate.fit((1, [1, 2, 3]), (2, [1, 2]))
    with pytest.raises(ValueError, match="same operators"):
        OperatorMemoryEstimate.fit((1, [1, 2]), (2, [3, 4]), (["view", "mm"], ["clone", "mm"]))
    with pytest.raises(ValueError, match="same operators"):
        OperatorMemoryEstimate.fit((2, [1, 2]), (2, [3, 4]))
