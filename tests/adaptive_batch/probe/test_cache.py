import json

import pytest

from adaptive_batch.logs import lines_to
from adaptive_batch.probe.cache import ProbeCache, cache_key, default_cache_dir, library_versions
from adaptive_batch.probe.report import ProbeReport

FIELDS = {"model": {"_component_": "m", "dim": 256}, "dtype": "torch.float32", "budget_bytes": 1000, "seq_len": 256}
REPORT = ProbeReport.from_dict({
    "max_batch_size": 19,
    "batch_size": 19,
    "budget_bytes": 1000,
    "seq_len": 256,
    "trials": [{"batch_size": 19, "fits": True, "peak_bytes": 990}, {"batch_size": 20, "fits": False, "peak_bytes": 1040}],
})


def test_hit_after_store_and_miss_on_any_changed_field(tmp_path):
    cache = ProbeCache(str(tmp_path))
    assert cache.load(FIELDS) is None
    path = cache.store(FIELDS, REPORT)
    assert path.startswith(str(tmp_path)) and cache.load(FIELDS) == REPORT
    assert cache.load({**FIELDS, "budget_bytes": 999}) is None
    assert cache.load({**FIELDS, "model": {"_component_": "m", "dim": 512}}) is None
    assert cache_key(FIELDS) == cache_key(dict(reversed(list(FIELDS.items()))))  # order does not matter


def test_corrupt_and_stale_entries_are_ignored_with_a_warning(tmp_path):
    warnings = []
    with lines_to(warnings.append):
        cache = ProbeCache(str(tmp_path))
        path = cache.store(FIELDS, REPORT)
        with open(path, "w") as f:
            f.write('{"format": 1, "fields": ')  # cut short
        assert cache.load(FIELDS) is None and "unreadable" in warnings[-1]
        # an entry whose fields are not the key's (hand-edited, or a hash collision)
        with open(path, "w") as f:
            json.dump({"format": 1, "fields": {**FIELDS, "seq_len": 4096}, "report": REPORT.to_dict()}, f)
        assert cache.load(FIELDS) is None and "stale" in warnings[-1]
        with open(path, "w") as f:
            json.dump({"format": 1, "fields": FIELDS, "report": {"max_batch_size": "19"}}, f)
        assert cache.load(FIELDS) is None and "invalid" in warnings[-1]
        with open(path, "w") as f:
            json.dump({"format": 0, "fields": FIELDS, "report": REPORT.to_dict()}, f)
        assert cache.load(FIELDS) is None and len(warnings) == 4


def test_versions_and_default_directory(monkeypatch, tmp_path):
    versions = library_versions()
    assert set(versions) == {"torch", "torchtune", "adaptive-batch"} and versions["torchtune"] == "0.6.1"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == str(tmp_path / "adaptive-batch" / "probe")


@pytest.mark.parametrize(
    "poison,reason",
    [
        ({"max_batch_size": 0, "batch_size": 0}, "must be integers of at least 1"),
        ({"max_batch_size": -3, "batch_size": -3}, "must be integers of at least 1"),
        ({"batch_size": True}, "must be integers of at least 1"),
        ({"batch_size": 40}, "larger than max_batch_size"),
        ({"max_batch_size": 500, "batch_size": 500}, "over the cap of 64"),
        ({"budget_bytes": 10**12}, "budget_bytes=1000000000000 differs"),
        ({"seq_len": 8}, "seq_len=8 differs"),
        ({"trials": [{"batch_size": 19, "fits": False}]}, "no fitting trial at max_batch_size=19"),
        ({"trials": "many"}, "no fitting trial"),
        # well-formed, but its fit is over the budget it names: no probe wrote that
        ({"trials": [{"batch_size": 19, "fits": True, "peak_bytes": 60_000}]}, "claims a peak of 60000 bytes against a budget of 1000"),
        ({"trials": [{"batch_size": 19, "fits": True}]}, "claims a peak of None bytes"),
        ({"format": 3}, "written by a newer adaptive-batch"),
    ],
)
def test_a_poisoned_entry_is_never_a_hit(tmp_path, poison, reason):
    warnings = []
    cache = ProbeCache(str(tmp_path))
    fields = {**FIELDS, "batch_size_cap": 64}
    path = cache.store(fields, REPORT)
    with open(path) as f:
        entry = json.load(f)
    entry["report"].update(poison)
    with open(path, "w") as f:
        json.dump(entry, f)
    with lines_to(warnings.append):
        assert cache.load(fields) is None
    assert "ignoring invalid entry" in warnings[-1] and reason in warnings[-1] and "probing again" in warnings[-1]


def test_a_plain_loops_key_is_the_same_for_the_same_step_and_an_lr_sweep_and_differs_with_the_optimizers_state():
    """Nested code (a comprehension) was keyed by its repr, which holds its memory address: each
    process had a key of its own and the cache never hit; an LR sweep probed at each LR."""
    import torch

    from adaptive_batch.probe.cache import step_fields

    def the_same_loop(lr, momentum=0.0):  # built afresh each call, as in a new process
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        source = "def loss_fn(batch):\n    return sum(x.sum() for x in [model(batch)])\n"
        scope = {"model": model}
        exec(compile(source, "loop.py", "exec"), scope)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        return step_fields(model, optimizer, torch.zeros(1, 4), (scope["loss_fn"],))

    assert the_same_loop(0.1) == the_same_loop(0.1) == the_same_loop(0.01)
    assert the_same_loop(0.1, momentum=0.9)["optimizer"] != the_same_loop(0.1)["optimizer"]  # a momentum buffer


def test_a_plain_loops_key_differs_with_a_modules_settings_and_its_forward():
    """A conv net of stride 4 read back the answer of the same net at stride 1 (the same
    parameters): it trained at 39 where 337 fit."""
    import torch

    from adaptive_batch.probe.cache import step_fields

    def net(forward_body):  # the class a user edited between two runs: its name stays
        scope = {"torch": torch}
        exec(compile(f"class Net(torch.nn.Linear):\n    def forward(self, x):\n        return {forward_body}\n",
                     "model.py", "exec"), scope)
        return scope["Net"](4, 4)

    def key(model):
        return step_fields(model, None, torch.zeros(1, 1, 8, 8), ())["model"]

    torch.manual_seed(0)
    assert key(torch.nn.Conv2d(1, 4, 3, stride=1)) == key(torch.nn.Conv2d(1, 4, 3, stride=1))
    assert key(torch.nn.Conv2d(1, 4, 3, stride=4)) != key(torch.nn.Conv2d(1, 4, 3, stride=1))
    assert key(net("super().forward(x)")) == key(net("super().forward(x)"))
    assert key(net("super().forward(torch.cat([x, x]))")) != key(net("super().forward(x)"))
