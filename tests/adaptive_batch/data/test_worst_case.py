"""The worst-case batch from a dataset's own samples: padded as real batches are only where the
samples differ in size."""

import torch

from adaptive_batch.data.worst_case import RepeatedSample


def test_by_input_ids_one_of_each_batch_is_a_token_shorter_where_lengths_differ():
    same = [{"input_ids": [5, 6, 7]}] * 4
    assert RepeatedSample.longest(same, list)(3) == [same[0]] * 3
    longest = {"input_ids": [5, 6, 7], "labels": torch.tensor([5, 6, 7]), "attention_mask": (1, 1, 1),
               "pixel_values": torch.ones(2, 3), "source": "web"}
    batch = RepeatedSample.longest([{"input_ids": [5]}, longest], list)(3)
    assert batch[:2] == [longest] * 2
    shorter = batch[2]
    assert shorter["input_ids"] == [5, 6] and shorter["labels"].tolist() == [5, 6]
    assert shorter["attention_mask"] == (1, 1) and shorter["source"] == "web"
    assert shorter["pixel_values"].shape == (2, 3)  # not a per-token field
    assert RepeatedSample.longest([{"input_ids": [5]}, longest], list)(1) == [longest]


def test_by_collated_elements_the_next_largest_sample_is_the_padded_one():
    def pad(samples):
        return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)

    samples = [torch.ones(n) for n in (3, 9, 4, 7, 9)]
    worst = RepeatedSample.largest(samples, pad, scan=4)  # the last 9 is past the scan
    assert worst(3).shape == (3, 9) and worst(3)[-1].sum() == 7
    assert worst(1).sum() == 9
    images = [torch.ones(3, 4, 4)] * 3
    assert RepeatedSample.largest(images, torch.stack, scan=256).shorter is None


def test_numpy_fields_are_cut_a_stacking_collate_is_never_padded_and_no_samples_is_one_line():
    import numpy as np
    import pytest

    from adaptive_batch import ConfigError

    longest = {"input_ids": np.arange(4), "labels": np.arange(4)}
    shorter = RepeatedSample.longest([{"input_ids": np.arange(2)}, longest], list)(2)[1]
    assert shorter["input_ids"].tolist() == [0, 1, 2] and shorter["labels"].tolist() == [0, 1, 2]
    # torch.stack takes equal sizes only: its batches are never padded, the largest repeated is the worst
    samples = [torch.ones(3), torch.ones(5)]
    assert RepeatedSample.largest(samples, torch.stack, scan=256).shorter is None
    for make in (lambda: RepeatedSample.longest([], list), lambda: RepeatedSample.largest([], list, scan=256)):
        with pytest.raises(ConfigError, match="the training dataset is empty.*make_batch"):
            make()


def test_a_stream_is_told_to_pass_make_batch():
    import pytest

    from adaptive_batch import ConfigError

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": [1, 2]}

    with pytest.raises(ConfigError, match="the training dataset is a Stream, read in order.*pass make_batch=f"):
        RepeatedSample.longest(Stream(), list)
