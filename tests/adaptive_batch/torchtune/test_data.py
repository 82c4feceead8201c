import os

import pytest

from adaptive_batch.torchtune import ByteTokenizer, pydoc_paragraphs, pydoc_text_dataset
from adaptive_batch.torchtune.data import write_pydoc_jsonl


def test_paragraphs_are_real_uneven_text():
    paragraphs = pydoc_paragraphs(min_chars=64)
    assert len(paragraphs) > 1000
    lengths = sorted(len(p) for p in paragraphs)
    assert lengths[0] >= 64 and lengths[-1] > 20 * lengths[len(lengths) // 2] // 10
    assert paragraphs == pydoc_paragraphs(min_chars=64)  # fixed order


def test_jsonl_is_written_once_and_keyed_by_content(tmp_path):
    a = write_pydoc_jsonl(str(tmp_path), 64)
    mtime = os.path.getmtime(a)
    assert write_pydoc_jsonl(str(tmp_path), 64) == a and os.path.getmtime(a) == mtime
    assert write_pydoc_jsonl(str(tmp_path), 200) != a


def test_the_folder_holds_the_file_this_run_reads_alone(tmp_path):
    """A resume refused for dataset.min_chars=32 left its file beside the run's: the folder's
    fingerprint changed, and the resume with the key put back was refused too."""
    from adaptive_batch.files import content_digest

    first = write_pydoc_jsonl(str(tmp_path), 64)
    before = content_digest(str(tmp_path))
    other = write_pydoc_jsonl(str(tmp_path), 32)
    assert os.listdir(tmp_path) == [os.path.basename(other)]
    assert write_pydoc_jsonl(str(tmp_path), 64) == first and content_digest(str(tmp_path)) == before


def test_dataset_through_torchtune_text_completion(tmp_path):
    ds = pydoc_text_dataset(ByteTokenizer(max_seq_len=128), data_dir=str(tmp_path), min_chars=64)
    assert len(ds) == len(pydoc_paragraphs(64))
    sample = ds[0]
    assert sample["tokens"] == sample["labels"] and 2 < len(sample["tokens"]) <= 127


def test_negative_min_chars():
    with pytest.raises(ValueError, match="min_chars=-1"):
        pydoc_paragraphs(-1)
