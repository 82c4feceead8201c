import pytest

from adaptive_batch import BatchSizeTooLargeError
from adaptive_batch.memory.tracker import StepMemory
from adaptive_batch.logs import lines_to
from adaptive_batch.probe import search
from adaptive_batch.probe.search import round_batch_size, search_max_batch_size

CPU_OOM = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"


class LinearStep:
    """A fake step: peak = fixed + per_sample * b; real OOM above ``oom_above``. With
    ``start=True`` it says, as the probe's measured steps do, that ``fixed`` was live at its start."""

    def __init__(self, fixed, per_sample, oom_above=None, first_call_extra=0, start=False):
        self.fixed, self.per_sample, self.oom_above = fixed, per_sample, oom_above
        self.first_call_extra = first_call_extra
        self.start = start
        self.calls = []

    def __call__(self, b):
        self.calls.append(b)
        if self.oom_above is not None and b > self.oom_above:
            raise RuntimeError(CPU_OOM)
        extra = self.first_call_extra if len(self.calls) == 1 else 0
        peak = self.fixed + self.per_sample * b - extra
        return StepMemory({"backward": peak}, start_bytes=self.fixed) if self.start else peak


def no_release():
    pass


def check_bracket(result, cap=None):
    """The answer fitted; the size above it was tried and failed, or it is the cap."""
    fits = {t.batch_size for t in result.trials if t.fits}
    fails = {t.batch_size for t in result.trials if not t.fits}
    assert result.max_batch_size in fits
    assert result.max_batch_size + 1 in fails or result.max_batch_size == cap


def test_accurate_estimate_settles_in_five_trial_steps():
    step = LinearStep(fixed=1_000, per_sample=100, first_call_extra=50, start=True)
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37, release=no_release)
    assert result.max_batch_size == 37
    assert result.predicted_max_batch_size == 37
    assert step.calls == [1, 1, 2, 37, 38]
    assert result.estimate.to_dict()["bytes_per_sample"] == 100
    check_bracket(result)


def test_without_the_start_of_a_step_the_jump_is_bounded_as_if_all_memory_were_per_sample():
    # The same step, but nothing says 1_000 of it is held at every size: the search may not
    # trust the line's jump from 2 to 37 (1_200 x 37/2 would be 4.7x the budget).
    step = LinearStep(fixed=1_000, per_sample=100, first_call_extra=50)
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37, release=no_release)
    assert result.max_batch_size == 37
    assert step.calls[:4] == [1, 1, 2, 9]  # 2 x 1.25 x 4_700 / 1_200
    check_bracket(result)
    assert result.max_overshoot <= 1.25


@pytest.mark.parametrize("start", [False, True])
def test_no_trial_peaks_above_the_overshoot_bound_when_the_line_is_badly_wrong(start):
    # Flat at batch 1-2, then a hidden term 12x as steep takes over: the line says 250.
    def step(b):
        peak = max(4_000 + 20 * b, 1_000 + 240 * b)
        return StepMemory({"backward": peak}, start_bytes=1_000) if start else peak

    result = search_max_batch_size(step, budget_bytes=10_000, release=no_release)
    assert result.predicted_max_batch_size == 300
    assert result.max_batch_size == 37  # 1_000 + 240 x 37 = 9_880
    check_bracket(result)
    assert result.max_overshoot <= 1.25
    assert result.to_dict()["max_overshoot"] == result.max_overshoot


def test_warmup_step_is_left_out_of_the_estimate():
    # The first step allocates less (no optimizer state yet): fitting it would skew the line.
    step = LinearStep(fixed=1_000, per_sample=100, first_call_extra=400)
    result = search_max_batch_size(step, budget_bytes=5_000, release=no_release)
    assert result.estimate.fixed_bytes == 1_000
    assert [t.phase for t in result.trials[:3]] == ["warmup", "estimate", "estimate"]


def test_where_a_failed_trial_scars_the_caller_the_failure_the_line_foresees_is_not_run():
    # The Trainer under an outside limit (trials in its own process): 16 fitted at 1.50 GiB of a
    # 1.51 GiB budget at 89 MiB a sample, 17 ran out of memory, and the scarred heap then failed
    # 16's consecutive steps, so it answered 15 where 16 trains.
    step = LinearStep(fixed=1_000, per_sample=100, oom_above=37, start=True)
    lines = []
    with lines_to(lines.append):
        result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37 + 10, release=no_release,
                                       oom_scars_caller=True)
    assert result.max_batch_size == 37 and step.calls == [1, 1, 2, 37]
    assert not any(t.oom or not t.fits for t in result.trials)
    assert any("batch_size=38 is not tried" in line for line in lines)
    # The same search where failures leave nothing behind runs the trial that settles it.
    plain = LinearStep(fixed=1_000, per_sample=100, oom_above=37, start=True)
    search_max_batch_size(plain, budget_bytes=1_000 + 100 * 37 + 10, release=no_release)
    assert plain.calls == [1, 1, 2, 37, 38]


def test_a_failure_within_half_a_sample_of_the_line_is_still_tried():
    # 38 is within half a sample of the budget by the line: only a trial can say, and it fails
    # (memory the line cannot see); the answer is bracketed by real trials as before.
    step = LinearStep(fixed=1_000, per_sample=100, oom_above=37, start=True)
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37 + 60, release=no_release,
                                   oom_scars_caller=True)
    assert result.max_batch_size == 37 and step.calls[-1] == 38
    check_bracket(result)


def test_real_oom_below_the_budget_walks_down_then_bisects():
    # The line says 90 fits, but allocations fail above 61 (memory the counter cannot see).
    step = LinearStep(fixed=1_000, per_sample=100, oom_above=61, start=True)
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 90, release=no_release)
    assert result.max_batch_size == 61
    check_bracket(result)
    assert any(t.oom for t in result.trials)
    assert len(step.calls) == len(set(step.calls[1:])) + 1  # no size run twice after warm-up
    assert len(result.trials) <= 14


def test_pessimistic_estimate_gallops_up():
    # Small batches pay a per-sample cost that large ones amortise: the line underestimates.
    def step(b):
        return 1_000 + (100 * b if b <= 2 else 200 + 20 * b)

    result = search_max_batch_size(step, budget_bytes=1_000 + 200 + 20 * 300, release=no_release)
    assert result.max_batch_size == 300
    check_bracket(result)


def test_flat_small_batches_are_corrected_by_interpolating_measured_peaks():
    # As under FSDP: at batch 1-2 the peak is set by something else than activations, so the
    # line through them predicts far too much; the measured failure gives the real slope.
    def step(b):
        return max(5_000 + 10 * b, 3_000 + 240 * b)

    result = search_max_batch_size(step, budget_bytes=10_000, release=no_release)
    assert result.predicted_max_batch_size == 500
    assert result.max_batch_size == 29
    check_bracket(result)
    # galloping down from 500 and bisecting took 21; trying 500 peaked at 12x the budget
    assert len(result.trials) <= 9
    assert result.max_overshoot <= 1.25


def test_nothing_fits_names_the_bytes_needed_and_available():
    step = LinearStep(fixed=10_000, per_sample=100)
    with pytest.raises(BatchSizeTooLargeError) as info:
        search_max_batch_size(step, budget_bytes=5_000, release=no_release)
    assert info.value.bytes_needed == 10_100
    assert info.value.budget_bytes == 5_000
    assert "10100 bytes" in str(info.value) and "5000 bytes" in str(info.value)


def test_nothing_fits_because_batch_one_runs_out_of_memory():
    step = LinearStep(fixed=1, per_sample=1, oom_above=0)
    with pytest.raises(BatchSizeTooLargeError, match="ran out of memory"):
        search_max_batch_size(step, budget_bytes=5_000, release=no_release)


def test_nothing_fits_where_batch_one_fits_only_before_the_optimizers_state_exists():
    """A Trainer's warmup at batch 1 fitted (no AdamW state yet) and its second step did not:
    the probe answered 1, which every step of training after the first runs over the budget."""
    step = LinearStep(fixed=5_000, per_sample=100, first_call_extra=1_000)
    with pytest.raises(BatchSizeTooLargeError) as info:
        search_max_batch_size(step, budget_bytes=4_500, release=no_release)
    assert info.value.bytes_needed == 5_100


def test_everything_fits_up_to_the_cap():
    step = LinearStep(fixed=1_000, per_sample=1)
    result = search_max_batch_size(step, budget_bytes=10**9, max_batch_size=48, release=no_release)
    assert result.max_batch_size == 48
    assert max(step.calls) == 48  # never tries past the cap (e.g. the dataset size)
    check_bracket(result, cap=48)


def test_cap_of_one_runs_no_second_size():
    step = LinearStep(fixed=1_000, per_sample=1)
    result = search_max_batch_size(step, budget_bytes=10**9, max_batch_size=1, release=no_release)
    assert result.max_batch_size == 1 and set(step.calls) == {1}


def test_only_batch_one_fits():
    step = LinearStep(fixed=1_000, per_sample=100)
    result = search_max_batch_size(step, budget_bytes=1_150, release=no_release)
    assert result.max_batch_size == 1
    check_bracket(result)


def test_flat_peaks_without_cap_double_until_oom():
    step = LinearStep(fixed=1_000, per_sample=0, oom_above=100)
    result = search_max_batch_size(step, budget_bytes=10**9, release=no_release)
    assert result.max_batch_size == 100
    assert result.predicted_max_batch_size is None
    check_bracket(result)


def test_step_that_never_fails_without_cap_hits_the_guard():
    step = LinearStep(fixed=1_000, per_sample=0)
    with pytest.raises(RuntimeError, match="max_batch_size"):
        search_max_batch_size(step, budget_bytes=10**9, release=no_release, max_trials=20)


def test_noisy_non_monotone_step_still_gives_a_bracketed_answer():
    # Sizes 40 and 44 fail at random on top of a true limit of 50.
    def step(b):
        if b in (40, 44) or b > 50:
            raise RuntimeError(CPU_OOM)
        return 1_000 + 100 * b

    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 60, release=no_release)
    check_bracket(result)
    assert result.max_batch_size <= 50
    sizes = [t.batch_size for t in result.trials[1:]]
    assert len(sizes) == len(set(sizes))


def test_non_oom_errors_propagate():
    def step(b):
        raise RuntimeError("shape mismatch in the model")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        search_max_batch_size(step, budget_bytes=10**9, release=no_release)


def test_release_is_called_after_each_oom():
    released = []
    step = LinearStep(fixed=1_000, per_sample=100, oom_above=10)
    search_max_batch_size(step, budget_bytes=10**9, release=lambda: released.append(1))
    assert len(released) == sum(1 for b in step.calls if b > 10)


def test_result_serialises_with_every_trial():
    step = LinearStep(fixed=1_000, per_sample=100)
    d = search_max_batch_size(step, budget_bytes=3_000, release=no_release).to_dict()
    assert d["max_batch_size"] == 20
    assert d["estimate"] == {"fixed_bytes": 1_000, "bytes_per_sample": 100, "kind": "step", "predicted_max_batch_size": 20}
    assert {"batch_size", "fits", "peak_bytes", "seconds"} <= set(d["trials"][0])


@pytest.mark.parametrize("b,mode,expected", [(37, "none", 37), (37, "power_of_two", 32), (64, "power_of_two", 64), (1, "power_of_two", 1)])
def test_rounding(b, mode, expected):
    assert round_batch_size(b, mode) == expected


def test_rounding_rejects_unknown_mode():
    with pytest.raises(ValueError, match="batch_size_rounding='nearest'"):
        round_batch_size(8, "nearest")


def test_bad_budget_and_cap():
    with pytest.raises(ValueError, match="budget_bytes"):
        search_max_batch_size(LinearStep(1, 1), budget_bytes=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        search_max_batch_size(LinearStep(1, 1), budget_bytes=10, max_batch_size=0)


def test_powers_of_two():
    from adaptive_batch.probe.search import powers_of_two

    assert powers_of_two(0) == [] and powers_of_two(1) == [1]
    assert powers_of_two(8) == [1, 2, 4, 8] and powers_of_two(15) == [1, 2, 4, 8]


class StepWithOperators:
    """A fake step whose memory after each operator is affine in the batch; at batch 1 one
    operator is a view where larger batches copy (as a reshape of a non-contiguous tensor is)."""

    def __init__(self, oom_above=None):
        self.oom_above, self.calls = oom_above, []

    def timeline(self, b):
        # embedding optimizer temporaries (flat, 1_300), logits (400 a sample), the copy
        return [200 + 10 * b, 250 + 400 * b, 1_300] + ([] if b == 1 else [260 + 400 * b])

    def __call__(self, b):
        from adaptive_batch.memory.tracker import StepMemory

        self.calls.append(b)
        if self.oom_above is not None and b > self.oom_above:
            raise RuntimeError(CPU_OOM)
        line = self.timeline(b)
        ops = ["mm", "logits", "adamw"] + ([] if b == 1 else ["clone"])
        return StepMemory({"forward": max(line[:2]), "backward": max([line[1]] + line[3:]), "optimizer": line[2]}, line, ops)


def test_operator_lines_land_on_the_answer_with_one_failure_and_batch_three_when_one_differs():
    step = StepWithOperators()
    lines = []
    with lines_to(lines.append):
        result = search_max_batch_size(step, budget_bytes=3_000, release=no_release)
    # 260 + 400 * 6 = 2_660 fits, 7 gives 3_060
    assert step.calls == [1, 1, 2, 3, 6, 7]
    assert result.max_batch_size == result.predicted_max_batch_size == 6
    assert sum(not t.fits for t in result.trials) == 1
    assert "batch 1 and 2 ran different operators" in " ".join(lines)
    d = result.to_dict()
    assert d["estimate"]["kind"] == "operators" and d["estimate"]["bytes_per_sample"] == 400
    assert d["trials"][1]["phase_peak_bytes"] == {"forward": 650, "backward": 650, "optimizer": 1_300}


def test_operator_lines_are_tried_at_their_prediction_where_the_overshoot_bound_would_crawl():
    """A step whose peak at batch 1-2 is a large fixed optimizer temporary (an MLP under AdamW):
    the bound from the largest fit allowed a factor of ~4 a trial (7, 27, 106, 416, 747: 9 trial
    steps); operator lines from two steps that ran the same operators are the step's own memory."""

    class FlatThenLinear(StepWithOperators):
        def timeline(self, b):
            return [100 + 10 * b, 150 + 2 * b, 10_000, 120 + 30 * b]

        def __call__(self, b):
            from adaptive_batch.memory.tracker import StepMemory

            self.calls.append(b)
            line = self.timeline(b)
            return StepMemory({"forward": line[0], "backward": line[3], "optimizer": line[2]}, line,
                              ["mm", "relu", "adamw", "mm_backward"], start_bytes=100)

    step = FlatThenLinear()
    result = search_max_batch_size(step, budget_bytes=10_000, release=no_release)
    # 120 + 30 b is within 10_000 up to 329; the optimizer step's flat 10_000 fits at any size, and
    # the bound from 2 would have allowed 2 x (1.25 x 10_000 - 100) / 9_900 = 2 (so 3, then 4, ...)
    assert result.max_batch_size == result.predicted_max_batch_size == 329
    assert step.calls == [1, 1, 2, 329, 330]


def test_phase_lines_where_a_step_gives_phases_only():
    def step(b):
        return {"forward": 300 + 160 * b, "backward": 700 + 300 * b, "optimizer": 1_300}

    result = search_max_batch_size(step, budget_bytes=3_000, release=no_release)
    assert result.predicted_max_batch_size == result.max_batch_size == 7
    assert result.to_dict()["estimate"]["kind"] == "phases"
    # Without the step's start, the jump from 2 is bounded: 2 x 1.25 x 3_000 / 1_300 = 5.
    assert [t.batch_size for t in result.trials] == [1, 1, 2, 5, 7, 8]


def test_an_unbounded_search_jumps_to_the_prediction_without_a_start():
    # The planner's fake steps allocate nothing: the bound is off, the jump is the line's.
    import math

    step = LinearStep(fixed=1_000, per_sample=100)
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37, release=no_release, max_overshoot=math.inf)
    assert step.calls == [1, 1, 2, 37, 38]


class ConvexStep:
    """A step whose backward peak is the larger of two lines, as an H100 measured a
    152K-vocabulary model's (MiB): 971 + 123 b sets it at batch 1-2, 530 + 307 b from 3 on. Past
    the card's 78.4 GiB a step runs out of memory."""

    def __init__(self):
        self.calls = []

    def __call__(self, b):
        self.calls.append(b)
        mib = 2**20
        if 530 + 307 * b > 80_250:
            raise RuntimeError("CUDA out of memory. Tried to allocate 4.47 GiB.")
        return StepMemory({"forward": (220 + 160 * b) * mib, "backward": max(971 + 123 * b, 530 + 307 * b) * mib,
                           "optimizer": 979 * mib}, start_bytes=528 * mib)


def test_on_cuda_estimate_steps_double_until_the_slope_settles():
    """The line through batch 1 and 2 predicted 476 where 246 fit on the card (5 out-of-memory
    trials); doubling the estimate steps until two pairs agree predicts 246 itself."""
    budget = 76_250 * 2**20
    step = ConvexStep()
    result = search_max_batch_size(step, budget_bytes=budget, release=no_release, settle_slope=True)
    assert result.max_batch_size == 246 == result.predicted_max_batch_size
    assert step.calls == [1, 1, 2, 4, 8, 16, 246, 247]
    assert not any(t.batch_size > 247 for t in result.trials)
    check_bracket(result)
    unsettled = ConvexStep()
    before = search_max_batch_size(unsettled, budget_bytes=budget, release=no_release)
    assert before.max_batch_size == 246 and before.predicted_max_batch_size == 475  # the old guess (476 on the card)
    assert sum(t.oom for t in before.trials) >= 3 and sum(t.oom for t in result.trials) == 0


def test_settling_stops_at_the_cap_and_at_a_step_that_does_not_fit():
    capped = ConvexStep()
    result = search_max_batch_size(capped, budget_bytes=76_250 * 2**20, max_batch_size=6, release=no_release,
                                   settle_slope=True)
    assert result.max_batch_size == 6 and max(capped.calls) == 6
    small = ConvexStep()  # 12 fits a budget of 4.5 GiB, 16 does not
    result = search_max_batch_size(small, budget_bytes=4_608 * 2**20, release=no_release, settle_slope=True)
    assert result.max_batch_size == (4_608 - 530) // 307
    check_bracket(result)


class FakeClock:
    """Time that passes only in the steps: 0.1 s plus 10 ms a sample."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def step(self, batch_size):
        self.now += 0.1 + 0.01 * batch_size
        return 1000 + 10 * batch_size  # peak bytes: 1000 fits within 11_000


@pytest.mark.parametrize("time_budget_s,found,stopped", [(None, 1000, False), (5.0, 283, True), (60.0, 1000, False)])
def test_a_time_budget_stops_at_the_largest_fit_when_the_next_trial_would_end_past_it(
    monkeypatch, time_budget_s, found, stopped
):
    """On a CPU with no max_memory a single trial of the tiny config at batch 848 took 332 s: the
    search says what a trial at its prediction should cost, and does not start one past the budget."""
    clock = FakeClock()
    monkeypatch.setattr(search.time, "perf_counter", clock.perf_counter)
    lines = []
    with lines_to(lines.append):
        result = search_max_batch_size(clock.step, budget_bytes=11_000, time_budget_s=time_budget_s)
    assert (result.max_batch_size, result.stopped_by_time, result.to_dict()["stopped_by_time"]) == (found, stopped, stopped)
    eta = [line for line in lines if "should take about" in line]
    assert len(eta) == 1 and "predicted batch 1000 should take about 10.1s" in eta[0]
    stop = [line for line in lines if line.startswith("probe: stopped")]
    if stopped:
        assert stop == [
            "probe: stopped at batch 283, the largest that fitted so far: a trial at batch 1000 would take about 10s more, "
            "and the search has run 4s of probe_time_budget=5; raise probe_time_budget (or set it to null) to search further."
        ]
        assert max(t.batch_size for t in result.trials) == 283  # trials that fitted the budget still ran
    else:
        assert stop == []


def test_noise_in_the_small_steps_times_does_not_stop_the_search_short(monkeypatch):
    """A stall of 60 ms in the step at batch 2 of a small model (steps of 10 ms) put a trial at
    73460 past a budget of 600 s by the line through batch 1 and 2: the search stopped at 2 where
    73460 fit in 0.04 s. It now tries halfway first, whose step says what a sample costs."""
    clock = FakeClock()
    monkeypatch.setattr(search.time, "perf_counter", clock.perf_counter)
    seen = set()

    def step(batch_size):  # stalls the first time it sees each of the small sizes the line is drawn through
        clock.now += 0.01 + 4e-7 * batch_size + (0.06 * (batch_size - 1) if batch_size < 4 and batch_size not in seen
                                                    else 0.0)
        seen.add(batch_size)
        return StepMemory({"backward": 1000 + 10 * batch_size}, start_bytes=1000)  # the line allows the jump

    lines = []
    with lines_to(lines.append):
        result = search_max_batch_size(step, budget_bytes=1000 + 10 * 73460, time_budget_s=600.0)
    assert result.max_batch_size == 73460 and not result.stopped_by_time
    assert any(line.startswith("probe: a trial at batch 73460 would end past probe_time_budget=600") for line in lines)


def test_ranks_stop_for_time_together():
    """Ranks search in lockstep: one rank's wish to stop (its clock) is every rank's."""
    lines = []
    with lines_to(lines.append):
        result = search_max_batch_size(lambda b: 1000 + 10 * b, budget_bytes=11_000, time_budget_s=1e9, agree=lambda stop: True)
    assert result.stopped_by_time and result.max_batch_size == 2
    assert [line for line in lines if line.startswith("probe: stopped at batch 2, the largest that fitted so far: a trial at")]


def test_a_tolerance_settles_within_its_share_of_the_answer_instead_of_crawling():
    """Address space moves in steps of glibc's heap: an MLP's children crawled 19 trials to one
    sample 1% below the budget. Half a percent of tolerance settles in a few."""

    def step_from_a_shifted_line(calls):
        def peak(b):  # the line measured at 4_000 and 6_000 sits 60 above the top's
            calls.append(b)
            return 1_000 + b - (60 if b > 6_000 else 0)
        return peak

    exact_calls, loose_calls = [], []
    common = dict(budget_bytes=11_000, release=no_release, estimate_sizes=(4_000, 6_000), warmup=False,
                  max_overshoot=float("inf"))
    exact = search_max_batch_size(step_from_a_shifted_line(exact_calls), **common)
    loose = search_max_batch_size(step_from_a_shifted_line(loose_calls), tolerance=0.005, **common)
    assert exact.max_batch_size == 10_060
    assert 10_060 * 0.995 <= loose.max_batch_size <= 10_060 and len(loose_calls) < len(exact_calls)


def test_estimate_sizes_above_one_that_nothing_fits_say_batch_one_does_not_fit():
    """With the children's estimate sizes the search starts from below a first size that failed;
    when batch 1 fails too the answer is the error, never a batch of 0."""
    with pytest.raises(BatchSizeTooLargeError):
        search_max_batch_size(LinearStep(fixed=1_000, per_sample=10, oom_above=0), budget_bytes=5_000,
                              release=no_release, estimate_sizes=(8, 12), warmup=False)


def _search_a_table(peaks, budget_bytes):
    """The search in the trial processes' form (no warmup, no overshoot bound) over a step whose
    peak at each size is ``peaks[size]`` and which runs out of memory at any other size; the
    result and the sizes tried."""
    calls = []

    def step(b):
        calls.append(b)
        if b not in peaks:
            raise RuntimeError(CPU_OOM)
        return peaks[b]

    result = search_max_batch_size(step, budget_bytes=budget_bytes, warmup=False, max_overshoot=float("inf"),
                                   release=no_release)
    return result, calls


def test_galloping_up_stops_where_the_two_largest_fits_put_the_budget():
    """The trial processes' case on a Trainer's Llama (address space in MiB): the line through
    batch 1 and 2 put the answer at 5, 6 fitted with 5 MiB to spare, and a doubled stride tried 8
    then 7, two out-of-memory trials where 7 alone settles it."""
    result, calls = _search_a_table({1: 104, 2: 137, 5: 238, 6: 251}, budget_bytes=255)
    assert result.max_batch_size == 6 and calls == [1, 2, 5, 6, 7]
    assert sum(t.oom for t in result.trials) == 1


def test_a_stride_the_line_held_back_does_not_double_behind_it():
    """Peaks that flatten near the budget (an allocator's step-wise address space): while the
    line through the two largest fits holds the gallop to one size at a time, its stride must
    not go on doubling, or the first flat pair (no line) sends it far past the answer."""
    peaks = {1: 50, 2: 150, 10: 950, 11: 980, 12: 990, 13: 995, 14: 995, 15: 999}
    result, calls = _search_a_table(peaks, budget_bytes=1000)
    assert result.max_batch_size == 15 and sum(t.oom for t in result.trials) == 1, calls


def test_between_a_fit_and_a_failed_estimate_the_next_size_is_where_the_fit_grown_in_proportion_meets_the_budget():
    """A 152K x 64 model's trial processes: the line's first size, 6, fitted and its second, 9,
    failed; with no line the search went to 8, then 7, both out of memory, where 6 was the
    answer. The fit's step grown in proportion to the batch puts the budget at 6.3: 7 settles it."""
    step = LinearStep(fixed=150, per_sample=75, oom_above=6)
    result = search_max_batch_size(step, budget_bytes=632, release=no_release, estimate_sizes=(6, 9), warmup=False,
                                   max_overshoot=float("inf"))
    assert result.max_batch_size == 6 and step.calls == [6, 9, 7]
    # where the fit is far below the budget, the proportional size is tried first and fits
    step = LinearStep(fixed=50, per_sample=10, oom_above=40)
    result = search_max_batch_size(step, budget_bytes=500, release=no_release, estimate_sizes=(10, 60), warmup=False,
                                   max_overshoot=float("inf"))
    assert result.max_batch_size == 40 and step.calls[:3] == [10, 60, 33]
    assert len(step.calls) <= 9  # from 2 x 10 = 20 it took 11


@pytest.mark.parametrize("guess", [37, 36, 38, 30, 45, 200])
def test_a_first_guess_takes_the_estimate_steps_place_and_the_answer_is_the_same(guess):
    """After the warmup the guess is tried; right, the search ends at its neighbour; wrong either
    way, it moves from there to the same bracketed answer, and the guess's seconds count."""
    step = LinearStep(fixed=1_000, per_sample=100, first_call_extra=50, start=True)
    first = search.FirstGuess(guess, None, seconds=2.5, source="a test")
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37, release=no_release, first_guess=first)
    assert result.max_batch_size == 37 and step.calls[:2] == [1, guess]
    check_bracket(result)
    assert not [t for t in result.trials if t.phase == "estimate"]
    assert result.first_guess == search.GuessRecord(guess, 2.5, "a test", held=True) and result.total_seconds >= 2.5
    assert result.to_dict()["first_guess"] == {"batch_size": guess, "seconds": 2.5, "source": "a test", "held": True}
    if abs(guess - 37) <= 1:
        assert len(step.calls) <= 4


def test_a_first_guess_past_the_cap_tries_the_cap():
    step = LinearStep(fixed=1_000, per_sample=100, start=True)
    first = search.FirstGuess(50, None, seconds=0.1, source="a test")
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37, max_batch_size=20, release=no_release,
                                   first_guess=first)
    assert result.max_batch_size == 20 and step.calls == [1, 20]


def test_a_first_guess_still_refuses_a_budget_under_batch_one():
    step = LinearStep(fixed=1_000, per_sample=100, start=True)
    with pytest.raises(BatchSizeTooLargeError):
        search_max_batch_size(step, budget_bytes=900, release=no_release,
                              first_guess=search.FirstGuess(5, None, seconds=0.1, source="a test"))


@pytest.mark.parametrize("guess_slope", [60, 160])
def test_a_guess_whose_line_misses_its_own_step_is_redrawn_through_it_and_batch_two(guess_slope):
    """The guess's step peaks more than half a sample off the guess's line (a fake kernel unlike
    the real one): one real step at batch 2 and the line through it and the guess's step take
    over, and the search ends at the same answer in at most 6 real steps."""
    from adaptive_batch.memory.estimator import LinearMemoryEstimate

    step = LinearStep(fixed=1_000, per_sample=100, first_call_extra=50, start=True)
    line = LinearMemoryEstimate(fixed_bytes=1_000, bytes_per_sample=guess_slope)
    budget = 1_000 + 100 * 37
    first = search.FirstGuess(line.max_batch_size(budget), line, seconds=0.1, source="a test")
    lines = []
    with lines_to(lines.append):
        result = search_max_batch_size(step, budget_bytes=budget, release=no_release, first_guess=first)
    assert result.max_batch_size == 37 and step.calls[:3] == [1, first.batch_size, 2]
    assert result.predicted_max_batch_size == 37 and len(step.calls) <= 6
    check_bracket(result)
    assert any("one more real step at batch 2 draws the line" in line for line in lines)
    assert result.first_guess.held is False


def test_a_guess_that_runs_out_of_memory_leaves_the_line_to_the_estimate_steps():
    """Its step says nothing of the line; going down from it with none, the search ran 5 more
    out-of-memory trials. The estimate steps draw the line instead: past the guess's, only the
    size above the answer runs out of memory."""
    step = LinearStep(fixed=1_000, per_sample=100, oom_above=37, start=True)
    first = search.FirstGuess(80, None, seconds=0.1, source="a test")
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37, release=no_release, first_guess=first)
    assert result.max_batch_size == 37 and step.calls == [1, 80, 1, 2, 37, 38]
    assert sum(t.oom for t in result.trials) == 2 and result.first_guess.held is False
    check_bracket(result)


@pytest.mark.parametrize("cap", [1, 2])
def test_a_guess_never_runs_a_warmup_or_a_step_past_the_cap(cap):
    from adaptive_batch.memory.estimator import LinearMemoryEstimate

    step = LinearStep(fixed=1_000, per_sample=100, start=True)
    line = LinearMemoryEstimate(fixed_bytes=1_000, bytes_per_sample=100)
    first = search.FirstGuess(37, line, seconds=0.1, source="a test", added_at=(2, 200))
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37, max_batch_size=cap, release=no_release,
                                   first_guess=first)
    assert result.max_batch_size == cap and max(step.calls) <= cap


def test_a_warmup_at_two_that_does_not_fit_settles_at_one_without_running_two_again():
    from adaptive_batch.memory.estimator import LinearMemoryEstimate

    step = LinearStep(fixed=1_000, per_sample=100, start=True)
    line = LinearMemoryEstimate(fixed_bytes=1_000, bytes_per_sample=10)
    first = search.FirstGuess(10, line, seconds=0.1, source="a test", added_at=(2, 20))
    result = search_max_batch_size(step, budget_bytes=1_150, release=no_release, first_guess=first)
    assert result.max_batch_size == 1 and step.calls == [2, 1]
    with pytest.raises(BatchSizeTooLargeError):
        search_max_batch_size(LinearStep(fixed=1_000, per_sample=100, start=True), budget_bytes=1_050,
                              release=no_release, first_guess=first)


def test_a_guess_counts_in_the_time_budget():
    step = LinearStep(fixed=1_000, per_sample=100, start=True)
    first = search.FirstGuess(37, None, seconds=50.0, source="a test")
    result = search_max_batch_size(step, budget_bytes=1_000 + 100 * 37, release=no_release, first_guess=first,
                                   time_budget_s=10.0)
    assert result.total_seconds >= 50.0 and result.stopped_by_time
