"""Finding the largest batch that fits, with real steps or fake ones.

Entry points: ``service.probe_batch_size`` (recipes and the CLI: budget, cache, ranks, report)
and ``api.find_max_batch_size`` (a plain PyTorch loop). Beneath them: ``trials`` (real steps,
measured, state put back by ``snapshot``), ``search`` (the search over trial outcomes),
``child`` (hard-limit trials in fresh processes, for ``find_max_batch_size(build=...)``),
``report`` (``ProbeReport``, the typed result every reader takes, and its versioned JSON),
``throughput``, ``cache``, ``plot``, and ``plan`` (fake-tensor steps, nothing allocated).
"""
