"""The one memory limit every benchmark process runs under: a limit set from outside."""

import resource


def limit_address_space(headroom_bytes: int, *, recipe_allocator: bool) -> int:
    """Sets ``RLIMIT_AS`` to this process's size plus ``headroom_bytes``, as ``prlimit --as``
    would from outside, so an allocation past it fails with the allocator's real error.

    Args:
        headroom_bytes: address space allowed over what the process holds now.
        recipe_allocator: first set the glibc options the recipes and ``AdaptiveBatchTrainer``
            train with (``return_freed_memory_to_os``), so every method runs on one allocator;
            ``False`` keeps glibc's defaults, as a plain script has them.

    Returns:
        The limit in bytes.
    """
    from adaptive_batch.memory.device import proc_status_bytes, return_freed_memory_to_os

    if recipe_allocator:
        return_freed_memory_to_os()
    limit = proc_status_bytes("VmSize") + int(headroom_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    return limit
