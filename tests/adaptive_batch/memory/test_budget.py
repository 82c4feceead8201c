import pytest

from adaptive_batch.memory.budget import check_reserve_bytes, default_safety_margin, memory_budget, trial_headroom_bytes
from adaptive_batch.memory.device import DeviceCapacity

import torch

CAP = DeviceCapacity(device="cpu", headroom_bytes=1_000, source="RLIMIT_AS", hard_limit=True)


def test_max_memory_below_the_device_is_a_soft_budget_else_the_device_is_a_hard_one():
    b = memory_budget(max_memory_bytes=800, capacity=CAP, live_bytes=100, safety_margin=0.1)
    assert (b.limit_bytes, b.budget_bytes, b.source, b.kind) == (800, 720, "max_memory", "soft")
    b = memory_budget(max_memory_bytes=None, capacity=CAP, live_bytes=100, safety_margin=0.0)
    assert (b.limit_bytes, b.source, b.kind) == (1_100, "RLIMIT_AS", "hard")
    # max_memory above what the device holds now: the device's limit wins, and it is hard
    b = memory_budget(max_memory_bytes=5_000, capacity=CAP, live_bytes=100, safety_margin=0.0)
    assert (b.limit_bytes, b.kind) == (1_100, "hard")
    assert "soft budget" in memory_budget(max_memory_bytes=800, capacity=CAP, live_bytes=0, safety_margin=0).describe()
    with pytest.raises(ValueError, match="memory_safety_margin=1.5"):
        memory_budget(max_memory_bytes=None, capacity=CAP, live_bytes=0, safety_margin=1.5)


def test_the_default_margin_is_smallest_for_trials_in_fresh_processes():
    """There a fresh process with no scars judges the answer in the limit's own unit, and a 1%
    margin cost a whole sample wherever one is over 1% of the headroom (the 152K recipe found 4
    where 5 trains); 0, and 0.1%, let an MLP answer one sample over the truth (fresh processes
    differ by about a MiB). Trials in the probing process
    keep 1% for the heap an out-of-memory trial leaves (a Trainer's answer at 0% ran out of memory
    in training). Where trials go is decided once: test_children."""
    assert default_safety_margin("cpu") == 0.01 and default_safety_margin("cuda") == 0.05
    assert default_safety_margin("cpu", fresh_process_trials=True) == 0.003
    assert default_safety_margin("cuda", fresh_process_trials=True) == 0.05
    hard = memory_budget(max_memory_bytes=None, capacity=CAP, live_bytes=100_000, fresh_process_trials=True)
    assert (hard.kind, hard.safety_margin, hard.budget_bytes) == ("hard", 0.003, 100_697)
    assert memory_budget(max_memory_bytes=None, capacity=CAP, live_bytes=100).safety_margin == 0.01
    # a margin the user set is kept, wherever the trials run
    assert memory_budget(max_memory_bytes=None, capacity=CAP, live_bytes=0, safety_margin=0.1,
                         fresh_process_trials=True).safety_margin == 0.1


def test_a_soft_budget_never_lets_the_machine_guard_decide():
    """The guard at 1.25x a soft budget's room made glibc's and MKL's non-tensor memory fail
    trials at random: an MLP at 96 MiB answered 2 to 747 in fresh processes."""
    machine = DeviceCapacity(device="cpu", headroom_bytes=10**10, source="MemAvailable less a reserve", hard_limit=False)
    soft = memory_budget(max_memory_bytes=100 * 2**20, capacity=machine, live_bytes=0, safety_margin=0.01)
    assert trial_headroom_bytes(soft, machine, state_bytes=0) == machine.headroom_bytes
    assert check_reserve_bytes(soft, machine, device=torch.device("cpu"), state_bytes=0) == 0
    hard = memory_budget(max_memory_bytes=None, capacity=CAP, live_bytes=200, safety_margin=0.01)
    assert trial_headroom_bytes(hard, CAP, state_bytes=200) == 1_000  # 1.25 x 1000, capped by the machine
    assert check_reserve_bytes(hard, CAP, device=torch.device("cpu"), state_bytes=200) == 10
    assert check_reserve_bytes(hard, CAP, device=torch.device("cuda"), state_bytes=200) == 0



def test_a_share_of_an_address_space_limit_is_that_limit_less_the_rest():
    """find_max_batch_size's default, max_memory="90%", under an outside RLIMIT_AS was a soft
    budget in tensor bytes: a ViT's trials went past the limit's address space (7 out of memory in
    the caller, build= unused) and the answer left 6% unused. A share of the limit is hard, judged
    in its own unit, the rest held back; of available RAM or a card it stays soft."""
    from adaptive_batch.memory.device import memory_fraction
    from adaptive_batch.probe.children import trials_in_children

    assert [memory_fraction(v) for v in ("90%", 0.9, "0.5", "6GiB", 2**30, None, "lots", True)] == [
        0.9, 0.9, 0.5, None, None, None, None, None]
    share = memory_budget(max_memory_bytes=900, capacity=CAP, live_bytes=0, safety_margin=0.01, max_memory_fraction=0.9)
    assert (share.kind, share.source, share.share, share.limit_bytes) == ("hard", "max_memory", 0.9, 1_000)
    assert share.safety_margin == pytest.approx(1 - 0.9 * 0.99) and share.budget_bytes == 891
    assert "hard budget" in share.describe() and "max_memory: 90% of RLIMIT_AS" in share.describe()
    # the report's words: the share and the margin the user set, each once
    assert share.limit_words() == "90% of 1000 B (RLIMIT_AS) from max_memory less a 1.0% safety margin"
    assert trials_in_children(lambda: None, share, CAP, device=torch.device("cpu"), distributed=False)
    for capacity in (DeviceCapacity(device="cpu", headroom_bytes=1_000, source="MemAvailable less a reserve", hard_limit=False),
                     DeviceCapacity(device="cuda:0", headroom_bytes=1_000, source="cudaMemGetInfo", hard_limit=True)):
        other = memory_budget(max_memory_bytes=900, capacity=capacity, live_bytes=0, safety_margin=0.01,
                              max_memory_fraction=0.9)
        assert (other.kind, other.source, other.budget_bytes) == ("soft", "max_memory", 891)
