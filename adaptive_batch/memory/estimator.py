"""The memory-delta estimators: one line ``peak(b) = fixed + per_sample * b`` through a step's
peaks, or the largest of one line per phase of the step."""

from dataclasses import asdict, dataclass
import math
from typing import Dict, Mapping, Optional, Sequence, Tuple


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


@dataclass(frozen=True)
class PhaseMemoryEstimate:
    """A step's peak as the largest of its phases' lines: ``max_i(fixed_i + per_sample_i * b)``.

    One line through step peaks fails when a phase that does not grow with the batch (the
    optimizer step over a large embedding, a chunked loss's fp32 buffers) sets the peak at
    batch 1 and 2: the line comes out nearly flat and predicts far too large a batch. A line
    per phase keeps the growing phase's slope.

    Attributes:
        phases: each phase's line, by name.
    """

    phases: Dict[str, LinearMemoryEstimate]

    @classmethod
    def fit(cls, points: Sequence[Tuple[int, Mapping[str, int]]]) -> "PhaseMemoryEstimate":
        """A line per phase through ``(batch_size, {phase: peak_bytes})`` points; a phase
        takes part when every point measured it.

        Raises:
            ValueError: with fewer than two distinct batch sizes, or no phase in every point.
        """
        names = set.intersection(*(set(peaks) for _, peaks in points)) if points else set()
        if not names:
            raise ValueError("the phase estimate needs the same phases measured at every batch size")
        return cls({name: LinearMemoryEstimate.fit([(b, peaks[name]) for b, peaks in points]) for name in sorted(names)})

    def peak_bytes(self, batch_size: int) -> int:
        """Predicted peak of a step at ``batch_size``: its largest phase."""
        return max(line.peak_bytes(batch_size) for line in self.phases.values())

    def binding_phase(self, batch_size: int) -> str:
        """The phase whose line is highest at ``batch_size``."""
        return max(self.phases, key=lambda name: self.phases[name].peak_bytes(batch_size))

    def max_batch_size(self, budget_bytes: int) -> Optional[int]:
        """Largest batch whose every phase is predicted within ``budget_bytes``.

        Returns:
            The batch size (0 when not even batch 1 fits), or ``None`` when no phase grows
            with the batch and all fit, so the lines set no bound.
        """
        bounds = []
        for line in self.phases.values():
            bound = line.max_batch_size(budget_bytes)
            if bound is None and line.fixed_bytes > budget_bytes:
                bound = 0
            if bound is not None:
                bounds.append(bound)
        return min(bounds) if bounds else None

    @property
    def fixed_bytes(self) -> int:
        """The line that binds far out: the steepest phase's (for reports and plots)."""
        return self._binding_line().fixed_bytes

    @property
    def bytes_per_sample(self) -> int:
        return self._binding_line().bytes_per_sample

    def _binding_line(self) -> LinearMemoryEstimate:
        growing = [line for line in self.phases.values() if line.bytes_per_sample > 0]
        if not growing:
            return max(self.phases.values(), key=lambda line: line.fixed_bytes)
        # Far out, the steepest phase is the highest one.
        return max(growing, key=lambda line: (line.bytes_per_sample, line.fixed_bytes))

    def to_dict(self) -> dict:
        return {
            "fixed_bytes": self.fixed_bytes,
            "bytes_per_sample": self.bytes_per_sample,
            "phases": {name: line.to_dict() for name, line in self.phases.items()},
        }


@dataclass(frozen=True)
class OperatorMemoryEstimate:
    """A step's peak as the largest of one line per operator of the step.

    A step runs the same operators in the same order at every batch size, and what is alive
    after each of them grows linearly with the batch. So the live bytes after operator ``i``
    at two batch sizes give ``line_i``, and ``peak(b) = max_i line_i(b)`` wherever the peak of
    the step falls: at batch 1 it may be the optimizer step, at batch 10 the start of the
    backward through a large vocabulary's logits. Exact when every tensor's size is affine in
    the batch; refused when the two steps did not run the same number of operators.

    Attributes:
        fixed: each operator's line at batch 0.
        per_sample: each operator's bytes per sample.
    """

    fixed: Tuple[int, ...]
    per_sample: Tuple[int, ...]

    @classmethod
    def fit(
        cls,
        first: Tuple[int, Sequence[int]],
        second: Tuple[int, Sequence[int]],
        operators: Optional[Tuple[Sequence[object], Sequence[object]]] = None,
    ) -> "OperatorMemoryEstimate":
        """Lines through two ``(batch_size, timeline)`` measurements.

        Args:
            first: a batch size and the live bytes after each operator of its step.
            second: the same at another batch size.
            operators: the two steps' operators, when known, which must be the same.

        Raises:
            ValueError: when the batch sizes are equal or the steps ran different operators.
        """
        (b1, t1), (b2, t2) = first, second
        same = len(t1) == len(t2) and (operators is None or list(operators[0]) == list(operators[1]))
        if b1 == b2 or not same or not t1:
            raise ValueError(
                f"operator lines need two batch sizes with the same operators, got batch {b1} with "
                f"{len(t1)} operators and batch {b2} with {len(t2)}"
            )
        per_sample = tuple(int(round((y2 - y1) / (b2 - b1))) for y1, y2 in zip(t1, t2))
        fixed = tuple(int(y1 - s * b1) for y1, s in zip(t1, per_sample))
        return cls(fixed, per_sample)

    def peak_bytes(self, batch_size: int) -> int:
        return max(f + s * batch_size for f, s in zip(self.fixed, self.per_sample))

    def max_batch_size(self, budget_bytes: int) -> Optional[int]:
        """Largest batch whose every operator is predicted within ``budget_bytes``; ``None``
        when nothing grows with the batch and all fits."""
        bound: Optional[int] = None
        for f, s in zip(self.fixed, self.per_sample):
            if s > 0:
                here = max(0, math.floor((budget_bytes - f) / s))
            elif f > budget_bytes:
                here = 0
            else:
                continue
            bound = here if bound is None else min(bound, here)
        return bound

    def _binding(self, batch_size: int) -> int:
        return max(range(len(self.fixed)), key=lambda i: self.fixed[i] + self.per_sample[i] * batch_size)

    def line_at(self, batch_size: int) -> LinearMemoryEstimate:
        """The line of the operator whose memory is highest at ``batch_size``."""
        i = self._binding(batch_size)
        return LinearMemoryEstimate(self.fixed[i], self.per_sample[i])

    def to_dict(self, batch_size: int = 1) -> dict:
        line = self.line_at(batch_size)
        return {
            "fixed_bytes": line.fixed_bytes,
            "bytes_per_sample": line.bytes_per_sample,
            "operators": len(self.fixed),
            "binding_operator": self._binding(batch_size),
        }
