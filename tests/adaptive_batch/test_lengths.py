from adaptive_batch import sample_lengths


class DS:
    def __init__(self, lengths):
        self.lengths = lengths
        self.reads = 0

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        self.reads += 1
        return {"tokens": list(range(self.lengths[i]))}


def test_computed_once_then_read_from_the_cache(tmp_path):
    ds = DS([3, 5, 7, 9])
    assert sample_lengths(ds, cache_dir=str(tmp_path), key={"tok": "bytes"}) == [3, 5, 7, 9]
    first_reads = ds.reads
    assert sample_lengths(ds, cache_dir=str(tmp_path), key={"tok": "bytes"}) == [3, 5, 7, 9]
    assert ds.reads - first_reads == 2  # only the fingerprint's first and last samples


def test_changed_tokenizer_or_data_recomputes(tmp_path):
    sample_lengths(DS([3, 5, 7]), cache_dir=str(tmp_path), key={"tok": "a"})
    assert sample_lengths(DS([3, 5, 7]), cache_dir=str(tmp_path), key={"tok": "b"}) == [3, 5, 7]
    assert sample_lengths(DS([3, 6, 7, 8]), cache_dir=str(tmp_path), key={"tok": "a"}) == [3, 6, 7, 8]
    assert len(list(tmp_path.glob("seqlen_*.json"))) == 3


def test_corrupt_cache_is_ignored(tmp_path):
    ds = DS([3, 5])
    sample_lengths(ds, cache_dir=str(tmp_path), key=1)
    (path,) = tmp_path.glob("seqlen_*.json")
    path.write_text("{not json")
    assert sample_lengths(ds, cache_dir=str(tmp_path), key=1) == [3, 5]
