import pytest
import torch

from adaptive_batch import parse_memory
from adaptive_batch.logs import lines_to
from adaptive_batch.memory.device import (
    ALLOC_CONF_VARS,
    DeviceCapacity,
    cpu_capacity,
    cuda_capacity,
    device_capacity,
    format_bytes,
    use_expandable_segments,
)

GiB = 1024**3


@pytest.mark.parametrize(
    "spec,expected",
    [
        (6 * GiB, 6 * GiB),
        ("6GiB", 6 * GiB),
        ("6 gib", 6 * GiB),
        ("512MB", 512 * 1000**2),
        ("512MiB", 512 * 1024**2),
        ("1.5GiB", int(1.5 * GiB)),
        ("1000000000", 1_000_000_000),
        (2e9, 2_000_000_000),
        (0.5, 8 * GiB),
        ("0.25", 4 * GiB),
        ("50%", 8 * GiB),
        (1.0, 16 * GiB),
        (None, None),
    ],
)
def test_parse_memory_accepts(spec, expected):
    assert parse_memory(spec, capacity_bytes=16 * GiB) == expected


@pytest.mark.parametrize(
    "spec,message",
    [
        ("lots", "cannot be parsed"),
        ("6 parsecs", "cannot be parsed"),
        (0, "greater than zero"),
        (-5, "greater than zero"),
        ("0GiB", "greater than zero"),
        (True, "boolean"),
        ("150%", "percentage"),
        (2.5, "neither a fraction"),
        ([1], "has type list"),
        ("32GiB", "larger than the device"),
        ("1e400", "not a finite size"),
        ("1e400GiB", "not a finite size"),
        (float("inf"), "not a finite number"),
        (float("nan"), "not a finite number"),
        (1, "too small for any training step"),
        ("1.5", "neither a fraction"),
        ("512", "too small for any training step"),
        ("100KiB", "too small for any training step"),
    ],
)
def test_parse_memory_rejects_with_key_value_and_fix(spec, message):
    with pytest.raises(ValueError) as info:
        parse_memory(spec, capacity_bytes=16 * GiB)
    text = str(info.value)
    assert message in text
    assert f"max_memory={spec!r}" in text
    assert "set it to null" in text or "set max_memory" in text


@pytest.mark.parametrize(
    "spec, fix",
    [(24, "'24GiB'"), ("512", "'512GiB'"), ("24 KiB", "at least 1MiB (e.g. '6GiB')"), ("24kb", "at least 1MiB")],
)
def test_a_size_under_a_mib_suggests_the_unit_it_left_out_or_one_that_fits(spec, fix):
    with pytest.raises(ValueError, match="too small for any training step") as info:
        parse_memory(spec, capacity_bytes=16 * GiB)
    assert fix in str(info.value) and "KiBGiB" not in str(info.value) and "kbGiB" not in str(info.value)


def test_a_negative_size_with_a_unit_is_said_to_be_negative():
    with pytest.raises(ValueError, match=r"max_memory='-5MiB' must be greater than zero"):
        parse_memory("-5MiB", capacity_bytes=16 * GiB)


def test_fraction_needs_a_known_capacity():
    with pytest.raises(ValueError, match="capacity is unknown"):
        parse_memory(0.5, capacity_bytes=None)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(None) == "unknown"


def test_cpu_capacity_without_limit_is_available_ram_or_cgroup():
    cap = cpu_capacity()
    assert cap.device == "cpu" and cap.headroom_bytes > 0
    assert cap.source in ("MemAvailable less a reserve", "cgroup memory.max", "RLIMIT_AS")


def test_cpu_capacity_follows_an_address_space_limit(limited_address_space):
    with limited_address_space(300 * 1024**2):
        cap = device_capacity(__import__("torch").device("cpu"))
    assert isinstance(cap, DeviceCapacity)
    assert cap.source == "RLIMIT_AS" and cap.hard_limit
    assert 250 * 1024**2 < cap.headroom_bytes <= 300 * 1024**2


def test_unsupported_device_type_is_rejected():
    import torch

    with pytest.raises(ValueError, match="device='meta'"):
        device_capacity(torch.device("meta"))


def test_cpu_capacity_leaves_a_reserve_of_available_ram(monkeypatch):
    import adaptive_batch.memory.device as memory

    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: None)
    monkeypatch.setattr(memory, "address_space_limit", lambda: None)
    monkeypatch.setattr(memory, "_meminfo_bytes", lambda f: {"MemAvailable": 20 * GiB, "MemTotal": 24 * GiB}[f])
    cap = cpu_capacity()
    assert cap.headroom_bytes == 20 * GiB - int(0.1 * 24 * GiB)
    assert not cap.hard_limit and "reserve" in cap.source
    monkeypatch.setattr(memory, "_meminfo_bytes", lambda f: {"MemAvailable": 3 * GiB, "MemTotal": 4 * GiB}[f])
    assert cpu_capacity().headroom_bytes == 2 * GiB  # at least 1 GiB stays with the machine


def test_a_cgroup_limit_is_not_a_catchable_one(monkeypatch):
    import adaptive_batch.memory.device as memory

    monkeypatch.setattr(memory, "address_space_limit", lambda: None)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: 1 * GiB)
    cap = cpu_capacity()
    assert cap.source == "cgroup memory.max" and not cap.hard_limit


def test_address_space_limit_at_sets_keeps_a_tighter_one_and_restores():
    import resource

    from adaptive_batch.memory.device import address_space_limit_at, proc_status_bytes

    before = resource.getrlimit(resource.RLIMIT_AS)
    wanted = proc_status_bytes("VmSize") + 8 * GiB
    with address_space_limit_at(wanted) as limit:
        assert limit == wanted == resource.getrlimit(resource.RLIMIT_AS)[0]
        with address_space_limit_at(wanted + GiB) as looser:
            assert looser == wanted  # the tighter one stays
    assert resource.getrlimit(resource.RLIMIT_AS) == before


class AllocatorSettings:
    """Stands in for torch's allocator-settings setter (no CUDA here): records each call."""

    def __init__(self, monkeypatch) -> None:
        self.calls = []
        for name in ALLOC_CONF_VARS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", self.calls.append, raising=False)


def test_expandable_segments_are_turned_on_and_said(monkeypatch):
    settings = AllocatorSettings(monkeypatch)
    logged, warned = [], []
    with lines_to(logged.append, warned.append):
        assert use_expandable_segments()
    assert settings.calls == ["expandable_segments:True"]
    assert len(logged) == 1 and "expandable_segments:True" in logged[0] and not warned


@pytest.mark.parametrize("name", ALLOC_CONF_VARS)
def test_expandable_segments_the_user_turned_on_are_left_alone(monkeypatch, name):
    settings = AllocatorSettings(monkeypatch)
    monkeypatch.setenv(name, "max_split_size_mb:512, expandable_segments:True")
    logged = []
    with lines_to(logged.append):
        assert use_expandable_segments()
    assert settings.calls == [] and logged == []


def test_a_torch_without_the_private_setter_is_said_with_the_variable_to_set(monkeypatch):
    AllocatorSettings(monkeypatch)
    for name in ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings"):
        monkeypatch.delattr(torch._C, name, raising=False)
    logged, warned = [], []
    with lines_to(logged.append, warned.append):
        assert not use_expandable_segments()
    assert logged == [] and len(warned) == 1
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in warned[0] and torch.__version__ in warned[0]


def test_expandable_segments_the_user_turned_off_stay_off_with_a_warning(monkeypatch):
    settings = AllocatorSettings(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    logged, warned = [], []
    with lines_to(logged.append, warned.append):
        assert not use_expandable_segments()
    assert settings.calls == [] and logged == []
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in warned[0]
    assert "remove expandable_segments:False" in warned[0]


# One process per setting: glibc's options and the thread's arena last for the process.
_ARENA_AFTER_OOM = r"""
import ctypes, resource, sys, threading
import torch
from adaptive_batch.memory.device import proc_status_bytes, return_freed_memory_to_os

# A second thread, as training has (torch's workers, a data loader's): a single-threaded
# process always allocates from the main heap.
threading.Thread(target=threading.Event().wait, daemon=True).start()
if sys.argv[1] == "recipe":
    return_freed_memory_to_os()
resource.setrlimit(resource.RLIMIT_AS, (proc_status_bytes("VmSize") + 256 * 2**20, resource.RLIM_INFINITY))
try:
    torch.empty(2**30, dtype=torch.uint8)  # a step past the limit, as a probe's largest trial is
except RuntimeError:
    pass
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
block = libc.malloc(64 * 1024)  # under either mmap threshold: served by this thread's arena
heap = next(line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
start, end = (int(x, 16) for x in heap.split("-"))
print("main heap" if start <= block < end else "another arena")
"""


@pytest.mark.parametrize("setting,arena", [("defaults", "another arena"), ("recipe", "main heap")])
def test_a_failed_allocation_moves_the_thread_off_its_heap_unless_the_recipe_allocator_is_set(setting, arena):
    # glibc retries a failed allocation in a new arena and keeps the thread there: its 64 MiB
    # heaps then hold a step's blocks beside the old heap's, 240 MiB more at a 4-layer Llama's
    # batch 3 (docs/probe.md). M_ARENA_MAX=1 leaves no other arena to move to.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _ARENA_AFTER_OOM, setting], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == arena


class _FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, option, value):
        self.calls.append((option, value))
        return 1


@pytest.mark.parametrize("soft,limit,device_type,relaxed", [
    (True, None, "cpu", True),  # a soft budget on CPU with no limit over the process
    (False, None, "cpu", False),  # a hard budget: training runs at the machine's limit
    (True, 8 * 2**30, "cpu", False),  # an outside address-space limit holds the process
    (True, None, "cuda", False),
])
def test_after_a_soft_probe_training_gets_glibcs_fast_thresholds(monkeypatch, soft, limit, device_type, relaxed):
    """The probe's mmap threshold of 256 KiB made a tiny config train 1.5x as long; after a probe
    judged by tensor bytes, with no limit over the process, glibc's thresholds go back to where its
    dynamic ones end, and the process no longer tells children it trains on the probe's."""
    import adaptive_batch.memory.device as device

    libc = _FakeLibc()
    monkeypatch.setattr(device, "_glibc", lambda: libc)
    monkeypatch.setattr(device, "_mmap_threshold_set", 256 * 1024)
    monkeypatch.setattr(device, "address_space_limit", lambda: limit)
    lines = []
    with lines_to(lines.append):
        assert device.relax_allocator_for_training(torch.device(device_type), soft_budget=soft) is relaxed
    if relaxed:
        assert libc.calls == [(-3, 32 * 2**20), (-1, 64 * 2**20)] and device.glibc_mmap_threshold_set() is None
        assert lines == ["CPU allocator: glibc's thresholds back to 32 MiB for training: the soft budget counts live "
                         "tensors, and no address-space limit holds this process."]
    else:
        assert libc.calls == [] and lines == [] and device.glibc_mmap_threshold_set() == 256 * 1024


@pytest.mark.parametrize("fraction, headroom, source", [
    (1.0, 30 * GiB + (7 - 5) * GiB, "cudaMemGetInfo"),  # free plus the cache's idle part
    (0.25, 20 * GiB - 5 * GiB, "set_per_process_memory_fraction(0.25)"),  # the process's share, less what it holds
])
def test_cuda_capacity_is_what_the_card_and_the_process_memory_fraction_both_allow(monkeypatch, fraction, headroom, source):
    # A card of 80 GiB with 30 free; this process holds 5 GiB allocated in 7 reserved.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 5 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 7 * GiB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: {0: fraction}[index], raising=False)
    capacity = cuda_capacity(torch.device("cuda", 0))
    assert (capacity.headroom_bytes, capacity.source, capacity.hard_limit) == (headroom, source, True)
    # what max_memory is checked against: all the process can hold there, its own 5 GiB included
    assert capacity.held_bytes == 5 * GiB and capacity.device_bytes == headroom + 5 * GiB


@pytest.mark.parametrize("max_memory, limit, settings", [
    ("1GiB", None, False),  # a size under half the machine's 8 GiB: the guard is far above the budget
    (4 * GiB, None, False),  # exactly half
    ("5GiB", None, True),  # near the guard: glibc's kept blocks could reach it first
    (0.1, None, True),  # a fraction: the budget is the machine's own
    (None, None, True),  # the whole machine
    ("2GiB,1GiB", None, True),  # several ranks' budgets, read per rank elsewhere
    ("1GiB", 8 * GiB, True),  # an address-space limit holds the process
])
def test_a_soft_budget_far_below_the_machine_probes_on_glibcs_defaults(monkeypatch, max_memory, limit, settings):
    """Judged by live tensor bytes, a probe needs address space to follow live memory only where
    its guard (the machine's headroom) is near the budget: the settings map every block over
    256 KiB afresh, and every soft probe's steps paid for them."""
    import adaptive_batch.memory.device as device

    libc = _FakeLibc()
    monkeypatch.setattr(device, "_glibc", lambda: libc)
    monkeypatch.setattr(device, "_mmap_threshold_set", None)
    monkeypatch.setattr(device, "address_space_limit", lambda: limit)
    monkeypatch.setattr(device, "cpu_capacity", lambda: DeviceCapacity("cpu", 8 * GiB, "MemAvailable", hard_limit=False))
    lines = []
    with lines_to(lines.append):
        device.prepare_allocator(torch.device("cpu"), probing=True, max_memory=max_memory)
    assert (libc.calls == [(-3, 256 * 1024), (-8, 1)]) is settings and (libc.calls == []) is not settings
    assert len(lines) == int(settings) and device.glibc_mmap_threshold_set() == (256 * 1024 if settings else None)
