"""The probe's answer runs consecutive steps as training will, and steps down until it does."""

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch

from adaptive_batch.logs import lines_to
from adaptive_batch.probe import verify
from adaptive_batch.probe.target import ProbeTarget
from adaptive_batch.probe.verify import cuda_memory_cap, largest_that_trains, runs_consecutive_steps

OOM = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"


def _parts(second_step_fails_above: int):
    """A model whose step at a size above the threshold fits once and fails the next time, as
    on the card (reserved memory creeping) and on CPU (glibc's kept heap)."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes, kept = [], []

    def step(batch):
        sizes.append(batch.shape[0])
        kept.append(batch.shape[0])
        if batch.shape[0] > second_step_fails_above and len(kept) > 1:
            raise RuntimeError(OOM)
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def make_batch(b):
        if sizes and sizes[-1] != b:
            kept.clear()  # a new check starts afresh
        return torch.randn(b, 4)

    return model, sizes, ProbeTarget(step, make_batch, model, optimizer, torch.device("cpu"))


def test_steps_down_then_back_up_to_the_largest_that_trains(monkeypatch):
    model, sizes, target = _parts(second_step_fails_above=90)
    target.device = torch.device("cuda", 0)  # bisects back up there; nothing here touches CUDA
    monkeypatch.setattr(verify, "cuda_memory_cap", lambda device, limit: contextlib.nullcontext())
    monkeypatch.setattr(verify, "release_memory", lambda device, **kwargs: None)
    before = [p.detach().clone() for p in model.parameters()]
    lines = []
    with lines_to(lines.append):
        assert largest_that_trains(100, target) == 90
    steps = verify.VERIFY_STEPS["cuda"]
    # 2% at a time until one passes, then 91 (between 90 and 92) fails its second step.
    assert sizes == [100, 100, 98, 98, 96, 96, 94, 94, 92, 92] + [90] * steps + [91, 91]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # put back after every check
    assert f"probe: batch 100 did not run {steps} consecutive steps within the budget" in lines[0]
    assert lines[-1] == f"probe: the answer is 90, which runs {steps} consecutive steps; 91 did not."


def test_an_answer_the_check_takes_far_below_the_searchs_is_said_with_the_fix():
    """After the search's out-of-memory trials scarred the heap (bf16 under a real limit), every
    size failed its check down to 3, and the run trained at 3 without a word."""
    _, sizes, target = _parts(second_step_fails_above=3)
    lines = []
    with lines_to(lines.append):
        assert largest_that_trains(12, target) == 3
    assert "the answer's check fell from the search's 12 to 3" in lines[-1] and "build=f" in lines[-1]
    _, sizes, target = _parts(second_step_fails_above=7)
    with lines_to(lines.append):
        assert largest_that_trains(12, target) == 7  # above half of it: no warning
    assert "fell" not in lines[-1]


def test_on_cuda_each_check_starts_and_ends_with_cublas_workspaces_freed(monkeypatch):
    """Kept from the probe's first trial, cuBLAS's workspaces gave the check a layout a fresh
    process's training never has: on an H200 the tiny model's 87 passed the check and failed at
    step 2 in a fresh process. The check must begin as training's first step does."""
    _, sizes, target = _parts(second_step_fails_above=1000)
    target.device = torch.device("cuda", 0)
    monkeypatch.setattr(verify, "cuda_memory_cap", lambda device, limit: contextlib.nullcontext())
    events = []
    monkeypatch.setattr(verify, "release_memory", lambda device, **kwargs: events.append(("release", kwargs)))
    step = target.train_step
    target.train_step = lambda batch: (events.append(("step", {})), step(batch))
    assert runs_consecutive_steps(8, target)
    steps = verify.VERIFY_STEPS["cuda"]
    freed = ("release", {"cublas_workspaces": True})
    assert events == [freed] + [("step", {})] * steps + [freed]


def test_on_cpu_only_steps_down():
    """glibc's heap moves between runs by more than a size's step: a size bisected up to on CPU
    failed the caller's next step (test_under_a_real_process_limit, 2 of 3 runs under load)."""
    _, sizes, target = _parts(second_step_fails_above=97)
    assert largest_that_trains(100, target) == 96
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [100, 98, 96]


def test_bisects_between_a_passing_and_a_failing_size_on_cuda(monkeypatch):
    _, sizes, target = _parts(second_step_fails_above=97)
    target.device = torch.device("cuda", 0)
    monkeypatch.setattr(verify, "cuda_memory_cap", lambda device, limit: contextlib.nullcontext())
    monkeypatch.setattr(verify, "release_memory", lambda device, **kwargs: None)
    assert largest_that_trains(100, target) == 97
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [100, 98, 96, 97]


def test_an_answer_that_trains_costs_one_check():
    _, sizes, target = _parts(second_step_fails_above=1000)
    assert largest_that_trains(100, target) == 100
    assert sizes == [100] * verify.VERIFY_STEPS["cpu"]


def test_another_ranks_failure_fails_every_rank():
    """The ranks agree (``RankGroup.any``): a size that fails on one fails on all."""
    _, _, target = _parts(second_step_fails_above=1000)
    lines = []
    with lines_to(lines.append):
        assert not runs_consecutive_steps(8, target, agree=lambda failed: True)
    assert "(another rank)" in lines[0]
    assert largest_that_trains(8, target, agree=lambda failed: True) == 1


def test_other_errors_propagate():
    _, _, target = _parts(second_step_fails_above=1000)
    target.train_step = lambda batch: 1 / 0
    with pytest.raises(ZeroDivisionError):
        runs_consecutive_steps(4, target)


def test_cuda_checks_are_held_to_the_budget_and_the_fraction_put_back(monkeypatch):
    """On the card the reserved memory counts: the steps run under set_per_process_memory_fraction
    at the budget, and whatever fraction was set before is back afterwards, also after a failure."""
    calls = []

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.9, raising=False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append(round(f, 4)))
    with cuda_memory_cap(torch.device("cuda", 0), 40 * 2**30):
        assert calls == [0.5]
    with pytest.raises(RuntimeError), cuda_memory_cap(torch.device("cuda", 0), 76 * 2**30):
        assert calls[-1] == 0.9  # a tighter fraction already set stays
        raise RuntimeError("step failed")
    assert calls == [0.5, 0.9, 0.9, 0.9]
    with cuda_memory_cap(torch.device("cpu"), 2**30), cuda_memory_cap(torch.device("cuda", 0), None):
        pass
    assert len(calls) == 4
    assert verify.verify_steps(torch.device("cuda", 0)) == verify.VERIFY_STEPS["cuda"] > verify.VERIFY_STEPS["cpu"]


RESERVE_SCRIPT = textwrap.dedent(
    """
    import resource
    import torch
    from adaptive_batch.memory.device import proc_status_bytes
    from adaptive_batch.memory.oom import is_oom_error
    from adaptive_batch.probe.verify import heap_reserve

    headroom = 256 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (proc_status_bytes("VmSize") + headroom, resource.RLIM_INFINITY))
    cpu = torch.device("cpu")
    with heap_reserve(cpu, 0):
        torch.ones(int(0.7 * headroom), dtype=torch.uint8)  # fits
    try:
        with heap_reserve(cpu, int(0.4 * headroom)):
            torch.ones(int(0.7 * headroom), dtype=torch.uint8)
        print("fit")
    except RuntimeError as e:
        assert is_oom_error(e)
        print("held back")
    torch.ones(int(0.7 * headroom), dtype=torch.uint8)  # the reserve is back
    print("back")
    """
)


def test_on_cpu_the_margin_is_held_back_from_the_check_inside_the_heap(tmp_path):
    """The trials grow glibc's heap to the limit, so an RLIMIT_AS lowered for the check would
    hold nothing back; the reserve taken from the heap does, and is given back afterwards."""
    script = tmp_path / "reserve.py"
    script.write_text(RESERVE_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["held", "back", "back"]


def test_on_cpu_a_soft_budget_is_held_by_the_steps_live_tensor_bytes():
    """Nothing held a soft budget's consecutive-step check on CPU: a cached claim that 60 fits
    where 9 does was "verified" by 3 steps that ran. The check measures each step's tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
    optimizer = torch.optim.AdamW(model.parameters())

    def step(batch):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    target = ProbeTarget(step, lambda b: torch.randn(b, 64), model, optimizer, torch.device("cpu"))
    # the parameters and AdamW's two moments alone are ~1.6 MiB; one sample's activations ~8 KiB
    lines = []
    assert runs_consecutive_steps(4, target, budget_bytes=8 * 2**20, soft_budget=True)
    with lines_to(lines.append):
        assert not runs_consecutive_steps(2000, target, budget_bytes=8 * 2**20, soft_budget=True)
    assert "live tensors peaked at" in lines[0] and "over the budget's 8388608" in lines[0]
    # the same size is not judged by tensors under a hard limit (allocation failures decide there)
    assert runs_consecutive_steps(2000, target, budget_bytes=8 * 2**20, soft_budget=False)


def test_the_cuda_cap_takes_a_card_named_without_an_index(monkeypatch):
    """torch's memory-fraction calls refuse a bare ``cuda``, the device most users pass."""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": {0: 8 << 30}[index]}))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: {0: 1.0}[index], raising=False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index: calls.append((f, {0: 0}[index])))
    with cuda_memory_cap(torch.device("cuda"), 2 << 30):
        assert calls == [(0.25, 0)]
    assert calls == [(0.25, 0), (1.0, 0)]
