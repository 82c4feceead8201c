"""Per-example gradient norms of the normalisation layers: the noise scale on every step.

:class:`~adaptive_batch.schedule.noise_scale.MicroBatchGradients` needs two or more
micro-batches a step and a float32 copy of all the gradients. Gray et al. 2024 ("Normalization
Layer Per-Example Gradients are Sufficient to Predict Gradient Noise Scale in Transformers",
arXiv 2411.00999) measure it from the LayerNorm/RMSNorm weights alone, whose per-example
gradients cost a few elementwise passes over activations the step already has: for
``y = xhat * w (+ b)`` example ``i``'s gradient is ``sum_t g_it * xhat_it`` (and ``sum_t g_it``),
where ``g`` is the gradient flowing into ``y``. Each example is then a "small batch" of its own
tokens and the step is the big one, in :func:`~adaptive_batch.schedule.noise_scale.estimate_noise`'s
formula, on one micro-batch or many.

Batch normalisation couples the examples of a batch, so it has no per-example gradient here:
a model without LayerNorm or RMSNorm is refused in one line.
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn

from adaptive_batch.errors import ConfigError
from adaptive_batch.schedule.noise_scale import StepNoise, estimate_noise_from_means, local_tensor


@dataclass(frozen=True)
class _NormLayer:
    """How one normalisation layer normalises, and its affine parameters."""

    module: nn.Module
    weight: nn.Parameter
    bias: Optional[nn.Parameter]
    eps: Optional[float]  # None: the machine epsilon nn.RMSNorm(eps=None) computes with
    rms: bool  # RMSNorm (no centring) or LayerNorm
    dims: int  # trailing dimensions normalised over

    def normalised(self, x: torch.Tensor) -> torch.Tensor:
        """``xhat`` in float32, as the layer computed it (its eps, its dimensions)."""
        # nn.RMSNorm(eps=None) computes bf16/fp16 in float32 and takes float32's epsilon.
        eps = self.eps if self.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
        x = x.float()
        reduce = tuple(range(-self.dims, 0))
        if not self.rms:
            x = x - x.mean(reduce, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(reduce, keepdim=True) + eps)


def _affine_parameter(module: nn.Module, names: Sequence[str]) -> Optional[nn.Parameter]:
    for name in names:
        p = getattr(module, name, None)
        if isinstance(p, nn.Parameter):
            return p
    return None


def find_norm_layers(model: nn.Module) -> List[_NormLayer]:
    """The model's LayerNorm and RMSNorm layers with a trainable elementwise weight: torch's
    ``nn.LayerNorm`` and ``nn.RMSNorm``, and any module whose class name ends in ``RMSNorm``
    with an ``eps`` or ``variance_epsilon`` and a ``weight`` or ``scale`` (torchtune's,
    transformers' Llama/Qwen/Mistral ones)."""
    layers = []
    for module in model.modules():
        rms = isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")
        if not (rms or isinstance(module, nn.LayerNorm)):
            continue
        weight = _affine_parameter(module, ("weight", "scale"))
        if weight is None or not weight.requires_grad:
            continue
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        bias = _affine_parameter(module, ("bias",))
        layers.append(_NormLayer(module, weight, bias if bias is not None and bias.requires_grad else None,
                                 None if eps is None else float(eps), rms, weight.dim()))
    return layers


class NormLayerGradients:
    """Each example's gradient norm over the normalisation layers' weights, from hooks, and
    the step's gradient norm over the same weights: what a step's noise scale needs, with no
    copy of the gradients and any number of micro-batches.

    An observer of :func:`~adaptive_batch.run.step.accumulate_gradients`: ``start`` at each
    attempt of a step, ``before_micro_batch`` and ``after_micro_batch`` around each backward.

    Args:
        model: the model (its norm layers are found once, by :func:`find_norm_layers`).
        row_tokens: a micro-batch's tokens that carry a loss, per example (a 1-D tensor), read
            before its forward (a loss may take the labels out of the batch).

    Raises:
        ConfigError: for a model with no LayerNorm or RMSNorm weight to read.
    """

    def __init__(self, model: nn.Module, row_tokens: Callable[[Any], torch.Tensor]) -> None:
        self.layers = find_norm_layers(model)
        if not self.layers:
            raise ConfigError(
                f"noise_scale_estimator='norm_layers' found no LayerNorm or RMSNorm with a trainable weight in "
                f"{type(model).__name__} (batch normalisation has no per-example gradient): set "
                "noise_scale_estimator='micro_batches', which compares micro-batches' gradients instead."
            )
        self.row_tokens = row_tokens
        self._handles: list = []
        self._rows: Optional[torch.Tensor] = None  # this micro-batch's per-example squared norms
        self._tokens: Optional[torch.Tensor] = None
        self.row_sq_norms: list = []  # per micro-batch, summed-loss units
        self.tokens: list = []  # per micro-batch, per example

    def attach(self) -> None:
        """Hooks every norm layer's forward (which hooks its output's gradient)."""
        if not self._handles:
            self._handles = [layer.module.register_forward_hook(self._forward_hook(layer)) for layer in self.layers]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start(self) -> None:
        """A step (or its retry) begins."""
        self.row_sq_norms, self.tokens, self._rows = [], [], None

    def before_micro_batch(self, piece: Any) -> None:
        self._tokens = self.row_tokens(piece).detach()
        self._rows = torch.zeros(self._tokens.shape[0], dtype=torch.float32, device=self._tokens.device)

    def after_micro_batch(self, tokens: Any) -> None:
        if self._rows is not None:
            self.row_sq_norms.append(self._rows)
            self.tokens.append(self._tokens)
        self._rows = None

    def step_sq_norm(self) -> torch.Tensor:
        """The step's squared gradient norm over the norm layers' weights (summed-loss units,
        this rank's shard), read after the last micro-batch and before any scaling."""
        norms = [
            local_tensor(p.grad).float().pow(2).sum()
            for layer in self.layers for p in (layer.weight, layer.bias) if p is not None and p.grad is not None
        ]
        return torch.stack(norms).sum() if norms else torch.zeros(())  # on the gradients' device: no sync per layer

    def step_noise(self, ranks: Any) -> Optional[StepNoise]:
        """The step's estimates, each example a small batch of its tokens (``None`` with fewer
        than two examples that carry a loss, on all ranks).

        Args:
            ranks: the data-parallel ranks (a :class:`~adaptive_batch.distributed.RankGroup`).
        """
        if not self.row_sq_norms:
            return None
        sq = torch.cat(self.row_sq_norms).double()
        tokens = torch.cat(self.tokens).to(sq.device).double()
        counted = tokens > 0
        sq, counted_tokens = sq[counted], tokens[counted]
        # Per-example gradients are this rank's own (not averaged over ranks); .grad is averaged.
        small, inverse, count, step_sq, step_tokens = ranks.sums(
            (sq / counted_tokens**2).sum(), (1 / counted_tokens).sum(), counted.sum(), self.step_sq_norm(),
            tokens.sum(),
        )
        if count < 2:
            return None
        big = step_sq * ranks.world_size**2 / step_tokens**2
        return StepNoise(estimate_noise_from_means(small / count, inverse / count, big, step_tokens), step_tokens)

    def _forward_hook(self, layer: _NormLayer) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return  # no backward will follow (an evaluation)
            # Outside a micro-batch (the probe's trial step) the work is done and dropped, so
            # the trial costs what training's step costs.
            rows = self._rows
            x = inputs[0].detach()

            def per_example(grad: torch.Tensor) -> None:
                g = grad.float()
                # Sum over every dimension but the example (first) and the normalised ones (last).
                middle = tuple(range(1, g.dim() - layer.dims))
                weight_grad, bias_grad = g * layer.normalised(x), g
                if middle:  # (sum over no dimension would sum them all)
                    weight_grad, bias_grad = weight_grad.sum(middle), bias_grad.sum(middle)
                sq = weight_grad.pow(2).flatten(1).sum(1)
                if layer.bias is not None:
                    sq = sq + bias_grad.pow(2).flatten(1).sum(1)
                if rows is not None:
                    rows.add_(sq.to(rows.device))

            output.register_hook(per_example)

        return hook
