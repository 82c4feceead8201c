"""A training run's batch decisions, behind ``controller.AdaptiveBatchController``.

``options`` (every setting and the rules for how they combine), ``start`` (the first batch),
``grower`` (growth and the noise scale), ``lr_coupling`` (the LR set for each step's batch),
``step`` (a step in micro-batches, rerun smaller after an OOM), ``batching`` (sample-count or
token-budget batches), ``step_checkpoints`` (checkpoints inside an epoch).
"""
