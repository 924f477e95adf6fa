"""`SamplingParams`: per-request generation settings, plain data (the scheduler imports no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flashx_batch.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (the job config's `sampling.*`). temperature 0 = greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):  # nan empties every text, inf samples noise
                raise ConfigError(f"sampling.{name}={getattr(self, name)} is not a finite number.")
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature must be >= 0, got {self.temperature}.")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p}.")
        if any(not s for s in self.stop):
            raise ConfigError("sampling.stop must not contain an empty string.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
