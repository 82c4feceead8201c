import pytest
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


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "CUDA out of memory. Tried to allocate 20.00 MiB",
    ],
)
def test_cuda_and_cudnn_forms_of_out_of_memory(message):
    assert is_oom_error(RuntimeError(message))


def test_other_cuda_errors_are_not_out_of_memory():
    assert not is_oom_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_oom_error(RuntimeError("cuDNN error: CUDNN_STATUS_BAD_PARAM"))


def test_catch_oom_returns_the_result_or_the_first_line_and_lets_other_errors_through():
    from adaptive_batch.memory.oom import catch_oom

    assert catch_oom(lambda: 7) == (7, None)

    def cpu_oom():
        raise RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried 8 GB\nmore")

    assert catch_oom(cpu_oom) == (None, "[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried 8 GB")

    def bug():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        catch_oom(bug)


def test_catch_oom_keeps_nothing_of_the_failed_step_alive():
    import weakref

    from adaptive_batch.memory.oom import catch_oom

    refs = []

    def step():
        activations = torch.ones(1024)
        refs.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert catch_oom(step)[1].startswith("CUDA out of memory")
    assert refs[0]() is None  # the traceback, and the frame holding the tensor, are gone


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's buffers exist only where torch has MKL")
def test_release_memory_gives_back_the_buffers_mkl_kept_for_other_shapes():
    """MKL keeps a product's work buffers per shape: a probe's trials at several batch sizes
    left 5-11 MiB a process training one size never holds."""
    import ctypes

    from adaptive_batch.memory.oom import release_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2

    def malloc_in_use() -> int:
        # Bytes malloc has handed out, in arenas and mappings: the address space they take
        # depends on the mmap threshold an earlier test in this process left (a raised one keeps
        # MKL's buffers in the heap, whose size a free does not change).
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    block = torch.empty(30 * 2**20, dtype=torch.uint8)
    del block  # a freed step-sized block raises glibc's mmap threshold, as a probe's trials do
    weight = torch.randn(4096, 4096)
    for rows in (256, 512, 1024, 2048):
        (torch.randn(rows, 4096) @ weight).sum()
    kept = malloc_in_use()
    release_memory(torch.device("cpu"))
    assert kept - malloc_in_use() >= 2**20


def test_cpp_allocation_failures_are_out_of_memory():
    assert is_oom_error(RuntimeError("std::bad_alloc"))


@pytest.mark.parametrize(
    "message",
    ["could not create a primitive", "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"],
)
def test_backend_failures_are_out_of_memory_only_once_a_smaller_batch_ran(message):
    """oneDNN's scratchpad failure under an address-space limit arrives as a primitive it could
    not create (a conv net's probe died of it); at the first step it may be a real bug."""
    from adaptive_batch.memory.oom import catch_oom

    assert not is_oom_error(RuntimeError(message))
    assert is_oom_error(RuntimeError(message), after_a_smaller_step=True)

    def fail():
        raise RuntimeError(message)

    with pytest.raises(RuntimeError):
        catch_oom(fail)
    assert catch_oom(fail, after_a_smaller_step=True) == (None, message.splitlines()[0])


def test_on_cuda_release_memory_clears_cublas_workspaces_when_asked_before_it_empties_the_cache(monkeypatch):
    """cuBLAS's workspaces come from the caching allocator and stay: they must be gone before the
    cache is emptied, or their blocks stay reserved; between the search's trials they stay."""
    from adaptive_batch.memory.oom import release_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)
    release_memory(torch.device("cuda", 0), cublas_workspaces=True)
    assert calls == ["synchronize", "clear", "empty_cache"]
    calls.clear()
    release_memory(torch.device("cuda", 0))
    assert calls == ["synchronize", "empty_cache"]
    calls.clear()
    release_memory(torch.device("cpu"), cublas_workspaces=True)
    assert calls == []


def still_set_aside(count):
    """The objects set aside stay so: none put back (0) and none added (more), though some may
    have been freed since (a frozen object whose last reference went, which took 2 in one run)."""
    import gc

    return 0 < gc.get_freeze_count() <= count


def test_collections_of_new_objects_free_the_blocks_cycles_and_what_was_garbage_before_it(unfrozen_heap):
    """A full collection visits every object the process holds (0.3 s where Transformers is
    imported, once per trial); inside the block it visits what the block made, and still frees
    every cycle that holds a tensor made in the block, and those that were garbage before it."""
    import gc
    import weakref

    from adaptive_batch.memory.oom import collections_of_new_objects, release_memory

    def cycle_holding_a_tensor():
        node = {"tensor": torch.ones(1024)}
        node["self"] = node
        return weakref.ref(node["tensor"])

    gc.disable()  # only the block collects: an automatic collection would pass for its own
    try:
        before = cycle_holding_a_tensor()
        with collections_of_new_objects():
            assert before() is None  # the garbage already there went at the block's start
            set_aside = gc.get_freeze_count()
            assert set_aside > 1000  # the process's objects (torch's, pytest's)
            with collections_of_new_objects():  # nested: the outer block's objects stay set aside
                inside = cycle_holding_a_tensor()
                release_memory()
                assert inside() is None and still_set_aside(set_aside)
            assert still_set_aside(set_aside)
            with pytest.raises(ValueError):
                with collections_of_new_objects():
                    raise ValueError
            assert still_set_aside(set_aside)
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0  # collected as before once the outermost block ends


def test_a_process_that_froze_its_own_objects_keeps_its_freeze(unfrozen_heap):
    """A server that froze its objects after its imports: the probe once put them back in every
    collection when it ended."""
    import gc
    import weakref

    from adaptive_batch.memory.oom import collections_of_new_objects, release_memory

    gc.freeze()
    frozen = gc.get_freeze_count()
    # A frozen object that dies leaves the count (2 of 628,735 once did, in a fresh clone's run):
    # the freeze is the process's where the probe neither froze more nor put them back.
    with collections_of_new_objects():
        node = {"tensor": torch.ones(1024)}
        node["self"] = node
        ref = weakref.ref(node["tensor"])
        del node
        release_memory()
        assert ref() is None and frozen // 2 < gc.get_freeze_count() <= frozen
    assert frozen // 2 < gc.get_freeze_count() <= frozen


def test_a_freeze_seen_once_is_not_walked_again_by_later_blocks(unfrozen_heap, monkeypatch):
    """``gc.get_freeze_count()`` walks every frozen object: 50 ms for 500K, once per probe in a
    process that froze its imports (216 probes of the test suite spent 12 s there)."""
    import gc

    from adaptive_batch.memory.oom import collections_of_new_objects

    asked = []
    count = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or count())
    with collections_of_new_objects():  # no freeze of the process's: asked, and the block freezes
        assert count() > 0
    assert len(asked) == 1 and count() == 0
    gc.freeze()
    for _ in range(3):
        with collections_of_new_objects():
            pass
    assert len(asked) == 2 and count() > 0  # seen once, kept, never put back
