"""Runs ``tune`` under a process address-space limit set relative to this process's size.

Usage: python tests/recipes/limited_run.py HEADROOM_BYTES run recipes/x.py --config ...

The heavy imports happen first, then ``RLIMIT_AS`` is set to the current virtual size plus
``HEADROOM_BYTES`` (as ``prlimit --as`` would from outside), then torchtune's CLI runs in this
process. Allocations past the limit fail with the CPU allocator's real out-of-memory error.
"""

import resource
import sys

import datasets  # noqa: F401  (imported by torchtune's datasets; its size counts before the limit)
import torch  # noqa: F401
from torchtune._cli.tune import main
import torchtune.training  # noqa: F401

from adaptive_batch.memory.device import proc_status_bytes

if __name__ == "__main__":
    headroom = int(sys.argv[1])
    limit = proc_status_bytes("VmSize") + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    print(f"limited_run: RLIMIT_AS={limit} bytes", flush=True)
    sys.argv = ["tune"] + sys.argv[2:]
    main()
