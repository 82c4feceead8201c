from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch

from adaptive_batch.data.layout import BatchLayout
from adaptive_batch.run.step import accumulate_gradients

Pair = namedtuple("Pair", "inputs labels")


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    name: str = "b"
    extra: dict = field(default_factory=dict)


class Encoding(dict):
    """Like transformers' BatchEncoding: a dict subclass with an attribute of its own."""

    def __init__(self, data=None, tag="enc"):
        super().__init__(data or {})
        self.tag = tag


def _rows(piece, key):
    return piece[key].shape[0] if isinstance(piece, dict) else getattr(piece, key).shape[0]


def test_a_torchtune_dict_splits_rows_and_shares_the_rest():
    batch = {"tokens": torch.arange(12).reshape(6, 2), "labels": torch.arange(6), "scale": torch.tensor(2.0)}
    pieces = BatchLayout().split(batch, [4, 2])
    assert [p["tokens"].shape[0] for p in pieces] == [4, 2]
    assert torch.equal(torch.cat([p["labels"] for p in pieces]), batch["labels"])
    assert all(p["scale"] is batch["scale"] for p in pieces)
    with pytest.raises(ValueError, match="add up to 5"):
        BatchLayout().split(batch, [3, 2])


@pytest.mark.parametrize("make", [
    lambda x, y: (x, y),
    lambda x, y: [x, y],
    lambda x, y: Pair(x, y),
    lambda x, y: Batch(x, y, extra={"mask": x > 3}),
    lambda x, y: Encoding({"input_ids": x, "labels": y}, tag="t"),
    lambda x, y: OrderedDict(input_ids=x, labels=y),
    lambda x, y: defaultdict(list, input_ids=x, labels=y),
    lambda x, y: {"inputs": {"ids": x}, "targets": [y]},
], ids=["tuple", "list", "namedtuple", "dataclass", "batch-encoding", "ordered-dict", "defaultdict", "nested"])
def test_any_structure_keeps_its_type_and_every_sample_once(make):
    x, y = torch.arange(10).reshape(5, 2), torch.arange(5) * 10
    batch = make(x, y)
    layout = BatchLayout()
    assert layout.rows(batch) == 5
    pieces = layout.split(batch, [3, 2])
    assert all(type(p) is type(batch) for p in pieces)
    assert [layout.rows(p) for p in pieces] == [3, 2]
    flat = lambda p: torch.cat([t.flatten() for t in _leaves(p)])  # noqa: E731
    assert torch.equal(torch.cat([flat(p) for p in pieces]).sort().values, flat(batch).sort().values)
    if isinstance(batch, Encoding):
        assert all(p.tag == "t" for p in pieces)
    if isinstance(batch, defaultdict):
        assert all(p.default_factory is list for p in pieces)
    if isinstance(batch, Batch):
        assert [p.extra["mask"].shape[0] for p in pieces] == [3, 2] and all(p.name == "b" for p in pieces)


def _leaves(value):
    from adaptive_batch.batch_tensors import tensors_of

    return list(tensors_of(value))


def test_batch_dim_and_batch_size_of_name_the_samples():
    seq_first = {"x": torch.zeros(7, 4, 3)}  # [sequence, batch, features]
    layout = BatchLayout(batch_dim=1)
    assert layout.rows(seq_first) == 4
    assert [p["x"].shape for p in layout.split(seq_first, [3, 1])] == [(7, 3, 3), (7, 1, 3)]
    counted = BatchLayout(batch_size_of=lambda b: len(b["names"]))
    assert counted.rows({"names": ["a", "b"], "x": torch.zeros(9)}) == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0"])
def test_a_batch_dim_that_is_not_a_dimension_is_refused(bad):
    with pytest.raises(ValueError, match=f"batch_dim={bad!r} must be a dimension index"):
        BatchLayout(batch_dim=bad)


def test_a_batch_without_a_tensor_to_count_says_what_to_pass():
    with pytest.raises(ValueError, match="name it with batch_dim=, or pass batch_size_of"):
        BatchLayout().rows({"names": ["a", "b"]})
    with pytest.raises(ValueError, match="no tensor of the batch"):
        BatchLayout(batch_dim=2).rows((torch.zeros(3, 4),))


def test_a_tuple_batch_accumulates_to_the_unsplit_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    inputs, targets = torch.randn(6, 4), torch.randn(6, 1)

    def forward_backward(batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
        loss.backward()
        return loss.detach(), torch.tensor(x.shape[0])

    forward_backward((inputs, targets))
    whole = model.weight.grad.clone()
    model.zero_grad()
    step = accumulate_gradients(forward_backward, (inputs, targets), rows=6, micro_batch_limit=4,
                                zero_grad=model.zero_grad)
    assert step.micro_batch_sizes == [3, 3] and int(step.num_tokens) == 6
    assert torch.allclose(model.weight.grad, whole, atol=1e-6)


def test_copies_hold_the_rows_asked_of_each_per_sample_tensor_and_share_the_rest():
    """What a trial holds for the inputs training keeps beside its micro-batch: whole copies of
    the batch, then its first samples, of every tensor with a row per sample, and nothing of a
    tensor shared by every sample."""
    batch = {"pixel_values": torch.randn(4, 3, 2, 2), "labels": torch.arange(4), "scale": torch.ones(3)}
    held = BatchLayout().copies(batch, 10)
    assert [t.shape[0] for t in held] == [4, 4, 2, 4, 4, 2]
    assert sum(t.numel() * t.element_size() for t in held) == 10 * (3 * 2 * 2 * 4 + 8)
    assert all(t.data_ptr() != batch["pixel_values"].data_ptr() for t in held)  # copies, not views
    assert BatchLayout().copies(batch, 0) == []
    assert [t.shape for t in BatchLayout(batch_dim=1).copies(torch.zeros(2, 3), 4)] == [(2, 3), (2, 1)]
