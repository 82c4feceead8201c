"""find_max_batch_size on a plain nn.Module: in-process under a budget, and in a process under
a real address-space limit, where the batch above the answer really runs out of memory."""

import copy
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from adaptive_batch import ConfigError, find_max_batch_size
from adaptive_batch.logs import lines_to


def parts(width=512):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
        optimizer.step()
        optimizer.zero_grad()

    def make_batch(b):
        return {"x": torch.randn(b, width), "y": torch.randn(b, 1)}

    return model, optimizer, step, make_batch


def test_found_batch_fits_the_next_does_not_and_nothing_changed():
    model, optimizer, step, make_batch = parts()
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    lines = []
    found = find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory="64MiB", log=lines.append)
    assert found > 1 and lines
    # the recipes' probe without the recipe: no line names a recipe key or a report file
    assert not [line for line in lines if "use_maximum_batch_size" in line or "batch_probe.json" in line], lines
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer.state == {} or all(len(s) == 0 for s in optimizer.state.values())
    assert torch.equal(torch.get_rng_state(), rng)
    # a tighter budget gives a smaller answer; the cap is honoured
    assert find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory="32MiB") < found
    assert find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory="64MiB", max_batch_size=3) == 3


def _conv_parts():
    torch.manual_seed(0)

    def block(i, o):
        return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU()]

    model = nn.Sequential(*block(3, 16), *block(16, 32), nn.MaxPool2d(2), *block(32, 64), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters())

    def step(batch):
        nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step, lambda b: {"x": torch.randn(b, 3, 32, 32), "y": torch.randint(0, 10, (b,))}


def _mlp_parts():
    return parts(256)


def _lstm_parts():
    """An LSTM language model: recurrent state, not attention; token batches."""
    torch.manual_seed(0)

    class LSTMModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.lstm, self.out = nn.Embedding(500, 64), nn.LSTM(64, 128, 2, batch_first=True), nn.Linear(128, 500)

        def forward(self, x):
            return self.out(self.lstm(self.embed(x))[0])

    model = LSTMModel()
    optimizer = torch.optim.AdamW(model.parameters())

    def step(x):
        nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step, lambda b: torch.randint(0, 500, (b, 32))


def _gru_tuple_parts():
    """A GRU classifier on (inputs, labels) tuples, SGD with momentum (state made at the first step)."""
    torch.manual_seed(0)
    gru, head = nn.GRU(32, 64, batch_first=True), nn.Linear(64, 10)
    model = nn.ModuleList([gru, head])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(batch):
        x, y = batch
        nn.functional.cross_entropy(head(gru(x)[0][:, -1]), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step, lambda b: (torch.randn(b, 40, 32), torch.randint(0, 10, (b,)))


def _checkpointed_encoder_parts():
    """Encoder layers with dropout under activation checkpointing (recomputed in the backward)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layers = nn.ModuleList([nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True) for _ in range(2)])
    head = nn.Linear(64, 2)
    model = nn.ModuleList([*layers, head])
    optimizer = torch.optim.Adam(model.parameters())

    def step(batch):
        x, y = batch
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False)
        nn.functional.cross_entropy(head(x.mean(1)), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step, lambda b: (torch.randn(b, 48, 64), torch.randint(0, 2, (b,)))


def _batchnorm1d_parts():
    """An MLP whose BatchNorm1d cannot train a batch of 1 (torch refuses it): the search runs from 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.Adam(model.parameters())

    def step(batch):
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,)))


@pytest.mark.parametrize(
    "build,max_memory",
    [(_mlp_parts, "24MiB"), (_conv_parts, "48MiB"), (_lstm_parts, "24MiB"), (_gru_tuple_parts, "16MiB"),
     (_checkpointed_encoder_parts, "16MiB"), (_batchnorm1d_parts, "16MiB")],
    ids=["mlp", "conv-batchnorm", "lstm", "gru-tuple-momentum", "checkpointed-encoder", "batchnorm1d"],
)
def test_a_soft_budget_answer_is_memtrackers_in_a_few_steps(build, max_memory):
    """A soft budget is judged by the step's live tensor bytes, never by the machine guard's
    address space: the answer is torch's MemTracker's on the same step (an MLP at 96 MiB used to
    answer 2 to 747 in fresh processes, a conv net at 120 MiB 12 where its peak was 47%), in at
    most one trial over the budget and 6 real trial steps."""
    sys.path.insert(0, "benchmarks")
    from truth import memtracker_max_batch_size

    from adaptive_batch.memory.device import parse_memory

    model, optimizer, step, make_batch = build()
    lines = []
    found = find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory=max_memory,
                                log=lines.append)
    trials = [line for line in lines if line.startswith("probe trial")]
    assert len(trials) <= 6 and sum("fits" not in line for line in trials) <= 1, trials
    truth = memtracker_max_batch_size(step, make_batch, model=model, optimizer=optimizer,
                                      budget_bytes=int(parse_memory(max_memory) * 0.99), upper=4 * found, smallest=2)
    assert truth * 0.99 <= found <= truth


def test_a_model_that_cannot_train_a_batch_of_one_capped_at_one_or_over_budget_at_two_is_one_line():
    from adaptive_batch import BatchSizeTooLargeError

    model, optimizer, step, make_batch = _batchnorm1d_parts()
    with pytest.raises(ConfigError, match=r"max_batch_size=1, but a batch of 1 does not train .* BatchNorm"):
        find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory="16MiB",
                            max_batch_size=1)
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 10))
    optimizer = torch.optim.Adam(wide.parameters())

    def wide_step(batch):
        nn.functional.cross_entropy(wide(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(BatchSizeTooLargeError, match=r"^batch size 2 does not fit"):  # it said 1, of batch 2's peak
        find_max_batch_size(wide_step, make_batch=lambda b: (torch.randn(b, 256), torch.randint(0, 10, (b,))),
                            model=wide, optimizer=optimizer, max_memory="2MiB")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_memory="lots"), "max_memory='lots' cannot be parsed"),
        (dict(safety_margin=1.5), "safety_margin=1.5 must be a number in [0, 1)"),
        (dict(max_batch_size=0), "max_batch_size=0 must be a positive integer or null"),
        # once an AttributeError after the trials, and a build taken and never used
        (dict(lr_scheduler=42), "lr_scheduler=42 has no state_dict() and load_state_dict() to put it back with"),
        (dict(build=42), "build=42 is not a function"),
        # once the recipes' key (probe_time_budget), a bare TypeError, and a ValueError naming a recipe key
        (dict(time_budget=0), "time_budget=0 must be a positive finite number"),
        (dict(log=42), "log=42 is not a function"),
        (dict(device="meta"), "device='meta': the probe measures memory on 'cpu' and 'cuda' devices only"),
    ],
)
def test_bad_arguments(kwargs, message):
    model, optimizer, step, make_batch = parts(8)
    with pytest.raises(ConfigError) as info:
        find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, **kwargs)
    assert message in str(info.value)


SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from torch import nn
    from adaptive_batch import find_max_batch_size, is_oom_error
    from adaptive_batch.memory.device import proc_status_bytes

    torch.manual_seed(0)
    width = 1024
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters())

    def step(batch):
        nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
        optimizer.step()
        optimizer.zero_grad()

    def make_batch(b):
        return {"x": torch.randn(b, width), "y": torch.randn(b, 1)}

    step(make_batch(1))  # the optimizer state exists before the limit, as in a running loop
    resource.setrlimit(resource.RLIMIT_AS, (proc_status_bytes("VmSize") + int(sys.argv[1]), resource.RLIM_INFINITY))
    checksum = sum(float(p.sum()) for p in model.parameters())
    # A margin for glibc's heap under the limit. Each activation here is ~10% of the headroom,
    # and which step fails is chaotic: in fresh processes batch 3000 trained 30 steps in 2 runs
    # of 4 and failed at step 3 and 9 in the others, 2800 failed once at step 16; with a 20%
    # margin 1 run in 12 handed back a batch that failed the next step here (issue 26).
    found = find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory=None,
                                safety_margin=0.4)
    unchanged = checksum == sum(float(p.sum()) for p in model.parameters())
    for _ in range(3):
        step(make_batch(found))  # trains
    over = 4 * found  # past the chaos: 4500 ran 14 steps once in a fresh process
    try:
        step(make_batch(over))
        over_fails = False
    except Exception as e:
        over_fails = is_oom_error(e)
    print(json.dumps({"found": found, "unchanged": unchanged, "over_fails": over_fails}))
    """
)


@pytest.mark.slow
def test_under_a_real_process_limit(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(160 * 2**20)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["found"] > 1 and result["unchanged"] and result["over_fails"], result


# A step whose memory jumps past the line: batch 7 and up allocates 3 GiB at once (touched).
# The "machine" is a MemAvailable of 2 GiB (1 GiB budget after the reserve) with no limit
# set: without the probe's own RLIMIT_AS the trial at the line's prediction would take 3 GiB.
OVERSHOOT_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from torch import nn
    import adaptive_batch.memory.device as memory
    from adaptive_batch import find_max_batch_size

    memory._meminfo_bytes = lambda field: {"MemAvailable": 2 * 2**30, "MemTotal": 4 * 2**30}[field]
    memory._cgroup_headroom = lambda: None
    assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())

    def step(batch):
        b = batch.shape[0]
        extra = torch.ones(3 * 2**30 // 4 if b >= 7 else b * 10 * 2**20 // 4)
        model(batch).sum().mul(extra.sum() * 0).backward()
        optimizer.step()
        optimizer.zero_grad()

    lines = []
    found = find_max_batch_size(step, make_batch=lambda b: torch.randn(b, 64), model=model,
                                optimizer=optimizer, max_memory=None, log=lines.append)
    hwm = memory.proc_status_bytes("VmHWM")
    limit_after = resource.getrlimit(resource.RLIMIT_AS)[0]
    print(json.dumps({"found": found, "peak_rss": hwm, "lines": lines,
                      "lifted": limit_after == resource.RLIM_INFINITY}))
    """
)


def test_an_overshooting_trial_fails_to_allocate_under_the_probes_own_limit(tmp_path):
    script = tmp_path / "overshoot.py"
    script.write_text(OVERSHOOT_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["found"] == 6, result
    assert any("soft RLIMIT_AS" in line for line in result["lines"]), result["lines"]
    assert any("out of memory" in line for line in result["lines"]), result["lines"]
    # The 3 GiB trial never got its memory, and the limit is gone after probing.
    assert result["peak_rss"] < 2 * 2**30, result
    assert result["lifted"]


def test_under_a_soft_budget_the_library_sets_no_allocator_option(monkeypatch):
    """A fixed M_MMAP_THRESHOLD cannot be undone (it turns glibc's dynamic threshold off for
    the process), and a batch found with it fails in the caller's plain process: under a soft
    budget (judged by tensor bytes) the library calls no mallopt. Under a hard one it does and
    says so (test_child.py), since the caller trains on the answer under that limit."""
    import adaptive_batch.memory.device as device

    monkeypatch.setattr(device, "_mmap_threshold_set", None)  # glibc's defaults, whatever ran here before
    opened = []
    real = device._glibc  # every mallopt goes through it
    monkeypatch.setattr(device, "_glibc", lambda: opened.append("libc") or real())
    model, optimizer, step, make_batch = parts(64)
    assert find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory="16MiB") > 1
    assert opened == []


def test_the_recipes_allocator_settings_are_said_in_one_line(monkeypatch):
    import adaptive_batch.memory.device as device

    monkeypatch.setattr(device, "return_freed_memory_to_os", lambda: True)
    lines = []
    with lines_to(lines.append):
        device.prepare_allocator(torch.device("cpu"), probing=True)
    assert len(lines) == 1 and "glibc M_MMAP_THRESHOLD=256KiB and M_ARENA_MAX=1 for this run" in lines[0]


def _never_called_build():
    raise AssertionError("a soft budget's trials run in this process")


def test_a_build_the_budget_does_not_use_is_said_in_one_line(monkeypatch):
    """The trials stay in this process without an address-space limit, and under one with a
    soft budget (a size): the build is not called, and the user who passed it is told why and
    what would run the trials in fresh processes."""
    from adaptive_batch.memory.device import ADDRESS_SPACE_SOURCE, DeviceCapacity
    from adaptive_batch.probe import service

    model, optimizer, step, make_batch = parts(64)

    def said(max_memory):
        lines = []
        find_max_batch_size(step, make_batch=make_batch, model=model, optimizer=optimizer, max_memory=max_memory,
                            max_batch_size=4, log=lines.append, build=_never_called_build)
        (line,) = [line for line in lines if "build=" in line]
        return line

    machine = DeviceCapacity(device="cpu", headroom_bytes=2**34, source="MemAvailable less a reserve", hard_limit=False)
    monkeypatch.setattr(service, "device_capacity", lambda device: machine)
    assert said("90%").startswith("probe: build= is not used: fresh processes are for an address-space limit")
    limit = DeviceCapacity(device="cpu", headroom_bytes=2**34, source=ADDRESS_SPACE_SOURCE, hard_limit=True)
    monkeypatch.setattr(service, "device_capacity", lambda device: limit)
    line = said("16MiB")
    assert line.startswith("probe: build= is not used: a soft budget") and "max_memory=None" in line


@pytest.mark.parametrize("build, second", [(None, 15.0), (lambda: None, 60.0)])
def test_the_search_from_2_has_what_the_first_search_left_of_the_time_budget(monkeypatch, build, second):
    """The search run again from 2 once had a whole time budget of its own: twice the budget in all.
    With build= the budget is also each trial process's time before it is called hung: kept whole."""
    from adaptive_batch.probe import api

    clock, budgets = [100.0], []

    def search(*args, time_budget, **kwargs):
        budgets.append(time_budget)
        if len(budgets) == 1:
            clock[0] += 45.0  # the first search ran 45 s before batch 1 failed
            raise ValueError("Expected more than 1 value per channel when training, got input size [1, 8]")
        return 6

    monkeypatch.setattr(api, "_search", search)
    monkeypatch.setattr(api.time, "perf_counter", lambda: clock[0])
    model = nn.Linear(2, 2)
    assert api.find_max_batch_size(lambda b: None, make_batch=lambda b: torch.zeros(b, 2), model=model,
                                   time_budget=60.0, build=build) == 7
    assert budgets == [60.0, second]


def test_a_step_that_steps_an_optimizer_over_parameters_the_probe_was_not_given_is_refused_before_it_steps():
    """A GAN's step (a generator's and a discriminator's optimizer) probed with the generator and
    its optimizer: the discriminator and its optimizer came out 10 steps on, without a word. An
    optimizer over the model's own parameters (a Lookahead's inner one, the discriminator's where
    both are the model) still steps, and its state comes back."""
    torch.manual_seed(0)
    generator, discriminator = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_g, opt_d = torch.optim.Adam(generator.parameters()), torch.optim.Adam(discriminator.parameters())

    def gan_step(noise):
        discriminator(generator(noise).detach()).mean().backward()
        opt_d.step()
        opt_d.zero_grad()
        (-discriminator(generator(noise)).mean()).backward()
        opt_g.step()
        opt_g.zero_grad()

    before = [p.clone() for p in discriminator.parameters()]
    with pytest.raises(ConfigError, match=r"train_step steps Adam over 2 parameters that are not model=Linear's"):
        find_max_batch_size(gan_step, make_batch=lambda b: torch.randn(b, 8), model=generator, optimizer=opt_g,
                            max_memory="16MiB", max_batch_size=64)
    assert not opt_d.state and all(torch.equal(a, b) for a, b in zip(before, discriminator.parameters()))

    inner = torch.optim.SGD(generator.parameters(), lr=0.1)  # stepped by the optimizer passed, as a Lookahead does

    class Lookahead(torch.optim.Optimizer):
        def __init__(self):
            super().__init__(generator.parameters(), {})

        def step(self, closure=None):
            inner.step()

    outer = Lookahead()

    def step(noise):
        generator(noise).square().mean().backward()
        outer.step()
        outer.zero_grad()

    assert find_max_batch_size(step, make_batch=lambda b: torch.randn(b, 8), model=generator, optimizer=outer,
                               max_memory="16MiB", max_batch_size=64) == 64

    # Both in the model, the discriminator's own optimizer beside the one passed: it steps, and
    # its state comes back (its Adam came out 8 steps on, its moments changed, without a word).
    gan_step(torch.randn(4, 8))  # a step of training before the probe
    saved = copy.deepcopy(opt_d.state_dict())
    both = nn.ModuleDict({"G": generator, "D": discriminator})
    assert find_max_batch_size(gan_step, make_batch=lambda b: torch.randn(b, 8), model=both, optimizer=opt_g,
                               max_memory="16MiB", max_batch_size=64) == 64
    state = opt_d.state_dict()["state"]
    assert [s["step"].item() for s in state.values()] == [1.0, 1.0]
    for key, value in saved["state"].items():
        assert all(torch.equal(value[k], state[key][k]) for k in ("exp_avg", "exp_avg_sq")), key
    opt_d.param_groups[0]["lr"] = np.float64(1e-3)  # state torch.load(weights_only=True) refuses
    find_max_batch_size(gan_step, make_batch=lambda b: torch.randn(b, 8), model=both, optimizer=opt_g,
                        max_memory="16MiB", max_batch_size=8)
    assert opt_d.param_groups[0]["lr"] == 1e-3


def test_a_batch_maker_that_stops_growing_is_named_in_one_line():
    """``data[:b]`` past 100 samples: the search ran 64 trials of the same batch and answered a
    "largest fit" of 2**60."""
    data = torch.randn(100, 8)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(ConfigError, match=r"make_batch: make_batch\(\d+\) and make_batch\(\d+\) built tensors of the "
                                          r"same shapes \(\[\(100, 8\)\]\)"):
        find_max_batch_size(step, make_batch=lambda b: data[:b], model=model, optimizer=optimizer, max_memory="64MiB")


def test_a_batch_in_a_user_dict_counts_its_tensors_as_a_dicts_do():
    """Transformers' BatchEncoding and BatchFeature are UserDicts, one leaf to torch's pytree: the
    trials left the batch's tensors out of the peak (the images of a vision processor's batch), and
    the Trainer's hint said its inputs were 0 B."""
    from collections import UserDict

    class Features(UserDict):
        pass

    model = nn.Linear(64, 1)

    def step(batch):
        model(batch["pixels"].mean(dim=1)).sum().backward()
        model.zero_grad()

    def answer(kind):
        return find_max_batch_size(step, make_batch=lambda b: kind(pixels=torch.randn(b, 64, 64)), model=model,
                                   max_memory="4MiB", max_batch_size=1024)

    assert answer(Features) == answer(dict) < 1024
