"""One progress line per start-up phase, so a run says what it is doing before its first step.

A real model's start takes minutes (data, worker processes, model loads, the vLLM engine, the
warm-up generate of validation) with nothing else on the console. Each phase prints one line,
``[rlcore <seconds since start>s] <what>``, on stdout (flushed: a pipe or a log file sees it at once).
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

_START = time.monotonic()
PREFIX = "[rlcore"


def phase(message: str) -> None:
    """Print ``message`` as a progress line, stamped with the seconds since this process started."""
    # through tqdm: a progress bar on the console (the training bar) is cleared first and redrawn below
    tqdm.write(f"{PREFIX} {time.monotonic() - _START:6.1f}s] {message}", file=sys.stdout)
    sys.stdout.flush()
