"""A training run's batch decisions (``session.BatchSession``) and what executes them
(``controller.AdaptiveBatchController``, the recipes' adapter; ``loop.AdaptiveBatch``).

``progress`` (``BatchProgress``: the batch and the run's progress, the session's one state),
``options`` (every setting and the rules for how they combine), ``start`` (the first batch),
``grower`` (growth and the noise scale), ``lr_coupling`` (the session's LR factors set in the
optimizer), ``step`` (a step in micro-batches, rerun smaller after an OOM), ``batching``
(sample-count or token-budget batches), ``step_checkpoints`` (checkpoints inside an epoch).
"""
