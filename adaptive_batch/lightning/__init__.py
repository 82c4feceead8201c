"""Lightning integration (the ``[lightning]`` extra): :class:`AdaptiveBatchFinder`, a callback in
the place of Lightning's ``BatchSizeFinder``, and :func:`find_batch_size`, in the place of
``Tuner.scale_batch_size``.

Importing :mod:`adaptive_batch` does not import this sub-package (nor Lightning).
"""

from typing import Any, Optional

from lightning.pytorch import LightningDataModule, LightningModule, Trainer

from adaptive_batch.lightning.finder import AdaptiveBatchFinder


def find_batch_size(trainer: Trainer, model: LightningModule, *, train_dataloaders: Any = None,
                    datamodule: Optional[LightningDataModule] = None, **finder: Any) -> int:
    """The largest batch that trains, found as ``trainer.fit`` would start and set where Lightning
    reads it, with no training step: ``Tuner(trainer).scale_batch_size`` with the probe.

    Args:
        trainer: the trainer the fit will run on.
        model: the module to fit.
        train_dataloaders: as ``trainer.fit`` takes them.
        datamodule: as ``trainer.fit`` takes it.
        **finder: :class:`AdaptiveBatchFinder`'s keyword arguments (``max_memory``, ``batch_arg_name``, ...).

    Returns:
        The batch size, also set on the module (or its hparams or the datamodule).

    Raises:
        ConfigError: see :class:`AdaptiveBatchFinder`.
    """
    callback = AdaptiveBatchFinder(stop_after=True, **finder)
    trainer.callbacks.append(callback)
    try:
        trainer.fit(model, train_dataloaders=train_dataloaders, datamodule=datamodule)
    finally:
        trainer.callbacks.remove(callback)
    return callback.optimal_batch_size


__all__ = ["AdaptiveBatchFinder", "find_batch_size"]
