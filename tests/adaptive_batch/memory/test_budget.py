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


def test_the_default_margin_holds_back_nothing_only_where_allocations_fail_in_the_limits_own_unit():
    """Under an RLIMIT_AS the trials and the check fail to allocate for real: a 1% margin there
    cost a whole sample wherever one is over 1% of the headroom (a Trainer found 15 where 16
    trains in fresh processes). A soft budget, the machine's RAM, a cgroup and a card keep theirs."""
    assert default_safety_margin("cpu") == 0.01 and default_safety_margin("cuda") == 0.05
    assert default_safety_margin("cpu", address_space_limit=True) == 0.0
    assert default_safety_margin("cuda", address_space_limit=True) == 0.05
    hard = memory_budget(max_memory_bytes=None, capacity=CAP, live_bytes=100)
    assert (hard.kind, hard.safety_margin, hard.budget_bytes) == ("hard", 0.0, 1_100)
    soft = memory_budget(max_memory_bytes=800, capacity=CAP, live_bytes=100)
    assert (soft.kind, soft.safety_margin, soft.budget_bytes) == ("soft", 0.01, 792)
    for source in ("cgroup memory.max", "MemAvailable less a reserve"):
        machine = DeviceCapacity(device="cpu", headroom_bytes=1_000, source=source, hard_limit=False)
        assert memory_budget(max_memory_bytes=None, capacity=machine, live_bytes=0).safety_margin == 0.01
    card = DeviceCapacity(device="cuda:0", headroom_bytes=1_000, source="cudaMemGetInfo", hard_limit=True)
    assert memory_budget(max_memory_bytes=None, capacity=card, live_bytes=0).safety_margin == 0.05
    # a margin the user set is kept, under any limit
    assert memory_budget(max_memory_bytes=None, capacity=CAP, live_bytes=0, safety_margin=0.1).safety_margin == 0.1


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
