from collections import OrderedDict, UserDict
from dataclasses import dataclass

import torch

from adaptive_batch.batch_tensors import tensors_of


@dataclass
class Pair:
    left: torch.Tensor
    right: list


def test_every_tensor_of_any_structure_once_in_its_order():
    """A UserDict (transformers' BatchEncoding, BatchFeature) is one leaf to torch's pytree."""
    a, b, c, d = (torch.zeros(n) for n in (1, 2, 3, 4))
    batch = UserDict(first=a, rest=[OrderedDict(b=b), (Pair(c, [d]), "text", None)])
    assert [t.numel() for t in tensors_of(batch)] == [1, 2, 3, 4]
    assert list(tensors_of("no tensors")) == []
