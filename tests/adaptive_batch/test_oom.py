import torch

from adaptive_batch import is_oom_error


def test_real_cpu_allocator_failure_is_recognised(limited_address_space):
    caught = None
    with limited_address_space(200 * 1024**2):
        try:
            torch.empty(1024**3, dtype=torch.uint8)
        except RuntimeError as e:
            caught = e
    assert caught is not None, "the 1 GiB allocation should fail under a 200 MiB headroom"
    assert is_oom_error(caught)
    # The limit is lifted: the same allocation now works.
    assert torch.empty(1024**3, dtype=torch.uint8).numel() == 1024**3


def test_oom_types_and_other_errors():
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom_error(MemoryError())
    assert not is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom_error(ValueError("DefaultCPUAllocator: can't allocate memory"))
