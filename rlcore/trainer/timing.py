"""Wall-clock time per training stage, and tokens per second derived from it.

Knowing where a step's time goes (generation vs. log-prob recomputation vs. update) is the first
question when a run is slow, so drivers wrap each stage in `with timer("gen"):`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager


class Timer:
    """Collects named stage durations in seconds; a stage timed twice accumulates.

    ``watch``: each stage also runs as a phase of a watchdog (``Watchdog.begin`` / ``end``), which
    reports a stage that runs past its deadline (``rlcore.trainer.watchdog``)."""

    def __init__(self, watch: tuple[Callable[[str], object], Callable[[object], None]] | None = None) -> None:
        self.durations: dict[str, float] = {}
        self._watch = watch

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        watched = self._watch[0](name) if self._watch else None
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durations[name] = self.durations.get(name, 0.0) + time.perf_counter() - start
            if self._watch:
                self._watch[1](watched)  # raises the watchdog's StallError (trainer.watchdog.on_stall=fail)

    def metrics(self, prefix: str = "timing_s/") -> dict[str, float]:
        return {f"{prefix}{name}": seconds for name, seconds in self.durations.items()}

    def reset(self) -> None:
        """Start a new step: drivers call this at the top of each iteration."""
        self.durations = {}


def throughput_metrics(timings: Mapping[str, float], n_tokens: int | Mapping[str, int],
                       num_devices: int = 1) -> dict[str, float]:
    """Tokens per second per device for each timed stage: "throughput/<stage>".

    `n_tokens` is one count for every stage (e.g. all prompt+response tokens of the batch) or a
    count per stage (e.g. only generated tokens for "gen"); stages without a count, or with no
    measurable time, are left out.
    """
    if num_devices <= 0:
        raise ValueError(f"num_devices must be positive, got {num_devices}")
    out = {}
    for stage, seconds in timings.items():
        tokens = n_tokens.get(stage) if isinstance(n_tokens, Mapping) else n_tokens
        if tokens is None or seconds <= 0:
            continue
        out[f"throughput/{stage}"] = tokens / (seconds * num_devices)
    return out
