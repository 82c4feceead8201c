import random
import re

import pytest

from adaptive_batch.data.token_budget import (
    TokenBudgetBatchSampler,
    TokenBudgetExceededError,
    check_token_budget,
    pack_by_tokens,
    truncating_collate,
)


def uneven_lengths(n=500, seed=0):
    rng = random.Random(seed)
    return [rng.choice([rng.randint(3, 40), rng.randint(40, 250)]) for _ in range(n)]


def padded(batch, lengths, max_tokens):
    return len(batch) * max(min(lengths[i], max_tokens) for i in batch)


@pytest.mark.parametrize("order", ["dataloader", "seqlen", "random"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_batch_respects_the_budget_and_every_sample_appears_once(order, shuffle):
    lengths = uneven_lengths()
    check_token_budget(lengths, max_tokens=1024, min_batch_size=4, max_batch_size=32)
    sampler = TokenBudgetBatchSampler(
        lengths, max_tokens=1024, picking_order=order, shuffle=shuffle, max_batch_size=32
    )
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert padded(b, lengths, 1024) <= 1024
        assert len(b) <= 32
    # every batch closed by the budget holds at least min_batch_size; only the epoch's tail may not
    assert sum(len(b) < 4 for b in batches) <= 1


def test_seqlen_packing_has_little_padding_and_shuffled_batch_order():
    lengths = uneven_lengths()
    fixed = TokenBudgetBatchSampler(lengths, max_tokens=1024, picking_order="dataloader", shuffle=True)
    by_len = TokenBudgetBatchSampler(lengths, max_tokens=1024, picking_order="seqlen", shuffle=True)

    def padding(batches):
        real = sum(lengths[i] for b in batches for i in b)
        return 1 - real / sum(padded(b, lengths, 1024) for b in batches)

    assert padding(list(by_len)) < 0.10 < padding(list(fixed))
    first_longest = [max(lengths[i] for i in b) for b in by_len]
    assert first_longest != sorted(first_longest)  # batches not in length order when shuffled
    unshuffled = TokenBudgetBatchSampler(lengths, max_tokens=1024, picking_order="seqlen", shuffle=False)
    longest = [max(lengths[i] for i in b) for b in unshuffled]
    assert longest == sorted(longest)


def test_orders_are_seeded_and_change_with_the_epoch():
    lengths = uneven_lengths()
    a = TokenBudgetBatchSampler(lengths, max_tokens=1024, picking_order="random", seed=3)
    b = TokenBudgetBatchSampler(lengths, max_tokens=1024, picking_order="random", seed=3)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    plain = TokenBudgetBatchSampler(lengths, max_tokens=1024, picking_order="dataloader", shuffle=False)
    assert [i for batch in plain for i in batch] == list(range(len(lengths)))


def test_state_round_trip_resumes_mid_epoch():
    lengths = uneven_lengths()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=1024, seed=5)
    sampler.set_epoch(2)
    full = list(sampler)
    it = iter(sampler)
    seen = [next(it) for _ in range(7)]
    state = sampler.state_dict()
    resumed = TokenBudgetBatchSampler(lengths, max_tokens=1024, seed=0)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert seen + rest == full  # no batch twice, none skipped
    assert list(resumed) == full  # the next pass starts the epoch again


def test_rank_split_gives_equal_counts_and_covers_every_batch():
    lengths = uneven_lengths(n=333)
    single = list(TokenBudgetBatchSampler(lengths, max_tokens=700, seed=1))
    ranks = [list(TokenBudgetBatchSampler(lengths, max_tokens=700, seed=1, num_replicas=3, rank=r)) for r in range(3)]
    assert len({len(r) for r in ranks}) == 1
    union = {tuple(b) for r in ranks for b in r}
    assert union == {tuple(b) for b in single}
    with pytest.raises(ValueError, match="rank=3"):
        TokenBudgetBatchSampler(lengths, max_tokens=700, num_replicas=3, rank=3)


def test_max_batch_size_closes_a_batch_early():
    batches = pack_by_tokens([5] * 20, range(20), max_tokens=1000, max_batch_size=6)
    assert [len(b) for b in batches] == [6, 6, 6, 2]


def test_long_samples_count_as_the_budget_and_are_truncated_by_the_collate():
    assert pack_by_tokens([10, 500, 10], [0, 1, 2], max_tokens=100) == [[0], [1], [2]]
    collate = truncating_collate(lambda samples: [len(s["tokens"]) for s in samples], 100, "tokens")
    assert collate([{"tokens": list(range(500)), "labels": list(range(500))}]) == [100]
    assert collate([{"tokens": [1] * 50, "labels": [1] * 50}, {"tokens": [1, 2], "labels": [1, 2]}]) == [50, 2]


def test_a_batch_over_the_token_budget_is_an_error_not_a_silent_overrun():
    # What lengths that are not the samples' (a hand-edited cache) would cut: 2 x 60 > 100.
    collate = truncating_collate(lambda samples: samples, 100, "tokens")
    with pytest.raises(TokenBudgetExceededError, match="padded to 120 tokens is over max_tokens=100"):
        collate([{"tokens": [1] * 60, "labels": [1] * 60}, {"tokens": [1] * 3, "labels": [1] * 3}])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_tokens=0), "max_tokens=0 must be a positive integer"),
        (dict(max_tokens="many"), "max_tokens='many'"),
        (dict(max_tokens=2), "smaller than the shortest sample (3 tokens)"),
        (dict(max_tokens=100, long_sample_policy="error"), "2 samples are longer"),
        (dict(max_tokens=100, min_batch_size=3), "cannot hold min_batch_size=3"),
        (dict(max_tokens=1000, min_batch_size=5, max_batch_size=2), "min_batch_size=5 is larger than max_batch_size=2"),
        (dict(max_tokens=1000, long_sample_policy="drop"), "long_sample_policy='drop'"),
    ],
)
def test_bad_budgets(kwargs, message):
    with pytest.raises(ValueError) as info:
        check_token_budget([3, 50, 150, 300], **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=2, min_batch_size=4), dict(max_tokens=2, long_sample_policy="error"),
                                    dict(max_tokens=100, min_batch_size=3), dict(max_tokens=2)])
def test_the_fix_a_bad_budget_names_passes_every_check(kwargs):
    """max_tokens=16 min_batch_size=4 said "raise max_tokens to at least 66" (the shortest
    sample), and 66 then said "raise max_tokens to 264"."""
    lengths = [3, 50, 150, 300]
    with pytest.raises(ValueError) as info:
        check_token_budget(lengths, **kwargs)
    fixed = int(re.search(r"raise max_tokens to (?:at least )?(\d+)", str(info.value)).group(1))
    check_token_budget(lengths, **dict(kwargs, max_tokens=fixed))


def test_truncation_count_is_reported():
    assert check_token_budget([3, 50, 150, 300], max_tokens=100) == 2


def test_unknown_picking_order():
    with pytest.raises(ValueError, match="sequence_picking_order='longest'"):
        TokenBudgetBatchSampler([1, 2], max_tokens=10, picking_order="longest")
