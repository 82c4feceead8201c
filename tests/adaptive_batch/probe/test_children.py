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


MIB = 2**20


class _FixedThenGrowingStep:
    """A step whose memory is a fixed 10 MiB buffer, then 2 MiB a sample: the fixed part sets the
    peak at batch 1 and 2, and batch 1 runs one more operator (a view where larger batches copy,
    a chunked loss's branch), so no operator line can be drawn through batch 1 and 2."""

    def __call__(self, batch: torch.Tensor) -> None:
        if batch.shape[0] == 1:
            batch.clone()
        fixed = torch.empty(10 * MIB, dtype=torch.uint8)
        del fixed
        growing = torch.empty(2 * MIB * batch.shape[0], dtype=torch.uint8)
        del growing


def test_the_first_guess_draws_its_line_through_2_and_3_where_batch_1_runs_other_operators():
    """A 152K x 64 model's chunked loss ran 996 operators at batch 1 and 1012 from 2: the phases'
    line through 1 and 2 guessed 13 where 6 fit, and the children's trials went out of memory 3
    times. Here the line through 1 and 2 is flat (no guess at all); through 2 and 3 it is exact."""
    from adaptive_batch.probe.children import TensorGuess
    from adaptive_batch.probe.target import ProbeTarget

    target = ProbeTarget(train_step=_FixedThenGrowingStep(), make_batch=lambda b: torch.zeros(b, dtype=torch.uint8),
                         model=torch.nn.Linear(1, 1), device=CPU)
    budget = 21 * MIB
    # the truth: the largest b with max(10, 2 b) MiB and the model's few bytes within the budget
    first = TensorGuess(budget, "max_memory")(target, 0, 0)
    assert first.batch_size == 10 and first.steps == (1, 1, 2, 3)  # the warmup, then the estimate steps
    assert first.describe() == ("the tensor bytes of 4 steps at batch 1, 1, 2, 3 in a fresh process put the answer "
                                "at most at 10")
    # where batch 1 and 2 run the same operators, the guess takes no step at 3
    ran = []
    same = ProbeTarget(train_step=lambda batch: ran.append(batch.shape[0]) or torch.empty(2 * MIB * batch.shape[0]),
                       make_batch=lambda b: torch.zeros(b, dtype=torch.uint8), model=torch.nn.Linear(1, 1), device=CPU)
    first = TensorGuess(budget, "max_memory")(same, 0, 0)
    assert first.batch_size > 0 and ran == [1, 1, 2] and first.steps == (1, 1, 2)
