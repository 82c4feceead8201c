import os
import random

import numpy as np
import pytest
import torch

from adaptive_batch.logs import lines_to
from adaptive_batch.probe.snapshot import TrainingStateSnapshot, remove_stale_snapshots


def train_steps(model, opt, sched, n=2):
    for _ in range(n):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    random.random()
    np.random.rand()


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


@pytest.mark.parametrize("warm", [False, True])
def test_everything_comes_back_bitwise(tmp_path, warm):
    model, opt, sched = make()
    if warm:  # optimizer state exists before the snapshot (a resumed run)
        train_steps(model, opt, sched)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    moments = {k: {n: t.clone() for n, t in s.items()} for k, s in opt_state["state"].items()}
    sched_state = sched.state_dict()
    rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())

    with TrainingStateSnapshot(model, opt, sched, directory=str(tmp_path)):
        train_steps(model, opt, sched, n=3)
        assert not torch.equal(model[0].weight, params["0.weight"])

    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    assert all(p.grad is None for p in model.parameters())
    restored = opt.state_dict()
    assert restored["param_groups"] == opt_state["param_groups"]
    assert set(restored["state"]) == set(moments)
    for k, s in moments.items():
        for n, t in s.items():
            assert torch.equal(restored["state"][k][n], t)
    assert sched.state_dict() == sched_state
    assert random.getstate() == rng[0]
    assert np.array_equal(np.random.get_state()[1], rng[1])
    assert torch.equal(torch.get_rng_state(), rng[2])
    assert os.listdir(tmp_path) == []  # the snapshot file is gone


def test_gradients_held_mid_accumulation_come_back_and_the_steps_start_without_them(tmp_path):
    """A probe between two micro-batches of the caller's step dropped the first one's gradients."""
    model, opt, sched = make()
    model(torch.randn(4, 8)).sum().backward()  # a micro-batch the caller has not stepped on yet
    held = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model[1].bias.grad = None  # a parameter with no gradient stays without one
    del held["1.bias"]
    with TrainingStateSnapshot(model, opt, sched, directory=str(tmp_path)):
        assert all(p.grad is None for p in model.parameters())
        train_steps(model, opt, sched, n=1)
        model(torch.randn(4, 8)).sum().backward()  # the steps leave gradients of their own
    for name, p in model.named_parameters():
        assert (p.grad is None) if name not in held else torch.equal(p.grad, held[name]), name


def test_buffers_a_state_dict_leaves_out_come_back(tmp_path):
    """A buffer registered with persistent=False that the forward updates (a step counter, an
    average) came out of a probe 8 steps on."""
    model, opt, sched = make()
    model.register_buffer("seen", torch.ones(3), persistent=False)
    model.register_buffer("kept", torch.ones(3))
    with TrainingStateSnapshot(model, opt, sched, directory=str(tmp_path)):
        model.seen += 8
        model.kept += 8
    assert torch.equal(model.seen, torch.ones(3)) and torch.equal(model.kept, torch.ones(3))
    # one the steps replaced with another shape (a cache rebuilt for longer inputs), or removed
    model.register_buffer("cache", torch.zeros(2), persistent=False)
    with TrainingStateSnapshot(model, opt, sched, directory=str(tmp_path)):
        model.cache = torch.zeros(5)
        model.seen = None
    assert torch.equal(model.cache, torch.zeros(2)) and torch.equal(model.seen, torch.ones(3))


def test_restored_when_the_block_raises(tmp_path):
    model, opt, sched = make()
    before = model[0].weight.clone()
    with pytest.raises(KeyError):
        with TrainingStateSnapshot(model, opt, sched, directory=str(tmp_path)):
            train_steps(model, opt, sched)
            raise KeyError("boom")
    assert torch.equal(model[0].weight, before)
    assert opt.state_dict()["state"] == {}


def test_restore_before_save_is_an_error():
    model, opt, _ = make()
    with pytest.raises(RuntimeError, match="before save"):
        TrainingStateSnapshot(model, opt).restore()


def test_restored_optimizer_state_owns_its_memory(tmp_path):
    """The restore reads a memory-mapped file; optimizer state left pointing into it kept the
    whole (deleted) file mapped after the probe, address space that the found batch then lacked
    under a process limit."""
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 64)).sum().backward()
    optimizer.step()
    with TrainingStateSnapshot(model, optimizer, directory=str(tmp_path)):
        pass
    with open("/proc/self/maps") as maps:
        assert not [line for line in maps if ".probe_snapshot_" in line]
    assert all(v.untyped_storage().resizable() for s in optimizer.state.values() for v in s.values())
    assert list(tmp_path.iterdir()) == []


def test_restored_optimizer_state_goes_back_into_the_same_memory(tmp_path):
    """A restore that allocated the optimizer state anew moved it about glibc's heap, and under a
    process limit the batch the probe had just checked failed the caller's second step."""
    model, opt, sched = make()
    train_steps(model, opt, sched)
    pointers = {(id(p), k): v.data_ptr() for p, s in opt.state.items() for k, v in s.items()}
    saved = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items()}
    with TrainingStateSnapshot(model, opt, sched, directory=str(tmp_path)):
        train_steps(model, opt, sched, n=2)
    assert {(id(p), k): v.data_ptr() for p, s in opt.state.items() for k, v in s.items()} == pointers
    assert all(torch.equal(v, saved[(id(p), k)]) for p, s in opt.state.items() for k, v in s.items())


def test_the_snapshot_file_has_no_name_while_it_is_held(tmp_path):
    model = torch.nn.Linear(4, 4)
    with TrainingStateSnapshot(model, None, directory=str(tmp_path)):
        assert os.listdir(tmp_path) == []
        torch.nn.init.zeros_(model.weight)
    assert os.listdir(tmp_path) == []


def test_a_stale_snapshot_is_removed_with_a_message(tmp_path):
    stale = tmp_path / ".probe_snapshot_abc123.pt"
    stale.write_bytes(b"x" * 100)
    lines = []
    with lines_to(lines.append), TrainingStateSnapshot(torch.nn.Linear(2, 2), None, directory=str(tmp_path)):
        pass
    assert not stale.exists()
    assert "snapshot a killed run left behind" in lines[0] and str(stale) in lines[0]


def test_a_snapshot_named_by_a_live_process_or_another_host_is_left_and_one_by_a_dead_process_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    here = socket.gethostname()
    gone = tmp_path / f".probe_snapshot_{int(dead.stdout)}@{here}_abc.pt"
    live = tmp_path / f".probe_snapshot_{os.getpid()}@{here}_def.pt"
    elsewhere = tmp_path / f".probe_snapshot_{int(dead.stdout)}@another-{here}_ghi.pt"  # a shared file system
    for path in (gone, live, elsewhere):
        path.write_bytes(b"x")
    assert remove_stale_snapshots(str(tmp_path)) == 1
    assert not gone.exists() and live.exists() and elsewhere.exists()


@pytest.mark.parametrize("this_host", [True, False], ids=["a rank here", "a rank on another host"])
def test_another_ranks_sweep_between_naming_and_unlinking_takes_nothing(tmp_path, monkeypatch, this_host):
    # Two ranks share an output directory; the other rank's sweep once removed this rank's file in
    # the instant it had a name, and this rank's unlink then failed. Where the file system cannot
    # make unnamed files the name is there for that instant: the sweep runs in it here. A rank on
    # another host sharing the folder cannot tell this process lives, and removes the file.
    import tempfile

    import adaptive_batch.probe.snapshot as snapshot

    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    real_mkstemp = tempfile.mkstemp

    def mkstemp_then_the_other_ranks_sweep(**kwargs):
        made = real_mkstemp(**kwargs)
        assert os.listdir(tmp_path) != []
        if this_host:
            remove_stale_snapshots(str(tmp_path))
        else:
            os.remove(made[1])
        return made

    monkeypatch.setattr(snapshot.tempfile, "mkstemp", mkstemp_then_the_other_ranks_sweep)
    model, opt, sched = make()
    train_steps(model, opt, sched)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with TrainingStateSnapshot(model, opt, sched, directory=str(tmp_path)):
        train_steps(model, opt, sched)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert os.listdir(tmp_path) == []


KILLED_SCRIPT = """
import os, signal, sys
import torch
from adaptive_batch import find_max_batch_size

model = torch.nn.Linear(16, 16)
optimizer = torch.optim.AdamW(model.parameters())

def step(batch):
    if batch.shape[0] == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of probing
    model(batch).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

find_max_batch_size(step, make_batch=lambda b: torch.randn(b, 16), model=model, optimizer=optimizer,
                    max_memory="1GiB", snapshot_dir=sys.argv[1])
"""


def test_a_run_killed_while_probing_leaves_no_snapshot(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr[-2000:]
    assert out.is_dir() and os.listdir(out) == []
