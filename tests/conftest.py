"""Settings every test process shares.

One intra-op thread for torch, here and in every process a test starts (they inherit the
environment): `make test` runs two pytest workers on two cores, and torch's default of a thread
per core in each would have them fight over the cores. Results are compared only between runs
made under the same setting.

Once the tests are collected, the objects the imports made (torch, Transformers, Lightning,
torchtune: most of a worker's heap) are set aside from the cyclic garbage collector
(``gc.freeze``), as a long-running service does after its imports: every full collection (the
Trainer's before its loop, Python's own as the heap grows) cost 0.3 s visiting them.
"""

import gc
import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the variable: torch reads it when its thread pool starts)

torch.set_num_threads(1)


# Files of 10 s or more on two cores with no test marked slow (docs/development.md's census):
# training runs and plans in the test process, a few short processes. Ranked with the files of
# one slow test, so that they do not end a worker's share.
LONG_UNMARKED = {"tests/test_docs.py", "tests/adaptive_batch/hf/test_run_position.py",
                 "tests/adaptive_batch/probe/test_plan.py", "tests/recipes/test_kill_sweep.py", "tests/test_gpu_check.py"}


def pytest_collection_modifyitems(config, items):
    """Files with the most tests that need processes of their own (``slow``) first, each file's
    tests in their order: `make test` hands a worker a file at a time in this order, so the long
    files start early and the short ones even out the end."""
    slow, first_seen = {}, {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.path, i)
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    for path in slow:
        if path.relative_to(config.rootpath).as_posix() in LONG_UNMARKED:
            slow[path] = max(slow[path], 1)
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
