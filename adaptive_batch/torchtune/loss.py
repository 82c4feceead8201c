"""The language-modelling loss of one batch, as torchtune's recipes compute it."""

import contextlib
from typing import ContextManager, Dict, Optional

import torch
from torch import nn
import torch.nn.functional as F


def next_token_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: Dict[str, torch.Tensor],
    context: Optional[ContextManager] = None,
) -> torch.Tensor:
    """Forward of ``batch`` and the loss of predicting each next token.

    ``batch["labels"]`` is popped (the model takes the rest as keyword arguments) and shifted
    left by one, the last position predicting nothing. A loss that takes chunked logits (a
    list, ``CEWithChunkedOutputLoss``) gets them as they are.

    Args:
        model: the decoder.
        loss_fn: a loss with ``ignore_index``, normalised per counted token.
        batch: ``tokens``, ``labels`` and whatever else the model takes.
        context: entered around the forward only (torchtune's activation offloading).

    Returns:
        The loss, per counted token.
    """
    labels = batch.pop("labels")
    with context if context is not None else contextlib.nullcontext():
        logits = model(**batch)
    labels = F.pad(labels[..., 1:], (0, 1), value=loss_fn.ignore_index)
    if not isinstance(logits, list):
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    loss = loss_fn(logits, labels)
    # free logits otherwise it peaks backward memory
    del logits
    return loss
