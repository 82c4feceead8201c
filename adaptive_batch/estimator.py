"""The memory-delta linear estimator: ``peak(b) = fixed + per_sample * b``."""

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Tuple


@dataclass(frozen=True)
class LinearMemoryEstimate:
    """A straight line through measured step peaks.

    Attributes:
        fixed_bytes: what a step needs whatever the batch (parameters, gradients, optimizer
            state, workspace).
        bytes_per_sample: what each more sample adds (activations, logits).
    """

    fixed_bytes: int
    bytes_per_sample: int

    @classmethod
    def fit(cls, points: Sequence[Tuple[int, int]]) -> "LinearMemoryEstimate":
        """Least-squares line through ``(batch_size, peak_bytes)`` points.

        Raises:
            ValueError: with fewer than two distinct batch sizes.
        """
        sizes = {b for b, _ in points}
        if len(sizes) < 2:
            raise ValueError(
                f"the linear estimate needs peaks at two or more batch sizes, got {sorted(sizes)}"
            )
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_p = sum(p for _, p in points) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in points)
        cov = sum((b - mean_b) * (p - mean_p) for b, p in points)
        slope = cov / var_b
        return cls(fixed_bytes=int(round(mean_p - slope * mean_b)), bytes_per_sample=int(round(slope)))

    def peak_bytes(self, batch_size: int) -> int:
        """Predicted peak of a step at ``batch_size``."""
        return self.fixed_bytes + self.bytes_per_sample * batch_size

    def max_batch_size(self, budget_bytes: int) -> Optional[int]:
        """Largest batch whose predicted peak is within ``budget_bytes``.

        Returns:
            The batch size (0 when not even batch 1 fits), or ``None`` when the peak does not
            grow with the batch, so the line sets no bound.
        """
        if self.bytes_per_sample <= 0:
            return None
        return max(0, math.floor((budget_bytes - self.fixed_bytes) / self.bytes_per_sample))

    def to_dict(self) -> dict:
        return asdict(self)
