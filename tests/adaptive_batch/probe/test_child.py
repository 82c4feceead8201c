"""Hard-limit trials in fresh child processes: a crash or an allocation failure there is a trial
that did not fit, and the caller's process goes on untouched."""

import pytest
import torch

from adaptive_batch import find_max_batch_size
from adaptive_batch.probe.child import ChildOutOfMemoryError, child_trial
from tests.adaptive_batch.probe import crashing_step


def test_a_crash_in_a_trial_is_a_failed_trial_and_the_caller_lives():
    """A conv net's probe died of a segfault and of oneDNN's "could not create a primitive" in
    the caller's own process; in children both are trials that did not fit."""
    target = crashing_step.build()
    before = [p.detach().clone() for p in target.model.parameters()]
    lines = []
    found = find_max_batch_size(target.train_step, make_batch=target.make_batch, model=target.model,
                                optimizer=target.optimizer, max_memory=None, max_batch_size=16, log=lines.append,
                                build=crashing_step.build)
    assert found == crashing_step.PRIMITIVE_ABOVE
    assert any("in a fresh process" in line for line in lines)
    assert any("out of memory" in line for line in lines if line.startswith("probe trial"))
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters()))  # never stepped here
    print("\n".join(lines))


def test_a_childs_other_errors_come_back_with_its_traceback():
    run = child_trial(_wrong_build, headroom_bytes=2**30, steps=1)
    with pytest.raises(RuntimeError, match="failed:\nTraceback"):
        run(1)


def _wrong_build():
    raise ValueError("the build itself is wrong")


def test_a_dead_child_is_out_of_memory():
    run = child_trial(crashing_step.build, headroom_bytes=2**30, steps=1)
    with pytest.raises(ChildOutOfMemoryError, match="died"):
        run(crashing_step.SEGFAULT_ABOVE + 1)
    with pytest.raises(ChildOutOfMemoryError, match="could not create a primitive"):
        run(crashing_step.PRIMITIVE_ABOVE + 1)
    assert run(crashing_step.PRIMITIVE_ABOVE) > 0
