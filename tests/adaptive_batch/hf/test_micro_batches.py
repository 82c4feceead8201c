"""How the Trainer's effective batch splits into the micro-batches that fit."""

import pytest

pytest.importorskip("transformers")

from adaptive_batch.hf.micro_batches import describe_micro_batches, rows_weight, split_effective_batch  # noqa: E402


@pytest.mark.parametrize("effective, largest, uneven, expected", [
    (64, 7, (7, 10), (4, 16)),  # uneven: 10 micro-batches where equal ones take 16
    (64, 16, (16, 4), (16, 4)),  # a divisor fits: the same either way
    (16, 40, (16, 1), (16, 1)),  # the whole batch fits
    (13, 4, (4, 4), (1, 13)),  # a prime: 4 + 3 + 3 + 3 against 13 x 1
])
def test_the_fewest_micro_batches_uneven_in_one_process_equal_under_several(effective, largest, uneven, expected):
    assert split_effective_batch(effective, largest, uneven_allowed=True) == uneven
    assert split_effective_batch(effective, largest, uneven_allowed=False) == expected


def test_the_split_is_said_by_size_and_every_sample_weighs_the_same():
    assert describe_micro_batches(64, 7) == "4 x 7 + 6 x 6" and describe_micro_batches(16, 4) == "4 x 4"
    # micro-batches of 6, 5, 5: each mean loss, divided by 3 as the Trainer divides it, weighs its rows
    weights = [rows_weight(rows, 16, 3) / 3 for rows in (6, 5, 5)]
    assert weights == pytest.approx([6 / 16, 5 / 16, 5 / 16])
