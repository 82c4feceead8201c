"""Growth seen from one rank: the user's function gets and returns global batch sizes."""

import pytest

from adaptive_batch import BatchIncreaseFunctionError
from adaptive_batch.run.grower import per_rank_increase
from adaptive_batch.schedule.growth import grow_batch_size


def double(epoch, current_batch_size):
    return current_batch_size


def test_per_rank_increase_shows_the_function_global_batches():
    assert per_rank_increase(double, 1) is double and per_rank_increase(None, 4) is None
    seen = []

    def add_six(epoch, current_batch_size):
        seen.append(current_batch_size)
        return 6

    grow = per_rank_increase(add_six, 4)
    assert grow(0, 2) == 1  # 6 over 4 ranks, rounded down so every rank keeps the same batch
    assert seen == [8]
    assert per_rank_increase(double, 2)(1, 3) == 3
    from adaptive_batch.logs import lines_to

    lines = []
    with lines_to(lines.append):  # fewer samples than ranks: no rank grows, and a line says why
        assert per_rank_increase(lambda epoch, size: 3, 4)(2, 8) == 0
    assert lines and "asked for 3 more samples at 2, fewer than the 4 ranks" in lines[0]

    def broken(epoch, current_batch_size):
        return 1.5

    with pytest.raises(BatchIncreaseFunctionError, match="broken at epoch=1, current_batch_size=6"):
        per_rank_increase(broken, 2)(1, 3)


# Two real processes over gloo. Rank 1 has the smaller budget and runs out of memory (a real
# allocator failure) from batch 8 on; rank 0 never does.


def test_per_rank_increase_errors_name_the_user_function_once():
    def stop(epoch, current_batch_size):
        raise RuntimeError("preempted")

    with pytest.raises(BatchIncreaseFunctionError) as info:
        grow_batch_size(per_rank_increase(stop, 2), epoch=2, current_batch_size=4, bound=16)
    assert str(info.value).startswith("batch_increase_function ") and str(info.value).count("batch_increase_function") == 1
    assert "stop at epoch=2, current_batch_size=8 raised RuntimeError: preempted" in str(info.value)


def test_per_rank_increase_passes_statistics_and_the_noise_scale_mark_on():
    from adaptive_batch import GrowthStatistics, noise_scale_growth
    from adaptive_batch.schedule.growth import call_batch_increase_function

    stats = GrowthStatistics(global_step=1, samples_seen=8, tokens_seen=80, gradient_noise_scale=24.0,
                             max_batch_size=64)
    per_rank = per_rank_increase(noise_scale_growth(max_factor=4), 2)
    assert per_rank.needs_gradient_noise_scale
    # 2 ranks x 4 = global 8, toward 24: +16 globally, +8 a rank
    assert call_batch_increase_function(per_rank, 1, 4, stats=stats) == 8


def test_steps_of_one_micro_batch_that_measure_no_noise_scale_say_so_once():
    """The key's line promises gradient_noise_scale every step; a run of one-micro-batch steps
    logged none, without a word."""
    import torch

    from adaptive_batch.distributed import RankGroup
    from adaptive_batch.logs import lines_to
    from adaptive_batch.run.grower import Grower
    from adaptive_batch.schedule.growth import GrowthOptions
    from adaptive_batch.schedule.noise_scale import NoiseScaleOptions

    grower = Grower(GrowthOptions(), NoiseScaleOptions(measure_noise_scale=True), ranks=RankGroup(torch.device("cpu")))
    model = torch.nn.Linear(4, 1)
    grower.track_gradients(model)
    warnings = []
    with lines_to(lambda line: None, warnings.append):
        for _ in range(3):  # steps of one micro-batch each
            grower.gradients.start()
            model(torch.ones(2, 4)).sum().backward()
            grower.gradients.after_micro_batch(torch.tensor(2.0))
            assert grower.measure_noise(2.0) is None
    assert len(warnings) == 1 and "a step of one micro-batch has no two gradients to compare" in warnings[0]
    assert "noise_scale_split_step=True" in warnings[0]
