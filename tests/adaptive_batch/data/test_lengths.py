import json

import pytest

from adaptive_batch.data.lengths import sample_lengths


class DS:
    def __init__(self, lengths):
        self.lengths = lengths
        self.reads = 0

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        self.reads += 1
        return {"input_ids": list(range(self.lengths[i]))}


def test_computed_once_then_read_from_the_cache(tmp_path):
    ds = DS([3, 5, 7, 9])
    assert sample_lengths(ds, input_key="input_ids", cache_dir=str(tmp_path), key={"tok": "bytes"}) == [3, 5, 7, 9]
    first_reads = ds.reads
    assert sample_lengths(ds, input_key="input_ids", cache_dir=str(tmp_path), key={"tok": "bytes"}) == [3, 5, 7, 9]
    # the fingerprint's first and last samples, then the spot check (all 4 samples here)
    assert ds.reads - first_reads == 2 + 4


def test_changed_tokenizer_or_data_recomputes(tmp_path):
    sample_lengths(DS([3, 5, 7]), input_key="input_ids", cache_dir=str(tmp_path), key={"tok": "a"})
    assert sample_lengths(DS([3, 5, 7]), input_key="input_ids", cache_dir=str(tmp_path), key={"tok": "b"}) == [3, 5, 7]
    assert sample_lengths(DS([3, 6, 7, 8]), input_key="input_ids", cache_dir=str(tmp_path), key={"tok": "a"}) == [3, 6, 7, 8]
    assert len(list(tmp_path.glob("seqlen_*.json"))) == 3


def test_corrupt_cache_is_ignored(tmp_path):
    ds = DS([3, 5])
    sample_lengths(ds, input_key="input_ids", cache_dir=str(tmp_path), key=1)
    (path,) = tmp_path.glob("seqlen_*.json")
    path.write_text("{not json")
    assert sample_lengths(ds, input_key="input_ids", cache_dir=str(tmp_path), key=1) == [3, 5]


def _poison(tmp_path, lengths):
    (path,) = tmp_path.glob("seqlen_*.json")
    path.write_text(json.dumps(lengths))
    return path


@pytest.mark.parametrize(
    "poison,reason",
    [
        ([3, 5, 7], "3 lengths for 4 samples"),  # truncated
        ({"a": 1}, "dict lengths for 4 samples"),
        ([3, 5, 7, 0], "not all lengths are positive integers"),
        ([3, 5, 7.5, 9], "not all lengths are positive integers"),
        ([3, 5, True, 9], "not all lengths are positive integers"),
        ([3, 5, 2040, 9], "sample 2 has 7 tokens, the file says 2040"),
    ],
)
def test_a_bad_length_cache_is_recomputed_with_a_warning(tmp_path, poison, reason):
    ds = DS([3, 5, 7, 9])
    sample_lengths(ds, input_key="input_ids", cache_dir=str(tmp_path), key=1)
    _poison(tmp_path, poison)
    warnings = []
    assert sample_lengths(ds, input_key="input_ids", cache_dir=str(tmp_path), key=1, warn=warnings.append) == [3, 5, 7, 9]
    (line,) = warnings
    assert reason in line and "computing the lengths again" in line
    # and the file is good again
    assert sample_lengths(ds, input_key="input_ids", cache_dir=str(tmp_path), key=1, warn=warnings.append) == [3, 5, 7, 9]
    assert len(warnings) == 1
