"""Memory budgets: parsing ``max_memory`` and reading what a device can hold.

On CUDA the capacity is what the caching allocator can still get plus what it already holds.
On CPU it is the tightest of the process address-space limit (``ulimit -v`` / ``prlimit --as``),
the cgroup memory limit and the RAM the kernel reports available.
"""

from contextlib import contextmanager
import ctypes
from dataclasses import asdict, dataclass
import functools
import math
import os
import re
import resource
from typing import Callable, Iterator, Optional, Tuple, Union

import torch

import adaptive_batch.logs as logs

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")
# No training step fits in less; a smaller byte count is a unit left out ("512" for "512MiB").
MIN_MEMORY_BYTES = 1024**2
# Without max_memory or a hard limit, the CPU budget leaves this much of the machine's RAM
# (at least CPU_RESERVE_MIN_BYTES) to everything else running on it.
CPU_RESERVE_FRACTION = 0.10
CPU_RESERVE_MIN_BYTES = 1024**3

MemorySpec = Union[int, float, str, None]


def format_bytes(num_bytes: Optional[int]) -> str:
    """Human-readable size with binary units, e.g. ``1.50 GiB``."""
    if num_bytes is None:
        return "unknown"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def parse_memory(
    value: MemorySpec, *, capacity_bytes: Optional[int] = None, key: str = "max_memory"
) -> Optional[int]:
    """Turns a memory spec into bytes.

    Accepted: a positive byte count (``6000000000``), a size string (``"6GiB"``, ``"512MB"``),
    a fraction of the device in ``(0, 1]`` (``0.8``) or a percentage (``"80%"``). ``None`` means
    "the whole device" and is returned as ``None``.

    Args:
        value: the spec.
        capacity_bytes: the device's capacity; needed for fractions and to reject a spec larger
            than the device.
        key: the config key the value came from, for error messages.

    Returns:
        The number of bytes, or ``None`` when ``value`` is ``None``.

    Raises:
        ValueError: if the value cannot be parsed, is not finite, is zero or negative, is under
            1 MiB (a unit left out), is a fraction without a known capacity, or is larger than
            ``capacity_bytes``.
    """
    if value is None:
        return None
    fix = f"set {key} to a positive byte count, a size such as '6GiB', a fraction such as 0.8, or null"
    fraction, num_bytes = _amount(value, key, fix)
    if num_bytes is not None and num_bytes < MIN_MEMORY_BYTES:
        raise ValueError(
            f"{key}={value!r} is {int(num_bytes)} bytes, too small for any training step: set {key} to "
            f"{_with_a_unit(value)}, or to a fraction such as 0.8 for a share of the device."
        )

    if fraction is not None:
        if capacity_bytes is None:
            raise ValueError(
                f"{key}={value!r} is a fraction of the device, but the device's capacity is "
                f"unknown: give {key} in bytes or as a size such as '6GiB'."
            )
        return int(capacity_bytes * fraction)
    assert num_bytes is not None
    result = int(num_bytes)
    if capacity_bytes is not None and result > capacity_bytes:
        raise ValueError(
            f"{key}={value!r} ({format_bytes(result)}) is larger than the device can hold "
            f"({format_bytes(capacity_bytes)}): lower {key}, or set it to null to use the whole device."
        )
    return result


def _with_a_unit(value: MemorySpec) -> str:
    """The size a value under 1 MiB most likely meant: its number in GiB where it has no unit."""
    size = _SIZE_RE.match(value) if isinstance(value, str) else None
    if isinstance(value, (int, float)) or (size and size.group(2) == ""):
        return f"a size with a unit (e.g. '{size.group(1) if size else value}GiB')"
    return "a size of at least 1MiB (e.g. '6GiB')"


def memory_fraction(value: MemorySpec) -> Optional[float]:
    """The share of the device a memory spec asks for.

    Args:
        value: a spec as :func:`parse_memory` takes it.

    Returns:
        The fraction (``0.9`` for ``0.9`` or ``"90%"``); ``None`` for a size, for ``None`` and
        for a value :func:`parse_memory` refuses (it says why).
    """
    try:
        return None if value is None else _amount(value, "max_memory", "")[0]
    except ValueError:
        return None


# A memory spec's amount: a fraction of the device, or a number of bytes (the other None).
_Amount = Tuple[Optional[float], Optional[float]]


def _amount(value: MemorySpec, key: str, fix: str) -> "_Amount":
    """A spec's fraction of the device or number of bytes, its form checked."""
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is a boolean, not a memory size: {fix}.")
    if isinstance(value, (int, float)):
        return _number_amount(value, key, fix)
    if isinstance(value, str):
        return _string_amount(value, key, fix)
    raise ValueError(f"{key}={value!r} has type {type(value).__name__}: {fix}.")


def _number_amount(value: Union[int, float], key: str, fix: str) -> _Amount:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key}={value!r} is not a finite number: {fix}.")
    if value <= 0:
        raise ValueError(f"{key}={value!r} must be greater than zero: {fix}.")
    if isinstance(value, float) and value <= 1:
        return value, None
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{key}={value!r} is neither a fraction in (0, 1] nor whole bytes: {fix}.")
    return None, value


def _string_amount(value: str, key: str, fix: str) -> _Amount:
    percent, size = _PERCENT_RE.match(value), _SIZE_RE.match(value)
    if percent:
        fraction = float(percent.group(1)) / 100
        if not 0 < fraction <= 1:
            raise ValueError(f"{key}={value!r} must be a percentage in (0, 100]: {fix}.")
        return fraction, None
    if value.strip().startswith("-") and _SIZE_RE.match(value.strip()[1:]):
        raise ValueError(f"{key}={value!r} must be greater than zero: {fix}.")
    if not size or size.group(2).lower() not in _UNITS:
        raise ValueError(f"{key}={value!r} cannot be parsed as a memory size: {fix}.")
    number, unit = float(size.group(1)), size.group(2)
    if not math.isfinite(number * _UNITS[unit.lower()]):
        raise ValueError(f"{key}={value!r} is not a finite size: {fix}.")
    if unit == "" and 0 < number <= 1 and "." in size.group(1):
        return number, None
    if unit == "" and not number.is_integer():
        raise ValueError(f"{key}={value!r} is neither a fraction in (0, 1] nor whole bytes: {fix}.")
    num_bytes = number * _UNITS[unit.lower()]
    if num_bytes < 1:
        raise ValueError(f"{key}={value!r} must be greater than zero: {fix}.")
    return None, num_bytes


# The capacity source of this process's own address-space limit, the one limit no other process shares.
ADDRESS_SPACE_SOURCE = "RLIMIT_AS"


@dataclass(frozen=True)
class DeviceCapacity:
    """What a device can still hold, and which limit decided it.

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        headroom_bytes: bytes that can still be allocated on top of what is live now.
        source: the limit that decided ``headroom_bytes`` (e.g. ``"RLIMIT_AS"``).
        hard_limit: whether crossing it fails allocations (an address-space limit or a card's
            memory), as opposed to a soft figure such as available RAM.
        held_bytes: what this process's tensors already hold there, on a card (0 on the CPU,
            whose headroom is read past them).
    """

    device: str
    headroom_bytes: int
    source: str
    hard_limit: bool
    held_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        """What this process can hold there in all: the bound a ``max_memory`` must keep within."""
        return self.headroom_bytes + self.held_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def proc_status_bytes(field: str) -> Optional[int]:
    """A size field of ``/proc/self/status`` in bytes (``"VmSize"``, ``"VmHWM"``), or ``None``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def address_space_limit() -> Optional[int]:
    """The soft ``RLIMIT_AS`` of this process in bytes, or ``None`` when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _cgroup_headroom() -> Optional[int]:
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or int(raw) >= 1 << 60:
            return None
        return max(0, int(raw) - usage)
    return None


def _meminfo_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_capacity() -> DeviceCapacity:
    """Headroom of this process on the CPU: the tightest of its limits.

    Those are the address-space limit, the cgroup's memory limit, and the RAM available less a
    reserve for the rest of the machine (10% of RAM, at least 1 GiB).

    Raises:
        RuntimeError: if no limit can be read at all.
    """
    candidates = []
    limit = address_space_limit()
    vm_size = proc_status_bytes("VmSize")
    if limit is not None and vm_size is not None:
        candidates.append((max(0, limit - vm_size), ADDRESS_SPACE_SOURCE, True))
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        # Crossing it wakes the cgroup's OOM killer: no allocation fails first.
        candidates.append((cgroup, "cgroup memory.max", False))
    available = _meminfo_bytes("MemAvailable")
    if available is not None:
        total = _meminfo_bytes("MemTotal") or available
        reserve = max(CPU_RESERVE_MIN_BYTES, int(CPU_RESERVE_FRACTION * total))
        candidates.append((max(0, available - reserve), "MemAvailable less a reserve", False))
    if not candidates:
        raise RuntimeError("cannot read any memory limit of this process: set max_memory explicitly.")
    headroom, source, hard = min(candidates, key=lambda c: c[0])
    return DeviceCapacity(device="cpu", headroom_bytes=headroom, source=source, hard_limit=hard)


def cuda_capacity(device: torch.device) -> DeviceCapacity:
    """Headroom on a CUDA device: free memory plus what the caching allocator already holds,
    and no more than ``torch.cuda.set_per_process_memory_fraction`` leaves this process (the
    allocator refuses past it with a real out-of-memory error, whatever the card has free)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    headroom, source = free + torch.cuda.memory_reserved(device) - allocated, "cudaMemGetInfo"
    fraction = cuda_memory_fraction(device)
    if fraction < 1.0 and int(total * fraction) - allocated < headroom:
        headroom, source = int(total * fraction) - allocated, f"set_per_process_memory_fraction({fraction:g})"
    return DeviceCapacity(device=str(device), headroom_bytes=int(max(headroom, 0)), source=source, hard_limit=True,
                          held_bytes=int(allocated))


def cuda_index(device: torch.device) -> int:
    """The card's index (torch's memory-fraction calls refuse a bare ``cuda``)."""
    return torch.cuda.current_device() if device.index is None else device.index


def cuda_memory_fraction(device: torch.device) -> float:
    """The share of the card this process may reserve (``set_per_process_memory_fraction``)."""
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.9 and later
    return 1.0 if get_fraction is None else get_fraction(cuda_index(device))


# torch's cuBLAS workspace when CUBLAS_WORKSPACE_CONFIG is unset, on Hopper (32 MiB; older cards take
# about 8, so a plan for them errs high). A training step makes two: the forward's thread takes one at its
# first product, autograd's backward thread another; both stay (64 MiB measured on an H200, docs/gpu.md).
DEFAULT_CUBLAS_WORKSPACE_CONFIG = ":4096:8"
CUBLAS_WORKSPACES_PER_STEP = 2
_WORKSPACE_PAIR_RE = re.compile(r":(\d+):(\d+)")


def cublas_workspace_bytes() -> int:
    """The bytes one cuBLAS workspace takes from the caching allocator: ``CUBLAS_WORKSPACE_CONFIG``'s
    ``:KiB:count`` pairs summed, as torch reads them, else :data:`DEFAULT_CUBLAS_WORKSPACE_CONFIG`."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") or DEFAULT_CUBLAS_WORKSPACE_CONFIG
    pairs = _WORKSPACE_PAIR_RE.findall(config) or _WORKSPACE_PAIR_RE.findall(DEFAULT_CUBLAS_WORKSPACE_CONFIG)
    return sum(int(kib) * int(count) for kib, count in pairs) * 1024


def device_capacity(device: torch.device) -> DeviceCapacity:
    """Headroom on ``device``.

    Raises:
        ValueError: for a device type other than CPU or CUDA.
    """
    if device.type == "cpu":
        return cpu_capacity()
    if device.type == "cuda":
        return cuda_capacity(device)
    raise ValueError(
        f"device={device.type!r} has no memory backend here: use device=cpu or device=cuda, "
        "or set use_maximum_batch_size=False."
    )


@contextmanager
def address_space_limit_at(limit_bytes: int) -> Iterator[Optional[int]]:
    """Holds this process to a soft ``RLIMIT_AS`` of ``limit_bytes`` inside the block.

    An allocation past it fails with an error the probe catches, where past a soft figure
    (available RAM, a cgroup) the kernel's OOM killer ends the process. A tighter limit already
    in place stays; the previous one is back on exit.

    Yields:
        The limit in force inside the block, or ``None`` when the platform has none.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    wanted = int(limit_bytes) if hard == resource.RLIM_INFINITY else min(int(limit_bytes), hard)
    if soft != resource.RLIM_INFINITY and soft <= wanted:
        yield int(soft)
        return
    resource.setrlimit(resource.RLIMIT_AS, (wanted, hard))
    try:
        yield wanted
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Where glibc's dynamic thresholds end on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, and trimming at twice it).
_FAST_MMAP_THRESHOLD = 32 * 2**20
_FAST_TRIM_THRESHOLD = 64 * 2**20
# The M_MMAP_THRESHOLD this process set through return_freed_memory_to_os (None: glibc's defaults).
_mmap_threshold_set: Optional[int] = None


def glibc_mmap_threshold_set() -> Optional[int]:
    """The ``threshold_bytes`` :func:`return_freed_memory_to_os` set in this process, ``None``
    while glibc's defaults hold (a process started elsewhere, such as a probe's child, is told
    it to train on the same allocator)."""
    return _mmap_threshold_set


@functools.lru_cache(maxsize=None)
def _glibc() -> Optional[ctypes.CDLL]:
    """glibc, whose ``mallopt`` sets the allocator's options; ``None`` on another C library."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_freed_memory_to_os(threshold_bytes: int = 256 * 1024) -> bool:
    """Makes glibc's address space follow live memory, for runs under an address-space limit.

    Two glibc settings: large blocks are served with ``mmap`` (freeing them returns the
    address space; otherwise glibc keeps freed heap blocks, and a batch that fits in live
    tensors fails on space only the allocator's cache holds), and no new malloc arena is made
    (arenas made before the call stay). Without the second, each new thread's arena reserves
    64 MiB of address space (e.g. the first time a progress bar starts its monitor thread, after
    the probe has measured the headroom), and in a process with more than one thread a failed
    allocation (a probe trial past the limit) moves the thread that made it to a new arena for
    good: its heaps of 64 MiB then hold a step's blocks beside the old heap's.

    Returns:
        ``True`` when glibc accepted both settings, ``False`` on another C library.
    """
    libc = _glibc()
    if libc is None:
        return False
    global _mmap_threshold_set
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes))
    arena_ok = libc.mallopt(_M_ARENA_MAX, 1)
    if mmap_ok and arena_ok:
        _mmap_threshold_set = int(threshold_bytes)
    return bool(mmap_ok and arena_ok)


def relax_allocator_for_training(device: torch.device, *, soft_budget: bool) -> bool:
    """After a probe judged by live tensor bytes (a soft budget) on CPU, with no address-space
    limit over the process: glibc's thresholds where its dynamic ones end, so training reuses
    freed blocks instead of mapping every block over 256 KiB afresh (a tiny config's steps took
    1.5x as long, 13x the page faults). The probe's trials needed
    :func:`return_freed_memory_to_os` (they ran under a limit of their own); training under no
    limit, judged by tensors, does not (a run resumed from a soft probe's result trains so too).
    Said in one line.

    Returns:
        Whether the thresholds were relaxed.
    """
    global _mmap_threshold_set
    if device.type != "cpu" or not soft_budget or address_space_limit() is not None or _mmap_threshold_set is None:
        return False
    libc = _glibc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, _FAST_MMAP_THRESHOLD):
        return False
    _mmap_threshold_set = None  # what children are told, whether or not the trim threshold follows
    libc.mallopt(_M_TRIM_THRESHOLD, _FAST_TRIM_THRESHOLD)
    logs.info("CPU allocator: glibc's thresholds back to 32 MiB for training: the soft budget counts live tensors, "
              "and no address-space limit holds this process.")
    return True


@functools.lru_cache(maxsize=None)
def _mkl_free_buffers() -> Optional[Callable[[], None]]:
    if not torch.backends.mkl.is_available():
        return None
    try:  # torch's CPU wheels link MKL into libtorch_cpu and export its service functions
        return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).mkl_serv_free_buffers
    except (OSError, AttributeError):
        return None


def free_mkl_buffers() -> bool:
    """Gives back the buffers Intel MKL's allocator keeps after a matrix product.

    MKL keeps the work buffers of each product shape it has run. A probe runs several batch
    sizes, so without this its process holds the buffers of every size it tried, which a
    process training one size never has: 5-11 MiB on a 2-layer Llama with a 32K vocabulary,
    enough to make the true maximum run out of memory in the probe. Frees caches only; MKL
    allocates what the next product needs, and no setting changes.

    Returns:
        Whether this torch has MKL's function (``False`` on builds without MKL).
    """
    free = _mkl_free_buffers()
    if free is None:
        return False
    free()
    return True


# Where torch reads the caching allocator's settings (the second is the newer, device-neutral name).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def prepare_allocator(device: torch.device, *, probing: bool, max_memory: MemorySpec = None) -> None:
    """The allocator settings a recipe's batch needs to hold from step to step, each said in
    one line: on CPU under an address-space limit (the process's, or the probe's own),
    glibc's cache of freed blocks would count against it (:func:`return_freed_memory_to_os`);
    on CUDA, when probing, the caching allocator's split blocks would make the probed batch
    fail its second step (:func:`use_expandable_segments`). For what trains in the process it
    probes (the recipes, :class:`~adaptive_batch.AdaptiveBatch`, the Hugging Face trainer): the
    settings last for the process; :func:`~adaptive_batch.find_max_batch_size` makes the CPU ones
    under a hard budget only (its caller trains on the answer).

    Args:
        device: where the run trains.
        probing: whether the run probes its batch.
        max_memory: the run's ``max_memory``: a size at most half the machine's headroom
            needs no CPU setting to probe (:func:`probe_guard_needs_no_allocator_setting`).
    """
    # Probing on CPU runs its trials under an address-space limit of its own (see
    # adaptive_batch.probe.service.trial_address_space); near the budget it needs the same settings.
    if device.type == "cpu" and _cpu_needs_allocator_settings(probing, max_memory) and return_freed_memory_to_os():
        logs.info(
            "CPU allocator: glibc M_MMAP_THRESHOLD=256KiB and M_ARENA_MAX=1 for this run, so address space follows "
            "live memory under a memory limit and the probed batch holds from step to step."
        )
    if device.type == "cuda" and probing:
        use_expandable_segments()


def prepare_allocator_for_a_hard_budget(device: torch.device, *, soft_budget: bool) -> None:
    """Under a hard CPU budget, :func:`prepare_allocator`'s settings where nobody set them yet
    (its caller trains on the answer: under glibc's defaults a step's peak moved by 100 MiB from
    process to process). They are missing where the library is called alone, or where a size far
    below the machine when the run set up became hard once the model loaded; the recipes, the
    Trainer and :class:`~adaptive_batch.AdaptiveBatch` have set and said them otherwise."""
    if device.type == "cpu" and not soft_budget and glibc_mmap_threshold_set() is None:
        prepare_allocator(device, probing=True)


def _cpu_needs_allocator_settings(probing: bool, max_memory: MemorySpec) -> bool:
    return address_space_limit() is not None or (probing and not probe_guard_needs_no_allocator_setting(max_memory))


def probe_guard_needs_no_allocator_setting(max_memory: MemorySpec) -> bool:
    """Whether a CPU probe under the soft budget ``max_memory`` (a size, no limit over the
    process) runs its trials on glibc's defaults: its steps are judged by live tensor bytes, and
    its guard (the machine's headroom in address space, past which a trial fails to allocate)
    is at least twice the budget, beyond what glibc's kept blocks add to a step's live memory
    (read when the run sets up; a budget the loaded model leaves over the headroom is hard, and
    the probe then sets them: :func:`prepare_allocator_for_a_hard_budget`).
    The recipes' settings map every block over 256 KiB afresh (12 steps of the tiny config at
    batch 8 took 10.0 s against 6.5 s, with 13x the page faults). A fraction of the
    device, or none, puts the budget at the guard itself: the settings stay."""
    if max_memory is None or memory_fraction(max_memory) is not None:
        return False
    try:
        budget = parse_memory(max_memory)
    except ValueError:
        return False  # a spec the run refuses, or several ranks' budgets: the settings, as before
    return 2 * budget <= cpu_capacity().headroom_bytes


def use_expandable_segments() -> bool:
    """Turns on the CUDA caching allocator's expandable segments, unless the user chose.

    With fixed-size segments, memory freed by one training step stays split into blocks the
    next step's larger tensors cannot reuse. On an H200 the 152K-vocabulary model at the probed
    batch of 438 ran its first step, then failed the second needing 7.9 GiB with 7.8 GiB
    "reserved but unallocated"; with expandable segments every step ran and the reserved peak
    stayed within 0.3 GiB of the allocated one, so the probe's batch holds across steps. What
    was set is said at INFO; a ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) that turns
    them off, or a torch without a setter, at WARNING.

    Returns:
        Whether expandable segments are on.
    """
    settings = {name: os.environ.get(name, "").replace(" ", "") for name in ALLOC_CONF_VARS}
    if any("expandable_segments:True" in value for value in settings.values()):
        return True
    for name, value in settings.items():
        if "expandable_segments:False" in value:
            logs.warning(
                f"{name}={value} turns the CUDA allocator's expandable segments off: fragmentation between steps "
                "can make the probed batch run out of memory after its first step (the OOM recovery then halves "
                "it); remove expandable_segments:False to keep the probed batch."
            )
            return False
    # Private setters: torch 2.9+ has the first, earlier releases the second (2.11 and 2.13 tested).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if setter is None:
        logs.warning(
            f"torch {torch.__version__} has no allocator-settings setter this library knows, so expandable segments "
            "stay as they are: the probed batch may run out of memory after its first step (the OOM recovery then "
            "halves it); start the run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to keep it."
        )
        return False
    setter("expandable_segments:True")
    logs.info(
        "CUDA allocator: expandable_segments:True, so memory freed by one step fits the next step's tensors "
        "(set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False to keep fixed segments)."
    )
    return True


def device_name(device: torch.device) -> str:
    """What kind of device this is, for cache keys: the CUDA card's name, or the CPU model."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return f"cpu:{line.split(':', 1)[1].strip()}"
        except OSError:
            pass
    return device.type
