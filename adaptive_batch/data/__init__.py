"""The data side: batch samplers that follow a changing batch, by samples or by tokens.

``layout`` (``BatchLayout``: a batch of any structure, its size and its micro-batches),
``samplers`` (the resizable batch sampler), ``token_budget`` (token-budget
batches), ``lengths`` (per-sample token counts, cached), ``worst_case`` (the worst-case batch
from a dataset's own samples, padded where real batches are).
"""
