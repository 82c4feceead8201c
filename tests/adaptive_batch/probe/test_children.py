"""Where the trials run is decided once: in fresh processes only where a build can make them, the
budget is the hard limit of an address-space limit on CPU, and no other rank steps with them."""

import torch

from adaptive_batch.memory.budget import memory_budget
from adaptive_batch.memory.device import ADDRESS_SPACE_SOURCE, DeviceCapacity
from adaptive_batch.probe.children import trials_in_children

CPU = torch.device("cpu")
LIMIT = DeviceCapacity(device="cpu", headroom_bytes=2**30, source=ADDRESS_SPACE_SOURCE, hard_limit=True)


def build():
    raise AssertionError("not called")


def _budget(capacity, max_memory=None):
    return memory_budget(max_memory_bytes=max_memory, capacity=capacity, live_bytes=0)


def test_trials_go_to_fresh_processes_only_under_an_address_space_limit_with_a_build_on_one_process():
    assert trials_in_children(build, _budget(LIMIT), LIMIT, device=CPU, distributed=False)
    assert not trials_in_children(None, _budget(LIMIT), LIMIT, device=CPU, distributed=False)
    # the ranks step together in their own processes
    assert not trials_in_children(build, _budget(LIMIT), LIMIT, device=CPU, distributed=True)
    # a soft budget is judged by tensor bytes in any process
    assert not trials_in_children(build, _budget(LIMIT, max_memory=2**20), LIMIT, device=CPU, distributed=False)
    # a cgroup or the machine's RAM is shared: a child's copy of the model would take the caller's room
    for source in ("cgroup memory.max", "MemAvailable less a reserve"):
        shared = DeviceCapacity(device="cpu", headroom_bytes=2**30, source=source, hard_limit=False)
        assert not trials_in_children(build, _budget(shared), shared, device=CPU, distributed=False)
    card = DeviceCapacity(device="cuda:0", headroom_bytes=2**30, source="cudaMemGetInfo", hard_limit=True)
    assert not trials_in_children(build, _budget(card), card, device=torch.device("cuda", 0), distributed=False)


def test_the_childrens_line_is_measured_where_the_answer_likely_is():
    """Under 8 a sample is over an eighth of the headroom: the guess and one below it (a 152K
    vocabulary's guess of 5 took trials at 1, 2, 5 and 6, now 4, 5 and 6). From 8, half and three
    quarters of the guess, where glibc's heap no longer absorbs a step."""
    from adaptive_batch.probe.children import _estimate_sizes

    assert [_estimate_sizes(g) for g in (None, 1, 2, 3, 5, 7)] == [(1, 2), (1, 2), (1, 2), (2, 3), (4, 5), (6, 7)]
    assert _estimate_sizes(8) == (4, 6) and _estimate_sizes(63) == (31, 47)
