"""What a device holds and what a step takes of it.

``device`` (capacity, ``max_memory``, allocator settings), ``budget`` (the one budget, soft or
hard, and how its trials are guarded), ``tracker`` (a step's peak, per
operator on CPU), ``estimator`` (lines through measured peaks), ``oom`` (the one
out-of-memory predicate and catch helper).
"""
