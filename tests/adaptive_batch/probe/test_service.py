"""ProbeOptions check themselves; probe_batch_size finds, caches and reports on a real model."""

import json
import math

import pytest
import torch
from torch import nn

from adaptive_batch import BatchSizeTooLargeError, ConfigError, ProbeOptions, probe_batch_size
from adaptive_batch.probe.search import FirstGuess, GuessRecord
from adaptive_batch.probe.target import ProbeTarget


def test_defaults_are_the_documented_ones():
    opts = ProbeOptions()
    assert (opts.use_maximum_batch_size, opts.max_memory, opts.batch_size_rounding) == (False, None, "none")
    assert (opts.batch_size_objective, opts.throughput_tolerance, opts.probe_cache, opts.plot) == ("max_fit", 0.02, True, False)
    assert opts.memory_safety_margin is None  # the device's and the limit's default (test_budget)


def test_max_memory_in_bytes():
    assert ProbeOptions(max_memory="1GiB").max_memory_bytes(8 * 2**30) == 2**30
    assert ProbeOptions(max_memory=0.5).max_memory_bytes(8 * 2**30) == 4 * 2**30
    assert ProbeOptions(max_memory="25%").max_memory_bytes(8 * 2**30) == 2 * 2**30
    assert ProbeOptions().max_memory_bytes(8 * 2**30) is None
    with pytest.raises(ConfigError, match="larger than the device"):
        ProbeOptions(max_memory="64GiB").max_memory_bytes(8 * 2**30)
    with pytest.raises(ConfigError, match="capacity is unknown"):
        ProbeOptions(max_memory="50%").max_memory_bytes(None)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("use_maximum_batch_size", "yes", "use_maximum_batch_size='yes' must be true or false"),
        ("use_maximum_batch_size", 1, "use_maximum_batch_size=1 must be true or false"),
        ("max_memory", "lots", "max_memory='lots' cannot be parsed"),
        ("max_memory", 0, "max_memory=0 must be greater than zero"),
        ("max_memory", "-1GiB", "max_memory='-1GiB' must be greater than zero"),
        ("memory_safety_margin", 1.0, "memory_safety_margin=1.0 must be a number in"),
        ("memory_safety_margin", -0.1, "memory_safety_margin=-0.1"),
        ("batch_size_rounding", "nearest", "batch_size_rounding='nearest' is not one of"),
        ("max_batch_size", 0, "max_batch_size=0 must be a positive integer or null"),
        ("batch_size_objective", "fastest", "batch_size_objective='fastest' is not one of"),
        ("throughput_tolerance", 1.0, "throughput_tolerance=1.0 must be a number in [0, 1)"),
        ("throughput_tolerance", "2%", "throughput_tolerance='2%' must be a number"),
        ("probe_cache", "no", "probe_cache='no' must be true or false"),
        ("probe_first_guess", "yes", "probe_first_guess='yes' must be true or false"),
        ("probe_cache_dir", 5, "probe_cache_dir=5 must be a directory path or null"),
        ("plot", "yes", "plot='yes' must be true or false"),
        ("probe_time_budget", 0, "probe_time_budget=0 must be a positive finite number: seconds, e.g. 600 (the default), or null for no limit."),
        ("probe_time_budget", "10m", "probe_time_budget='10m' must be a positive finite number: seconds, e.g. 600"),
        ("probe_time_budget", True, "probe_time_budget=True must be a positive finite number"),
        ("probe_time_budget", float("nan"), "probe_time_budget=nan must be a positive finite number"),
    ],
)
def test_bad_values(key, value, message):
    with pytest.raises(ConfigError) as info:
        ProbeOptions(**{key: value})
    assert message in str(info.value)


def _mlp_parts(width=256):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters())

    def step(batch):
        nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
        optimizer.step()
        optimizer.zero_grad()

    def make_batch(b):
        return {"x": torch.ones(b, width), "y": torch.zeros(b, 1)}

    return ProbeTarget(step, make_batch, model, optimizer, torch.device("cpu"))


def test_probe_finds_caches_and_reports(tmp_path):
    target = _mlp_parts()
    # Parameters and Adam state ~1.5 MiB; 1 KiB of input a sample plus activations.
    opts = ProbeOptions(use_maximum_batch_size=True, max_memory=4 * 2**20, probe_cache_dir=str(tmp_path / "cache"))
    common = dict(seq_len=256, dataset_size=10_000, output_dir=str(tmp_path / "out"),
                  cache_fields={"model": "mlp"}, log=lambda line: None)
    report = probe_batch_size(opts, target, **common)
    assert report.cache.hit is False
    on_disk = json.loads((tmp_path / "out" / "batch_probe.json").read_text())
    assert on_disk["batch_size"] == report.batch_size == report.max_batch_size > 1
    fits = {t.batch_size: t.fits for t in report.trials}
    assert fits[report.max_batch_size] and fits[report.max_batch_size + 1] is False
    assert report.world_size == 1 and report.ranks[0]["budget_bytes"] == report.budget.budget_bytes
    again = probe_batch_size(opts, _mlp_parts(), **common)
    assert again.cache.hit is True and again.batch_size == report.batch_size


def test_what_the_run_holds_beside_its_state_is_counted_and_keyed(tmp_path):
    """A noise scale's copy of the gradients lives through every step: under a soft budget it was
    no trial's tensor and no state's, and training at the answer passed max_memory by it."""
    opts = ProbeOptions(use_maximum_batch_size=True, max_memory=4 * 2**20, probe_cache_dir=str(tmp_path / "cache"))
    common = dict(seq_len=256, dataset_size=10_000, cache_fields={"model": "mlp"}, log=lambda line: None)
    plain = probe_batch_size(opts, _mlp_parts(), **common)
    copy = torch.zeros(2**18)  # 1 MiB held through the run
    held = probe_batch_size(opts, _mlp_parts(), held=(copy,), trial_fields={"measure_noise_scale": True}, **common)
    assert held.cache.hit is False  # another key: the plain answer is not this run's
    assert held.max_batch_size < plain.max_batch_size
    for report in (plain, held):  # each answer's trial fits its own budget, with what it holds
        fit = next(t for t in report.trials if t.batch_size == report.max_batch_size and t.fits)
        assert fit.peak_bytes <= report.budget.budget_bytes
    first, again = plain.trials[0], held.trials[0]  # the warmup, at the same size: the copy counted in its peak
    assert first.batch_size == again.batch_size and again.peak_bytes >= first.peak_bytes + copy.nbytes


def test_a_search_stopped_by_its_time_budget_says_so_and_is_not_cached(tmp_path):
    opts = ProbeOptions(use_maximum_batch_size=True, max_memory=4 * 2**20, probe_cache_dir=str(tmp_path / "cache"),
                        probe_time_budget=1e-9)
    lines = []
    report = probe_batch_size(opts, _mlp_parts(), seq_len=256, dataset_size=10_000,
                              output_dir=str(tmp_path / "out"), log=lines.append)
    assert report.stopped_by_time and report.batch_size == 2  # the estimate steps ran; no search trial
    assert any(line.startswith("probe: stopped at batch 2") for line in lines)
    assert report.cache is None and not list((tmp_path / "cache").glob("**/*.json"))


def test_rounding_and_cap(tmp_path):
    common = dict(seq_len=1, output_dir=str(tmp_path), log=lambda line: None)
    opts = ProbeOptions(max_memory=4 * 2**20, probe_cache=False, batch_size_rounding="power_of_two")
    report = probe_batch_size(opts, _mlp_parts(), dataset_size=10_000, **common)
    assert report.batch_size & (report.batch_size - 1) == 0 and report.batch_size <= report.max_batch_size
    capped = probe_batch_size(ProbeOptions(max_memory=4 * 2**20, probe_cache=False, max_batch_size=3),
                              _mlp_parts(), dataset_size=10_000, **common)
    assert capped.batch_size == 3 and capped.batch_size_cap == 3


def test_batch_one_too_large(tmp_path):
    with pytest.raises(BatchSizeTooLargeError):
        probe_batch_size(ProbeOptions(max_memory=2**20, probe_cache=False), _mlp_parts(),
                         seq_len=1, dataset_size=8, output_dir=str(tmp_path), log=lambda line: None)


def test_a_cache_entry_that_does_not_train_is_not_trusted(tmp_path):
    """A well-formed entry that claims far more than fits (another machine's, a hand edit) is
    checked by real steps at its size first, and the probe runs again when they fail."""
    opts = ProbeOptions(use_maximum_batch_size=True, max_memory=4 * 2**20, probe_cache_dir=str(tmp_path / "cache"))
    lines = []
    common = dict(seq_len=256, dataset_size=10**6, output_dir=str(tmp_path / "out"),
                  cache_fields={"model": "mlp"}, log=lines.append)
    report = probe_batch_size(opts, _mlp_parts(), **common)
    path = report.cache.path
    entry = json.loads(open(path).read())
    found = report.batch_size
    claim = 50 * found  # well formed (a fitting trial at its size), far too large
    entry["report"].update(batch_size=claim, max_batch_size=claim, verified_batch_size=claim)
    # it even claims a peak within the budget; only real steps can tell
    entry["report"]["trials"].append({"batch_size": claim, "fits": True, "peak_bytes": report.budget_bytes - 1})
    with open(path, "w") as f:
        json.dump(entry, f)
    target = _mlp_parts()
    step = target.train_step

    def step_with_a_limit(batch):  # what does not fit here runs out of memory, as on a card
        if batch["x"].shape[0] > 2 * found:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        step(batch)

    target.train_step = step_with_a_limit
    again = probe_batch_size(opts, target, **common)
    assert again.cache.hit is False and again.batch_size <= 2 * found  # probed again, never the claim
    assert any(f"probe cache's batch_size={claim} did not train here; probing again" in line for line in lines)


def test_an_answer_from_fresh_processes_is_checked_in_the_probing_process(monkeypatch, tmp_path):
    """A LoRA answer ran 3 steps in a child with 2 MiB to spare and ran out of memory in the
    caller's training: the caller holds what a fresh process has not. The check runs it here too."""
    from adaptive_batch.distributed import RankGroup
    from adaptive_batch.memory.budget import memory_budget
    from adaptive_batch.memory.device import ADDRESS_SPACE_SOURCE, DeviceCapacity
    from adaptive_batch.probe import service
    from adaptive_batch.probe.search import SearchResult

    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ran = []

    def step(batch):
        ran.append(batch.shape[0])
        if batch.shape[0] >= 20:  # what this process cannot hold, as the allocator says it
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 7802880 bytes. Error code 12 (Cannot allocate memory)")
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    target = ProbeTarget(step, lambda b: torch.randn(b, 4), model, optimizer, torch.device("cpu"))
    capacity = DeviceCapacity(device="cpu", headroom_bytes=2**30, source=ADDRESS_SPACE_SOURCE, hard_limit=True)
    budget = memory_budget(max_memory_bytes=None, capacity=capacity, live_bytes=0, fresh_process_trials=True)
    children = SearchResult(max_batch_size=20, budget_bytes=budget.budget_bytes, estimate=None, predicted_max_batch_size=None)
    monkeypatch.setattr(service, "search_in_children", lambda *a, **k: children)
    report = service.search_and_check(
        ProbeOptions(use_maximum_batch_size=True), target, budget, capacity, service.TrialLimits(None, 0),
        rank_budgets=[budget.budget_bytes], cap=None, seq_len=None, ranks=RankGroup.alone(), snapshot_dir=str(tmp_path),
        build=lambda: target,
    )
    assert report.trials_in_fresh_processes and report.max_batch_size == 20
    assert report.batch_size == report.verified_batch_size == 19 and 20 in ran


def test_a_share_of_an_address_space_limit_sends_the_trials_to_fresh_processes(monkeypatch):
    """find_max_batch_size's default of "90%" under an outside RLIMIT_AS kept the trials here,
    judged in tensor bytes, its build= unused; the budget is now the limit's, less the rest."""
    from adaptive_batch.memory.device import ADDRESS_SPACE_SOURCE, DeviceCapacity
    from adaptive_batch.probe import service

    capacity = DeviceCapacity(device="cpu", headroom_bytes=2**30, source=ADDRESS_SPACE_SOURCE, hard_limit=True)
    monkeypatch.setattr(service, "device_capacity", lambda device: capacity)
    model = nn.Linear(4, 1)
    target = ProbeTarget(lambda b: None, lambda b: torch.randn(b, 4), model, None, torch.device("cpu"))
    budget, _, in_children = service.step_budget(ProbeOptions(max_memory="90%"), target, build=lambda: target)
    assert in_children and not budget.is_soft and (budget.source, budget.share) == ("max_memory", 0.9)
    # the rest of the limit held back, with the 0.3% margin of trials in fresh processes
    assert budget.budget_bytes == int((2**30 + 20) * 0.9 * 0.997)  # (the parameters' 20 bytes count)
    budget, _, in_children = service.step_budget(ProbeOptions(max_memory="512MiB"), target, build=lambda: target)
    assert budget.is_soft and not in_children


def test_a_first_guess_starts_the_search_the_report_says_so_and_gives_the_probes_share_of_an_epoch(tmp_path):
    """A guess that is the answer: warmup, the guess, its neighbour; the same answer as without,
    the guess's seconds counted, and the probe's seconds as a share of one epoch at the batch."""
    opts = ProbeOptions(use_maximum_batch_size=True, max_memory=4 * 2**20, probe_cache=False)
    common = dict(seq_len=256, dataset_size=10_000, output_dir=str(tmp_path), log=lambda line: None)
    plain = probe_batch_size(opts, _mlp_parts(), **common)
    asked = []

    def guess(budget_bytes, cap):
        asked.append((budget_bytes, cap))
        return FirstGuess(plain.max_batch_size, None, seconds=0.25, source="a test")

    lines = []
    guided = probe_batch_size(opts, _mlp_parts(), first_guess=guess, **dict(common, log=lines.append))
    assert asked == [(plain.budget_bytes, 10_000)]
    assert guided.batch_size == plain.batch_size and [t.batch_size for t in guided.trials] == [
        1, plain.max_batch_size, plain.max_batch_size + 1]
    assert guided.first_guess == GuessRecord(plain.max_batch_size, 0.25, "a test", held=True)
    assert guided.total_seconds >= 0.25
    assert "first guess from a test predicted" in guided.describe()
    assert any(line.startswith(f"probe: first guess batch_size={plain.max_batch_size} from a test") for line in lines)
    step = next(t.seconds for t in guided.trials if t.batch_size == guided.max_batch_size)
    assert guided.epoch_share == pytest.approx(guided.total_seconds / (math.ceil(10_000 / guided.max_batch_size) * step))
    on_disk = json.loads((tmp_path / "batch_probe.json").read_text())
    assert on_disk["first_guess"]["batch_size"] == plain.max_batch_size and on_disk["epoch_share"] == guided.epoch_share


def test_no_first_guess_where_it_counts_another_unit_or_fails(tmp_path, monkeypatch):
    """A hard CPU limit counts address space: the guess is not asked. A guess that raises is
    said in one line and the search measures its own line: the same answer."""
    from adaptive_batch.probe import service

    target = _mlp_parts()
    hard = service.MemoryBudget(budget_bytes=4 * 2**20, limit_bytes=4 * 2**20, safety_margin=0.0, source="test", kind="hard")
    alone = service.RankGroup.alone()
    asked = []
    assert service._guess_where_units_match(lambda b, c: asked.append(b), ProbeOptions(), hard, target, alone, 2**20,
                                            None) is None
    assert asked == []
    off = ProbeOptions(use_maximum_batch_size=True, max_memory=4 * 2**20, probe_cache=False, probe_first_guess=False)
    report = probe_batch_size(off, target, seq_len=256, output_dir=str(tmp_path), log=lambda line: None,
                              first_guess=lambda b, c: asked.append(b))
    assert asked == [] and report.first_guess is None

    def broken(budget_bytes, cap):
        raise NotImplementedError("aten::an_op has no fake implementation")

    opts = ProbeOptions(use_maximum_batch_size=True, max_memory=4 * 2**20, probe_cache=False)
    lines = []
    report = probe_batch_size(opts, target, seq_len=256, output_dir=str(tmp_path), first_guess=broken,
                              log=lines.append)
    assert report.first_guess is None and any(t.phase == "estimate" for t in report.trials)
    assert any("no first guess (NotImplementedError: aten::an_op has no fake implementation)" in line for line in lines)


def test_a_max_memory_of_the_whole_share_a_card_gives_the_process_is_not_refused(monkeypatch):
    """On a card held to 2 GiB (a memory fraction) with the model on it, max_memory=2GiB was
    refused as "larger than the device can hold (1.85 GiB)": the headroom left out what the
    process already held."""
    from adaptive_batch.memory.device import DeviceCapacity
    from adaptive_batch.probe import service

    held = 150 * 2**20
    capacity = DeviceCapacity(device="cuda:0", headroom_bytes=2**31 - held, source="set_per_process_memory_fraction",
                              hard_limit=True, held_bytes=held)
    monkeypatch.setattr(service, "device_capacity", lambda device: capacity)
    target = ProbeTarget(lambda b: None, lambda b: torch.randn(b, 4), nn.Linear(4, 1), None, torch.device("cpu"))
    budget, _, _ = service.step_budget(ProbeOptions(max_memory="2GiB", memory_safety_margin=0.0), target)
    assert budget.limit_bytes <= 2**31
    with pytest.raises(ConfigError, match="larger than the device can hold"):
        service.step_budget(ProbeOptions(max_memory="3GiB"), target)


@pytest.mark.parametrize("max_memory, settings", [(None, True), (4 * 2**20, False)])
def test_a_hard_cpu_budget_probes_on_the_allocator_settings_whoever_called(tmp_path, monkeypatch, max_memory, settings):
    """The run decides its allocator when it sets up, from max_memory and the machine's headroom
    then; a budget that is hard by the time the probe reads it (the whole machine, or a size the
    loaded model left over the headroom) gets the settings a hard budget's trials need."""
    import adaptive_batch.memory.device as device

    class FakeLibc:
        calls = []

        def mallopt(self, option, value):
            self.calls.append((option, value))
            return 1

    libc = FakeLibc()
    monkeypatch.setattr(device, "_glibc", lambda: libc)
    monkeypatch.setattr(device, "_mmap_threshold_set", None)
    lines = []
    opts = ProbeOptions(use_maximum_batch_size=True, max_memory=max_memory, max_batch_size=2, probe_cache=False)
    report = probe_batch_size(opts, _mlp_parts(), seq_len=256, dataset_size=10_000, output_dir=str(tmp_path),
                              log=lines.append)
    assert report.budget.is_soft is not settings and report.batch_size == 2
    assert (libc.calls[:2] == [(-3, 256 * 1024), (-8, 1)]) is settings and (libc.calls == []) is not settings
    assert any(line.startswith("CPU allocator: glibc M_MMAP_THRESHOLD") for line in lines) is settings
