import contextlib
import resource

import pytest

from adaptive_batch.memory import proc_status_bytes


def vm_size() -> int:
    return proc_status_bytes("VmSize")


@contextlib.contextmanager
def address_space_headroom(headroom_bytes: int):
    """A real process address-space limit: current size plus ``headroom_bytes``, then lifted."""
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + headroom_bytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


@pytest.fixture
def limited_address_space():
    return address_space_headroom
