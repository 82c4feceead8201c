"""How the Trainer's effective batch splits into the micro-batches that fit."""

import pytest
import torch

pytest.importorskip("transformers")

from adaptive_batch.hf.micro_batches import (  # noqa: E402
    InputsHeld,
    describe_micro_batches,
    label_items,
    micro_batch_weight,
    split_effective_batch,
)


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
    # micro-batches of 6, 5, 5 labels: each mean loss, divided by 3 as the Trainer divides it, weighs its labels
    weights = [micro_batch_weight(items, 16, 3) / 3 for items in (6, 5, 5)]
    assert weights == pytest.approx([6 / 16, 5 / 16, 5 / 16])


def test_a_micro_batch_counts_the_labels_its_mean_is_over_as_the_trainer_counts_them():
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert label_items({"labels": labels}) == 3
    assert label_items({"labels": labels}, shifts_labels=True) == 1  # a causal LM's loss skips each row's first
    assert label_items({"labels": labels, "shift_labels": labels[:, 1:]}, shifts_labels=True) == 1
    assert label_items({"labels": torch.tensor([0, 1, 1])}) == 3  # a class a row
    assert label_items({"input_ids": torch.zeros(4, 7)}) == 4  # no labels: its rows


def test_uneven_only_in_one_process_on_one_device_with_fixed_batches():
    """DataParallel (several devices, one process) splits each micro-batch among its devices and
    Accelerate shards batches among ranks by count; batch_rebalance's batches have no fixed size."""
    from types import SimpleNamespace

    from torch.utils.data import IterableDataset

    from adaptive_batch.hf.micro_batches import uneven_allowed

    def trainer(dataset=(1, 2, 3), **args):
        settings = {"world_size": 1, "n_gpu": 1, "train_sampling_strategy": "random", **args}
        return SimpleNamespace(args=SimpleNamespace(**settings), train_dataset=dataset)

    assert uneven_allowed(trainer()) and uneven_allowed(trainer(n_gpu=0))
    assert not uneven_allowed(trainer(world_size=2)) and not uneven_allowed(trainer(n_gpu=2))
    assert not uneven_allowed(trainer(train_sampling_strategy="batch_rebalance"))
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(())

    assert not uneven_allowed(trainer(dataset=Stream())) and not uneven_allowed(trainer(dataset=None))


class _Head(torch.nn.Module):
    """A loss that reads the count (a sum over it) or ignores it (a mean), or is 0."""

    def __init__(self, reads, zero=False):
        super().__init__()
        self.weight, self.reads, self.zero = torch.nn.Parameter(torch.ones(1)), reads, zero

    def forward(self, labels, num_items_in_batch=None, **kwargs):
        loss = (labels.float() * self.weight * (0 if self.zero else 1)).sum()
        return type("Out", (), {"loss": loss / num_items_in_batch if self.reads else loss / labels.numel()})()


def test_whether_a_loss_reads_the_item_count_and_where_it_cannot_tell():
    from adaptive_batch.hf.micro_batches import loss_reads_item_count

    inputs = {"labels": torch.tensor([[1, 2, 3]])}
    assert loss_reads_item_count(_Head(reads=True), inputs)
    assert not loss_reads_item_count(_Head(reads=False), inputs)
    # a sample whose labels are all masked has a loss of 0 whatever the count: no verdict, the Trainer's stands
    assert loss_reads_item_count(_Head(reads=True, zero=True), inputs)
    assert loss_reads_item_count(_Head(reads=False), {"input_ids": torch.tensor([[1]])})  # no labels
    head = _Head(reads=False)
    loss_reads_item_count(head, inputs)
    assert head.training  # its mode put back


def test_a_loss_function_of_the_trainers_is_asked_too():
    from adaptive_batch.hf.micro_batches import loss_reads_item_count

    inputs = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
    model = torch.nn.Module()
    model.forward = lambda input_ids: {"logits": input_ids.float()}
    assert loss_reads_item_count(model, inputs, lambda out, labels, num_items_in_batch: out["logits"].sum() / num_items_in_batch)
    assert not loss_reads_item_count(model, inputs, lambda out, labels, num_items_in_batch: out["logits"].mean())


def test_an_override_is_said_to_take_the_ranks_factor_only_where_its_loss_is_multiplied_given_a_count():
    """Under 4 processes a compute_loss override returning a plain mean never reaches
    Trainer.compute_loss's factor of the ranks: dividing it out gave a quarter of the gradient."""
    from adaptive_batch.hf.micro_batches import scaled_by_the_ranks

    model = torch.nn.Linear(2, 1)
    inputs = {"x": torch.ones(3, 2), "labels": torch.ones(3, 1)}

    def mean(model, inputs, num_items_in_batch=None):
        return torch.nn.functional.mse_loss(model(inputs["x"]), inputs["labels"]) + 1.0

    def through_the_trainer(model, inputs, num_items_in_batch=None):  # as Trainer.compute_loss scales it
        return mean(model, inputs) * (4 if num_items_in_batch is not None else 1)

    assert not scaled_by_the_ranks(model, inputs, mean, ranks=4)
    assert scaled_by_the_ranks(model, inputs, through_the_trainer, ranks=4)


@pytest.mark.parametrize("micro_batch, effective, grows, by_accumulation, prefetched, expected", [
    (56, 112, False, False, True, (112, 56)),  # the step's two micro-batches, the next one on the CPU
    (56, 112, False, False, False, (112, 0)),  # on a card the next one waits on the host
    (128, 16, False, False, True, (128, 128)),  # a micro-batch past the step: the trial's own rows
    (8, 64, True, False, True, (8, 8)),  # growing, a step reaches the answer in one micro-batch
    (8, 64, True, True, False, (16, 0)),  # or in two, growing by accumulation
])
def test_the_inputs_a_trainer_step_holds(micro_batch, effective, grows, by_accumulation, prefetched, expected):
    held = InputsHeld.at(micro_batch, effective, grows=grows, grows_by_accumulation=by_accumulation,
                         prefetched=prefetched)
    assert (held.step_rows, held.prefetched_rows) == expected
    assert held.beside(micro_batch) == expected[0] - micro_batch + expected[1]
    assert held.at_peak(micro_batch) == held.beside(micro_batch) + expected[0]
