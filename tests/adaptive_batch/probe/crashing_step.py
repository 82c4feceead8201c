"""A training step that fails as native code does under an address-space limit, for the child
trials' test: a crash (SIGSEGV) above one size, oneDNN's "could not create a primitive" above a
smaller one. A module of its own so a spawned process can import its ``build``."""

import os
import signal

import torch

from adaptive_batch.probe.target import ProbeTarget

SEGFAULT_ABOVE, PRIMITIVE_ABOVE = 13, 10


def build() -> ProbeTarget:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        rows = batch.shape[0]
        if rows > SEGFAULT_ABOVE:
            os.kill(os.getpid(), signal.SIGSEGV)
        if rows > PRIMITIVE_ABOVE:
            raise RuntimeError("could not create a primitive")
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return ProbeTarget(step, lambda b: torch.randn(b, 8), model, optimizer)


def build_hanging() -> ProbeTarget:
    """A step that never returns (a deadlock, a collective waiting for a peer)."""
    import time

    target = build()

    def step(batch):
        time.sleep(3600)

    return ProbeTarget(step, target.make_batch, target.model, target.optimizer)


def build_telling_its_process() -> ProbeTarget:
    """A build that fails with the threads and glibc setting its process trains with, and
    whether torch's compiler, which its optimizers import, was imported before it."""
    import sys

    from adaptive_batch.memory.device import glibc_mmap_threshold_set

    raise ValueError(f"threads={torch.get_num_threads()} mmap_threshold={glibc_mmap_threshold_set()} "
                     f"compiler_imported={'torch._dynamo' in sys.modules}")
