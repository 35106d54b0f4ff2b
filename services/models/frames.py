"""What decoded pixels add up to, for the output check: whether all were finite,
and their standard deviation, summed chunk by chunk (a video's frames are checked
as they are decoded, never held in floating point all at once)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class FrameStats:
    finite: bool = True
    count: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, unit: torch.Tensor) -> None:
        """Pixels in [0, 1] (NaN and infinity are noted, then left out)."""
        finite = torch.isfinite(unit)
        self.finite = self.finite and bool(finite.all())
        values = unit[finite].double()
        self.count += values.numel()
        self.total += float(values.sum())
        self.squares += float((values * values).sum())

    @property
    def std(self) -> float:
        if self.count < 2:
            return 0.0
        mean = self.total / self.count
        return math.sqrt(max(self.squares / self.count - mean * mean, 0.0) * self.count / (self.count - 1))

    def fault(self, min_std: float) -> str:
        """Why no output should be made of these pixels; empty when fine."""
        if not self.finite:
            return "decoded pixels contain NaN or infinity"
        if self.std < min_std:
            return f"decoded pixels are degenerate: standard deviation {self.std:.2e} < {min_std:.0e}"
        return ""
