"""AdaptiveBatch: the library in a plain loop, two calls beside the loop's own lines."""

import json

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

from adaptive_batch import AdaptiveBatch, ConfigError, double_every_epoch


def _parts(seed=0, samples=48, dropout=0.0):
    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(samples, 8), torch.randn(samples, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(batch):  # the micro-batch's mean loss, as any loop writes it
        inputs, targets = batch
        return torch.nn.functional.mse_loss(model(inputs), targets)

    return data, model, optimizer, loss_fn


def test_the_loop_grows_the_batch_each_epoch_with_the_lr_following():
    data, model, optimizer, loss_fn = _parts()
    adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, max_batch_size=16,
                             batch_increase_function=double_every_epoch, lr_scaling="linear", log=lambda m: None)
    seen = []
    for epoch in range(3):
        for batch in adaptive.batches(epoch):
            step = adaptive.step(batch)
            seen.append((epoch, step.global_samples, step.lr))
    assert [(e, b) for e, b, _ in seen] == [(0, 4)] * 12 + [(1, 8)] * 6 + [(2, 16)] * 3
    assert {lr for _, b, lr in seen} == {0.1, 0.2, 0.4}  # linear in the batch, from 0.1 at 4
    assert optimizer.param_groups[0]["lr"] == seen[-1][2] == 0.4  # the LR in force between steps


def test_a_step_in_micro_batches_is_the_whole_batch_step():
    data, model, optimizer, loss_fn = _parts()
    # the same model and data, stepped by hand on the whole batch
    _, plain, plain_optimizer, plain_loss = _parts()
    adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, global_batch_size=12, shuffle=False,
                             log=lambda m: None)
    batch = next(iter(adaptive.batches(0)))
    step = adaptive.step(batch)
    assert step.accumulated.micro_batch_sizes == [4, 4, 4] and step.global_samples == 12
    whole = plain_loss(batch)
    whole.backward()
    plain_optimizer.step()
    assert step.loss == pytest.approx(whole.item(), rel=1e-5)
    for (name, got), want in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.allclose(got, want, atol=1e-6), name


def test_probing_needs_a_worst_case_batch_said_before_any_step():
    data, model, optimizer, loss_fn = _parts()
    with pytest.raises(ConfigError, match="pass make_batch=f"):
        AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, use_maximum_batch_size=True)
    with pytest.raises(ConfigError, match="unknown argument 'batch_sise': AdaptiveBatch does not read it; did you mean"):
        AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, batch_sise=8)
    with pytest.raises(ConfigError, match="max_tokens=512: .* remove max_tokens and set batch_size"):
        AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, max_tokens=512)


def _pairs(samples):  # a collate_fn of the user's own: inputs and targets stacked apart
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


def test_a_dataloader_handed_over_gives_its_dataset_collate_shuffle_workers_and_batch():
    from torch.utils.data import DataLoader

    data, model, optimizer, loss_fn = _parts()
    loader = DataLoader(data, batch_size=6, shuffle=False, collate_fn=_pairs, num_workers=1, persistent_workers=True)
    adaptive = AdaptiveBatch(model, optimizer, loader, loss_fn, log=lambda m: None)
    got = list(adaptive.batches(0))
    want = list(loader)
    assert adaptive.batch_size == 6 and len(got) == len(want) == 8
    assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want))
    assert adaptive._dataloader.num_workers == 1 and adaptive._dataloader.persistent_workers
    # its options beside a plain dataset; batch_size= wins over the loader's
    adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, num_workers=1, log=lambda m: None)
    assert adaptive._dataloader is None and len(list(adaptive.batches(0))) == 12
    assert AdaptiveBatch(model, optimizer, loader, loss_fn, batch_size=12, log=lambda m: None).batch_size == 12


def test_a_dropped_loop_ends_its_loaders_workers_at_once():
    """A cycle through the loop left it to the garbage collector, which ends the loader's worker
    queues before the loader: its shutdown then waited 5 s for each worker, which lived on."""
    import gc
    import multiprocessing
    import weakref

    data, model, optimizer, loss_fn = _parts()
    adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, num_workers=1, persistent_workers=True,
                             log=lambda m: None)
    assert len(list(adaptive.batches(0))) == 12 and adaptive.batch_size == 4
    workers = [p for p in multiprocessing.active_children() if p.is_alive()]
    dropped = weakref.ref(adaptive)
    gc.disable()
    try:
        del adaptive
        assert dropped() is None  # freed by its count of references, not left to a collection
    finally:
        gc.enable()
    assert workers and not any(p.is_alive() for p in workers)


def test_a_data_source_that_cannot_be_resized_is_one_line_before_any_step():
    from torch.utils.data import DataLoader, IterableDataset, SubsetRandomSampler

    data, model, optimizer, loss_fn = _parts()

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(data)

    cases = [
        (dict(dataset=DataLoader(data, sampler=SubsetRandomSampler(range(8)), batch_size=2)),
         r"DataLoader\(sampler=SubsetRandomSampler\): .* hand it the loader's dataset"),
        (dict(dataset=DataLoader(data, batch_sampler=[[0, 1], [2, 3]])), r"DataLoader\(sampler=list\)"),
        (dict(dataset=DataLoader(data, batch_size=5, drop_last=True)), r"drop_last=True\): .* set drop_last=False"),
        (dict(dataset=Stream(), batch_size=2), r"dataset=Stream: AdaptiveBatch resizes batches of a map-style dataset"),
        (dict(dataset=data), "batch_size is missing: pass batch_size="),
        (dict(dataset=data, batch_size=2, prefetch_factor=4), r"prefetch_factor=4 needs worker processes: set num_workers=1"),
        (dict(dataset=data, batch_size=2, num_workers=-1), r"num_workers=-1 must be an int, 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            AdaptiveBatch(model, optimizer, loss_fn=loss_fn, log=lambda m: None, **kwargs)


def test_a_make_batch_that_ignores_its_size_is_refused_before_any_step():
    data, model, optimizer, loss_fn = _parts()
    with pytest.raises(ConfigError, match=r"make_batch\(1\) and make_batch\(2\) built tensors of the same shapes"):
        AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, use_maximum_batch_size=True,
                      make_batch=lambda n: (torch.randn(16, 8), torch.randn(16, 1)))


def test_the_probe_finds_the_largest_batch_that_fits_and_training_takes_it(tmp_path):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 256), torch.randn(4096, 1))
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    before = [p.clone() for p in model.parameters()]

    def loss_fn(batch):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(model(inputs), targets)

    adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=1, use_maximum_batch_size=True,
                             max_memory="32MiB", probe_cache=False, make_batch=lambda b: (torch.randn(b, 256), torch.randn(b, 1)),
                             output_dir=str(tmp_path), log=lambda m: None)
    found = adaptive.batch_size
    report = json.loads((tmp_path / "batch_probe.json").read_text())
    assert 1 < found < 4096 and report["batch_size"] == found
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the probe put the model back
    step = adaptive.step(next(iter(adaptive.batches(0))))
    assert step.global_samples == found and step.accumulated.oom_retries == 0


def test_without_probing_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data, model, optimizer, loss_fn = _parts()
    adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, log=lambda m: None)
    adaptive.step(next(iter(adaptive.batches(0))))
    assert list(tmp_path.iterdir()) == []


def _run(state=None, stop_after=None, dropout=0.0):
    """Three epochs of growth with a shuffled sampler and a step-counted scheduler; stops after
    ``stop_after`` steps with the checkpoint (the RNG beside the model's, as a loop keeps it), or
    resumes from ``state``."""
    data, model, optimizer, loss_fn = _parts(dropout=dropout)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** (step // 5))
    adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, max_batch_size=16, lr_scheduler=scheduler,
                             batch_increase_function=double_every_epoch, log=lambda m: None)
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        adaptive.load_state_dict(state["adaptive"])
        torch.set_rng_state(state["rng"])
        start = state["epoch"]
    losses = []
    for epoch in range(start, 3):
        for batch in adaptive.batches(epoch):
            losses.append(adaptive.step(batch).loss)
            if len(losses) == stop_after:
                return losses, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "adaptive": adaptive.state_dict(), "epoch": epoch, "rng": torch.get_rng_state()}
    return losses, None


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_stopped_inside_an_epoch_and_resumed_from_its_state_equals_the_uninterrupted_run(dropout):
    """With dropout, the resumed run's masks are the uninterrupted run's only where the loader
    drew nothing from the global RNG at the resumed epoch's start (it drew one number, and the
    losses differed from the next step on)."""
    whole, _ = _run(dropout=dropout)
    first, state = _run(stop_after=5, dropout=dropout)
    rest, _ = _run(state=state, dropout=dropout)
    assert len(whole) == 21 and first + rest == pytest.approx(whole, rel=1e-6)


def test_a_schedule_that_cannot_be_counted_in_samples_is_refused_before_the_probe():
    """It was refused once the whole probe had run."""
    data, model, optimizer, loss_fn = _parts()
    with pytest.raises(ConfigError, match="lr_scheduler: StepLR is not a LambdaLR"):
        AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, use_maximum_batch_size=True,
                      make_batch=lambda n: data[:n], max_memory="64MiB", lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))


def test_a_model_that_cannot_train_a_batch_of_one_is_told_where_the_probe_starts_from_two():
    """torch's own ValueError from inside the probe's first trial, naming nothing of ours."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    adaptive = AdaptiveBatch(model, optimizer, data, lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]),
                             batch_size=4, use_maximum_batch_size=True, max_memory="16MiB",
                             make_batch=lambda n: (torch.randn(n, 8), torch.randn(n, 1)), log=lambda m: None)
    with pytest.raises(ConfigError, match=r"a batch of 1 does not train .* adaptive_batch.find_max_batch_size"):
        adaptive.batch_size


def test_a_state_saved_at_an_epochs_end_resumes_at_the_next_epoch():
    """A loop that saves after an epoch's loop ended resumes at the next epoch: the loader took up
    the saved epoch's ended iterator in its place, which yielded nothing, and a whole epoch went
    untrained without a word. With steps of the saved epoch left, the next epoch is refused."""
    whole, _ = _run()
    first, state = _run(stop_after=12)  # epoch 0's last step: 48 samples of 4
    rest, _ = _run(state={**state, "epoch": 1})
    assert first + rest == pytest.approx(whole, rel=1e-6)
    _, mid = _run(stop_after=5)
    with pytest.raises(ConfigError, match=r"batches\(1\) after load_state_dict\(\) of a loop saved in epoch 0, 7 of its "
                                          r"steps left: call batches\(0\) first"):
        _run(state={**mid, "epoch": 1})


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _hf_samples(count=24, length=32):
    """Hugging Face's batch layout (input_ids, attention_mask, labels), each sample's loss over
    a different number of tokens (the rest of its labels -100)."""
    generator = torch.Generator().manual_seed(1)
    samples = []
    for i in range(count):
        ids = torch.randint(0, 512, (length,), generator=generator)
        labels = ids.clone()
        labels[length - 1 - 3 * (i % 8):] = -100
        samples.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels})
    return samples


def _tokens_with_a_loss(batch):  # what a causal LM's mean loss is over: the shifted labels kept
    return (batch["labels"][:, 1:] != -100).sum()


def test_a_random_init_transformers_model_steps_in_micro_batches_as_on_the_whole_batch():
    # The property is the gradient, so SGD in float64. Under AdamW two sums of the same float32
    # gradients in another order (~1e-7 apart) are divided by their root mean square, which blows
    # up a gradient that nearly cancels: after 3 steps an embedding row differed by 1.12e-5 on
    # some machines, against atol 1e-5 (red on a fresh clone). A wrong weighting of the
    # micro-batches moves the gradient by percents, far past this tolerance.
    model, plain = _llama().double(), _llama().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    adaptive = AdaptiveBatch(model, optimizer, _hf_samples(), lambda batch: model(**batch).loss, batch_size=4,
                             global_batch_size=8, count_of=_tokens_with_a_loss, shuffle=False, log=lambda m: None)
    losses = []
    for batch in adaptive.batches(0):
        step = adaptive.step(batch)
        assert step.accumulated.micro_batch_sizes == [4, 4]
        whole = plain(**batch).loss  # the same batch in one piece
        whole.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        losses.append((step.loss, whole.item()))
    assert len(losses) == 3
    assert [a for a, _ in losses] == pytest.approx([b for _, b in losses], rel=1e-6)  # the loss is upcast to float32
    for got, want in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-8)


def test_a_probe_under_a_global_batch_gives_a_loss_that_takes_its_labels_a_batch_each():
    """The trial runs two micro-batches of the same worst-case batch; a loss that pops its
    targets out of a dict batch (as torchtune's does) got none the second time."""
    torch.manual_seed(0)
    samples = [{"x": torch.randn(8), "y": torch.randn(1)} for _ in range(48)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(batch):
        targets = batch.pop("y")
        return torch.nn.functional.mse_loss(model(batch["x"]), targets)

    adaptive = AdaptiveBatch(model, optimizer, samples, loss_fn, batch_size=4, global_batch_size=48,
                             use_maximum_batch_size=True, max_memory="64MiB", probe_cache=False,
                             make_batch=lambda b: {"x": torch.randn(b, 8), "y": torch.randn(b, 1)}, log=lambda m: None)
    step = adaptive.step(next(iter(adaptive.batches(0))))
    assert step.global_samples == 48


def _loop(samples=48, **settings):
    data, model, optimizer, loss_fn = _parts(samples=samples)
    settings = {"batch_size": 4, "max_batch_size": 16, "batch_increase_function": double_every_epoch, **settings}
    return AdaptiveBatch(model, optimizer, data, loss_fn, log=lambda m: None, **settings)


def _grow_twice(epoch, current_batch_size):
    return 2 * current_batch_size


@pytest.mark.parametrize("changed, key", [
    (dict(max_batch_size=8), "max_batch_size"),  # once grown past the new cap without a word
    (dict(batch_increase_function=_grow_twice), "batch_increase_function"),
    (dict(lr_scaling="sqrt"), "lr_scaling"),
    (dict(batch_size=2), "batch_size"),  # the LR reference: the scaled LR doubled mid-run
    (dict(samples=40), "dataset_size"),
])
def test_a_resume_with_a_setting_that_changes_what_is_trained_is_refused_naming_it(changed, key):
    saved = _loop()
    for batch in saved.batches(0):
        saved.step(batch)
        break
    state = saved.state_dict()
    samples = changed.pop("samples", 48)
    refused = _loop(samples=samples, **changed)
    with pytest.raises(ConfigError, match=rf"load_state_dict\(\): {key} was .* now.*put it back to resume, or train "
                                          "from the start without the saved state"):
        refused.load_state_dict(state)
    assert refused.batch_size == changed.get("batch_size", 4)  # nothing of the refused state taken
    _loop(lr_scaling="none").load_state_dict(state)  # a default said out loud is the same setting


def test_a_resume_without_the_saved_schedule_or_with_a_new_one_is_refused():
    """A loop rebuilt without its lr_scheduler took the state and trained at the optimizer's
    constant LR where the saved run had decayed it to a sixteenth."""

    def loop(scheduled):
        data, model, optimizer, loss_fn = _parts(samples=48)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step) if scheduled else None
        return AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, lr_scheduler=schedule, log=lambda m: None)

    for saved_with, resumed_with, message in (
            (True, False, r"the saved loop stepped an lr_scheduler .* and this AdaptiveBatch has none, so it would "
                          r"train at the optimizer's LR: pass lr_scheduler= built as before"),
            (False, True, r"this AdaptiveBatch has lr_scheduler=LambdaLR and the saved loop had none, so its "
                          r"schedule would start over mid-run")):
        saved = loop(saved_with)
        saved.step(next(iter(saved.batches(0))))
        with pytest.raises(ConfigError, match=message):
            loop(resumed_with).load_state_dict(saved.state_dict())
    saved = loop(True)
    saved.step(next(iter(saved.batches(0))))
    loop(True).load_state_dict(saved.state_dict())  # built as before: taken


def test_the_probe_cache_keys_what_the_step_is_made_of_and_another_model_probes_again(tmp_path):
    """The cache key was the device and the budget alone: a model a quarter of the width read the
    wider model's answer back ("probe cache hit ... no probing") and trained a quarter of what fit."""

    def probed(width, lines):
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
        model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def loss_fn(batch):
            inputs, targets = batch
            return torch.nn.functional.mse_loss(model(inputs), targets)

        adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=1, use_maximum_batch_size=True,
                                 max_memory="8MiB", probe_cache_dir=str(tmp_path / "cache"), max_batch_size=4096,
                                 make_batch=lambda b: (torch.randn(b, 64), torch.randn(b, 1)),
                                 output_dir=str(tmp_path / f"run{width}-{len(lines)}"), log=lines.append)
        return adaptive.batch_size

    first, again, narrow = [], [], []
    wide = probed(1024, first)
    assert probed(1024, again) == wide and any("probe cache hit" in line for line in again)  # the same step
    assert probed(128, narrow) > wide and not any("probe cache hit" in line for line in narrow)


@pytest.mark.parametrize("change, message", [
    ({"clip_grad_norm": -1.0}, r"clip_grad_norm=-1.0 .*positive"),  # flipped every gradient: training climbed the loss
    ({"clip_grad_norm": 0.0}, r"clip_grad_norm=0.0"),
    ({"batch_size": 1000}, r"batch_size=1000 is larger than the dataset's 48 samples: .* at most 48"),
    ({"loss_fn": "mse"}, r"loss_fn='mse'"),
    ({"optimizer": "adam"}, r"optimizer='adam' is not a torch.optim.Optimizer"),
    # each once a TypeError or AttributeError at the first batch, or taken without a word
    ({"batch_sise": 8}, r"unknown argument 'batch_sise': AdaptiveBatch does not read it; did you mean 'batch_size'\?"),
    ({"batch_size": "8"}, r"batch_size='8' must be a positive integer"),
    ({"collate_fn": 42}, r"collate_fn=42 is not a function"),
    ({"count_of": 5}, r"count_of=5 is not a function"),
    ({"make_batch": 42}, r"make_batch=42 is not a function"),
    ({"layout": "dim1"}, r"layout='dim1' is no BatchLayout: pass e.g. layout=BatchLayout\(batch_dim=1\)"),
    ({"shuffle": "no"}, r"shuffle='no' must be true or false"),  # it shuffled
    ({"dataset": []}, r"the dataset has no samples"),  # said "set batch_size to at most 0"
])
def test_the_loops_own_parts_are_checked_when_it_is_built(change, message):
    data, model, optimizer, loss_fn = _parts()
    parts = dict(model=model, optimizer=optimizer, dataset=data, loss_fn=loss_fn, batch_size=4)
    parts.update(change)
    with pytest.raises(ConfigError, match=message):
        AdaptiveBatch(**parts)


def test_a_batch_whose_first_tensor_is_no_row_a_sample_is_one_line_at_its_first_step():
    """An EmbeddingBag's flat indices: the step counted their length as its samples and cut them
    into micro-batches, and the model failed on offsets past its piece of the indices."""
    torch.manual_seed(0)
    bags = [(torch.randint(0, 50, (int(n),)), int(n) % 3) for n in torch.randint(2, 9, (32,))]

    def collate(samples):
        lengths = torch.tensor([len(ids) for ids, _ in samples])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        return torch.cat([ids for ids, _ in samples]), offsets, torch.tensor([label for _, label in samples])

    bag, head = torch.nn.EmbeddingBag(50, 8), torch.nn.Linear(8, 3)
    model = torch.nn.Sequential(bag, head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    adaptive = AdaptiveBatch(model, optimizer, bags, lambda b: torch.nn.functional.cross_entropy(head(bag(b[0], b[1])), b[2]),
                             batch_size=8, collate_fn=collate, log=lambda m: None)
    with pytest.raises(ConfigError, match=r"the step drew 8 samples and the batch's first tensor along batch_dim=0 "
                                          r"has \d+: its tensors are not one row a sample .* collate one row a sample"):
        adaptive.step(next(iter(adaptive.batches(0))))
    # two views a sample (2N rows): cut at the 4 rows that fit, the views of a sample went apart
    data, model, optimizer, loss_fn = _parts()

    def two_views(samples):
        inputs, targets = default_collate(samples)
        return torch.cat([inputs, inputs + 0.1]), torch.cat([targets, targets])

    views = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, collate_fn=two_views, log=lambda m: None)
    with pytest.raises(ConfigError, match=r"the step drew 4 samples and the batch's first tensor along batch_dim=0 "
                                          r"has 8"):
        views.step(next(iter(views.batches(0))))
    plain = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=4, collate_fn=None, log=lambda m: None)
    assert plain.step(next(iter(plain.batches(0)))).global_step == 1  # None is torch's collate, as a DataLoader takes it


def test_a_batch_over_max_batch_size_is_refused_where_no_probe_runs():
    """batch_size=8 with max_batch_size=4 trained 8 a step, over the stated bound; with growth it
    started at 4, said as "the largest batch that fits" where nothing was measured, at half the LR."""
    data, model, optimizer, loss_fn = _parts()
    with pytest.raises(ConfigError, match=r"batch_size=8 is over max_batch_size=4, the bound of the probe and of "
                                          r"growth, neither of which runs: set batch_size to at most 4"):
        AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=8, max_batch_size=4).batch_size
    with pytest.raises(ConfigError, match=r"batch_size=16 x gradient_accumulation_steps=1 is over max_batch_size=4, "
                                          r"the bound of growth: set batch_size to at most 4"):
        AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=16, max_batch_size=4,
                      batch_increase_function=double_every_epoch).batch_size


def test_a_build_goes_to_the_probe_for_trials_in_fresh_processes(monkeypatch):
    """In-process trials under a real limit left a bf16 step's process unable to train what it ran
    (the check walked from 99 to 3): the loop had no way to send them to fresh processes."""
    import adaptive_batch.run.loop as loop

    class Probed(Exception):
        pass

    def probe(options, *, target, build, **kwargs):
        raise Probed(build)

    monkeypatch.setattr(loop, "probe_batch_size", probe)
    data, model, optimizer, loss_fn = _parts()
    adaptive = AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=1, use_maximum_batch_size=True,
                             probe_cache=False, make_batch=lambda b: (torch.randn(b, 8), torch.randn(b, 1)),
                             build=_parts, log=lambda line: None)
    with pytest.raises(Probed) as probed:
        adaptive.batch_size
    assert probed.value.args[0] is _parts
    with pytest.raises(ConfigError, match=r"build='parts' is not a function"):
        AdaptiveBatch(model, optimizer, data, loss_fn, batch_size=1, build="parts")
