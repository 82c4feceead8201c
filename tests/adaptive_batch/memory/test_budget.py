import pytest

from adaptive_batch.memory.budget import check_reserve_bytes, memory_budget, trial_headroom_bytes
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
