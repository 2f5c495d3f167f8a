"""Dynamic loss scaling for float16: halve the scale on overflow (skipping the step), grow it after a run
of clean steps. The same rule as `torch.amp.GradScaler`, applied to gradients that live on the host, with
a floor: a scale that underflows to 0 (or a denormal) would turn every later gradient into zeros, and a
run whose gradients overflow at the floor keeps skipping steps visibly (`skipped` counts them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScale:
    """Current scale and the count of overflow-free steps since the last change."""

    scale: float
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    clean_steps: int = 0
    min_scale: float = 1.0
    skipped: int = 0

    def update(self, *, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
