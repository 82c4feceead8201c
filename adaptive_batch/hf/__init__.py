"""Hugging Face integration (the ``[hf]`` extra): :class:`AdaptiveBatchTrainer`, transformers'
``Trainer`` with its per-device batches probed before training.

Importing :mod:`adaptive_batch` does not import this sub-package (nor transformers).
"""

from adaptive_batch.hf.trainer import AdaptiveBatchTrainer

__all__ = ["AdaptiveBatchTrainer"]
