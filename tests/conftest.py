"""Settings every test process shares.

One intra-op thread for torch, here and in every process a test starts (they inherit the
environment): `make test` runs two pytest workers on two cores, and torch's default of a thread
per core in each would have them fight over the cores. Results are compared only between runs
made under the same setting.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the variable: torch reads it when its thread pool starts)

torch.set_num_threads(1)
