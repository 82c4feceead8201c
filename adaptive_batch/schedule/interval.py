"""When the batch increase function is called: every epoch, or every N steps, samples or tokens.

LLM fine-tuning runs are one to three epochs long, so growth that waits for an epoch boundary
happens once or twice. Runs that ramp their batch schedule it in training progress instead
(Megatron's ``--rampup-batch-size`` in samples, GPT-3 and OLMo-core in tokens, Composer in
tokens, samples or batches). :class:`GrowthInterval` is that setting: ``"epoch"`` or
``"<N> steps"``, ``"<N> samples"``, ``"<N> tokens"``.

Boundary ``k`` (0-based) lies at ``k * N`` steps, samples or tokens of the whole run (all
ranks), so boundary 0 is the start of training. A step that crosses one or more boundaries
calls the function once for each of them after the step; the new batch takes effect at the
next step.
"""

from dataclasses import dataclass
import re
from typing import Literal

from adaptive_batch.errors import ConfigError

KEY = "batch_increase_interval"
UNITS = ("steps", "samples", "tokens")

_PATTERN = re.compile(r"^\s*(\d+)\s+(step|steps|sample|samples|token|tokens)\s*$")


@dataclass(frozen=True)
class GrowthInterval:
    """Every how much training the batch increase function is called.

    Attributes:
        unit: ``"epoch"``, or what ``every`` counts.
        every: steps, samples or tokens between boundaries (1 for epochs).
    """

    unit: Literal["epoch", "steps", "samples", "tokens"] = "epoch"
    every: int = 1

    @property
    def per_epoch(self) -> bool:
        return self.unit == "epoch"

    def index(self, *, steps: int, samples: int, tokens: int) -> int:
        """The last boundary reached after this much training (0 at the start)."""
        progress = {"steps": steps, "samples": samples, "tokens": tokens}[self.unit]
        return int(progress) // self.every

    def describe(self, k: int) -> str:
        """Where boundary ``k`` lies, for the log."""
        if self.per_epoch:
            return f"epoch {k}"
        return f"interval {k} ({k * self.every} {self.unit})"

    def __str__(self) -> str:
        return "epoch" if self.per_epoch else f"{self.every} {self.unit}"


def parse_interval(value: object) -> GrowthInterval:
    """Reads ``batch_increase_interval``: ``"epoch"`` or ``"<N> steps|samples|tokens"``.

    Raises:
        ConfigError: naming the value and the accepted forms.
    """
    if isinstance(value, GrowthInterval):
        return value
    text = value.strip().lower() if isinstance(value, str) else None  # "2 Steps" as "2 steps"
    if text == "epoch":
        return GrowthInterval()
    match = _PATTERN.match(text) if text is not None else None
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(
            f"{KEY}={value!r} is not an interval: use epoch, or a positive count and a unit, "
            f"e.g. {KEY}='100 steps', '50000 samples' or '10000000 tokens'; to grow every N epochs, keep "
            "epoch and give the growth function every_n_epochs (adaptive_batch.linear_ramp(8, every_n_epochs=2))."
        )
    unit = match.group(2) if match.group(2).endswith("s") else match.group(2) + "s"
    return GrowthInterval(unit=unit, every=int(match.group(1)))
