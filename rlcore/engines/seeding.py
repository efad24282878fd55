"""Sampling seeds derived from where a sample sits in a run, and the ``trainer.deterministic`` switch.

Why derived seeds: a running RNG stream (the HF engine's own, vLLM's global one) is state a
checkpoint would have to hold, on every rank, and replay exactly. A seed that is a pure function of
(run seed, prompt batch index, rank, call, row) needs nothing saved: a resumed run draws for step 3
what an uninterrupted run drew for step 3. The driver puts the batch's seed in
``meta_info["seed"]`` (``SamplingSettings.seed``); each synchronous engine turns it into the seed of
one call (``CallSeeds``) and, for vLLM, of each row.
"""

from __future__ import annotations

import os

import numpy as np
import torch


def derive_seed(*keys: int) -> int:
    """A 63-bit seed mixed from integer keys (numpy's ``SeedSequence``): neighbouring keys, e.g. two
    consecutive steps, give unrelated seeds, unlike ``seed + step``."""
    state = np.random.SeedSequence([int(k) % 2**64 for k in keys]).generate_state(1, np.uint64)
    return int(state[0] >> np.uint64(1))


class CallSeeds:
    """One engine's call seeds: ``next(seed)`` is ``derive_seed(seed, rank, k)`` for the k-th call in a
    row with the same ``seed``.

    Why count: a multi-turn rollout generates every turn of a step with the step's settings, so
    one seed; counting the repeats keeps turn 2 from reusing turn 1's noise. The count restarts at
    another seed, so it depends only on the calls of the current step, which a resumed run repeats.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._last: int | None = None
        self._count = 0

    def next(self, seed: int) -> int:
        self._count = self._count + 1 if seed == self._last else 0
        self._last = seed
        return derive_seed(seed, self.rank, self._count)


CUBLAS_WORKSPACE = ":4096:8"  # what torch's deterministic mode needs of cuBLAS (CUDA >= 10.2)


def set_deterministic(on: bool, device: str | torch.device = "cpu") -> None:
    """``trainer.deterministic``: torch's deterministic algorithms (an op without one raises instead of
    running nondeterministically), cuDNN without autotuning, and on CUDA the cuBLAS workspace that
    deterministic matmuls need plus vLLM's batch-invariant kernels (set before vLLM is imported; they
    need compute capability >= 9.0). Off: nothing is changed."""
    if not on:
        return
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    if torch.device(device).type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
