"""The consistency check's end-to-end probe: the engine and the trainer score one fixed sequence.

Why: the weight comparison reads the engine's weights back (``rlcore.engines.vllm_checksums``), and
some an engine cannot hand back: vLLM's packed CPU matmul kernels (the default layout: every linear
layer), MoE experts, tensor-parallel shards. Left at that, a sync that never happened, or a bucket
skipped in a layer, passes wherever only those tensors differ. Scoring a sequence runs every layer
the engine samples with, in whatever form it keeps them: after each sync on the steps the weights
are checked, every engine and the trainer's actor compute the log-probs of ``probe_ids`` (a few
dozen token ids drawn from the vocabulary with a fixed seed), and the mean of |engine - trainer|
per token is judged against ``probe_band`` for the pair of dtypes.

What it sees: a difference anywhere on the forward path of the probe's tokens (every dense weight;
only the probe's own rows of the embedding, and, in an MoE model, only the experts its tokens are
routed to). Measured (docs/correctness.md, "End-to-end probe"): on the tiny qwen3 in fp32 the clean
vLLM-vs-trainer difference is ~1e-7 per token; an engine left one GRPO step behind (lr 1e-5) is
8e-4 away, at lr 1e-6 8e-5 (SmolLM2-135M: clean 2e-6..1e-5, one step at lr 1e-6 9e-4).

``check/weights_covered``: the share of the trainer's parameter elements the check verifies this
step, read back (``check/weights_read_back``) or, for the tensors the engine cannot hand back, through
the probe; the run's log says once which tensors only the probe covers.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlcore.engines.weights import layer_of

PROBE_TOKENS = 48
PROBE_SEED = 39  # the issue that asked for it: a fixed sequence, the same in every run
# The band: the mean |engine - trainer| log-prob per probe token that clean weights stay within.
# Calibrated: at the start (``ProbeCheck.calibrate``), when engine and trainer hold the same weights
# by construction, the probe measures this run's own noise (kernels, dtypes, model); the band is
# CALIBRATION_FACTOR times that, and never below the dtype pair's floor. Measured (2-core CPU):
# fp32 both sides, tiny qwen3 (vLLM and HF engines) ~1.2e-7; SmolLM2-135M 2.0e-6 (HF engine), 1.1e-5
# (vLLM); a bf16 HF engine against the fp32 trainer: tiny 1e-3, SmolLM2 0.066.
CALIBRATION_FACTOR = 5.0
FP32_FLOOR = 2e-6
LOW_PRECISION_FLOOR = 2e-2
LOW = ("bfloat16", "float16")
SUSPECT_CALIBRATION = 50.0  # a calibration this many times the floor: the weights were likely not the same


def probe_ids(vocab_size: int, length: int = PROBE_TOKENS, seed: int = PROBE_SEED) -> list[int]:
    """The probe sequence: ``length`` token ids uniform over the vocabulary, from a fixed seed."""
    if vocab_size < 2 or length < 2:
        raise ValueError(f"a probe needs a vocabulary of >= 2 ids and >= 2 tokens, got {vocab_size}, {length}")
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def model_vocab_size(path: str) -> int:
    """The vocabulary size in a HF model directory's config (the ids a probe may draw)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)


def probe_band(engine_dtype: str | None, trainer_dtype: str | None, baseline: float | None = None) -> float:
    """The mean |engine - trainer| log-prob per probe token allowed for this pair of dtypes, given the
    run's calibrated ``baseline`` (the same measure with identical weights; None: not calibrated)."""
    floor = LOW_PRECISION_FLOOR if engine_dtype in LOW or trainer_dtype in LOW else FP32_FLOOR
    return max(floor, CALIBRATION_FACTOR * baseline) if baseline is not None else floor


@dataclass
class ProbeReport:
    """One probe: the worst engine's difference from the trainer."""

    step: int
    tokens: int
    abs_diff_mean: float  # the worst engine's mean |engine - trainer| over the probe's tokens
    abs_diff_max: float
    band: float
    engine: int  # which engine that is
    engine_dtype: str
    trainer_dtype: str

    @property
    def ok(self) -> bool:
        return self.abs_diff_mean <= self.band

    def metrics(self) -> dict[str, float]:
        return {"check/probe_abs_diff_mean": self.abs_diff_mean, "check/probe_abs_diff_max": self.abs_diff_max,
                "check/probe_band": self.band}

    def finding(self) -> str:
        return (f"probe sequence log-probs: mean |engine - trainer| {self.abs_diff_mean:.3g} > {self.band:g} "
                f"(engine {self.engine}, {self.tokens} tokens, engine {self.engine_dtype} / trainer {self.trainer_dtype})")


def compare_probe(step: int, trainer: dict[str, Any], engines: Sequence[dict[str, Any]],
                  band: Callable[..., float] = probe_band, baselines: Sequence[float] | None = None) -> ProbeReport:
    """``trainer`` and each engine: ``{"log_probs": [...], "dtype": ...}`` for the same ids; ``baselines``:
    each engine's calibrated difference (``ProbeCheck.calibrate``)."""
    ref = torch.tensor(trainer["log_probs"], dtype=torch.float64)
    worst = None
    for i, engine in enumerate(engines):
        got = torch.tensor(engine["log_probs"], dtype=torch.float64)
        if got.shape != ref.shape:
            raise ValueError(f"engine {i} scored {got.numel()} probe tokens, the trainer {ref.numel()}")
        diff = (got - ref).abs()
        allowed = band(engine["dtype"], trainer["dtype"], baselines[i] if baselines else None)
        report = ProbeReport(step, ref.numel(), float(diff.mean()), float(diff.max()), allowed, i,
                             engine["dtype"], trainer["dtype"])
        if worst is None or report.abs_diff_mean / allowed > worst.abs_diff_mean / worst.band:
            worst = report
    return worst


class ProbeCheck:
    """Runs the probe: ``trainer(ids)`` the actor's reply (one, or one per rank: the first is taken),
    ``engines(ids)`` one reply per engine (None from an engine that cannot score: then the probe is off
    for the run, said once). ``vocab_size``: the model's, or a callable giving it when first needed."""

    def __init__(self, trainer: Callable[[list[int]], Any], engines: Callable[[list[int]], list[Any]],
                 vocab_size: int | Callable[[], int], out: Any = None,
                 band: Callable[..., float] = probe_band) -> None:
        self.trainer, self.engines, self.band = trainer, engines, band
        self._vocab = vocab_size
        self._ids: list[int] | None = None
        self.out = out or sys.stderr
        self.off: str | None = None
        self.last: ProbeReport | None = None
        self.seconds = 0.0  # the last probe's cost, both sides
        # where its notes go: (cause, text); the run's check sets its own, which also keeps them (check.jsonl)
        self.note: Callable[[str, str], None] = lambda cause, text: print(f"consistency check: {text}", file=self.out,
                                                                          flush=True)
        self.baselines: list[float] | None = None  # each engine's difference with identical weights

    def calibrate(self) -> list[float] | None:
        """Measure the run's own noise: call it where engine and trainer hold the same weights (before
        the first update, after a resume's sync). The bands are then ``probe_band(..., baseline)``."""
        ids = self.ids()
        engines, trainer = self._replies(ids)
        if engines is None:
            return None
        ref = torch.tensor(trainer["log_probs"], dtype=torch.float64)
        self.baselines = [float((torch.tensor(e["log_probs"], dtype=torch.float64) - ref).abs().mean()) for e in engines]
        for i, (engine, base) in enumerate(zip(engines, self.baselines)):
            floor = self.band(engine["dtype"], trainer["dtype"], None)
            if base > SUSPECT_CALIBRATION * floor:  # the noise floor it sets would hide real faults: say so
                self.note("probe_calibration", f"the probe's calibration found engine {i} {base:.3g} nats per token "
                          f"from the trainer where both should hold the same weights ({SUSPECT_CALIBRATION:g}x the "
                          f"{engine['dtype']}/{trainer['dtype']} floor): was the engine synced before the run started? "
                          "Its probe band is that wide from now on")
        return self.baselines

    def _replies(self, ids: list[int]) -> tuple[list | None, dict | None]:
        if self.off is not None:
            return None, None
        engines = self.engines(ids)
        if not engines or any(reply is None for reply in engines):
            self.off = "the rollout engine cannot score a probe sequence"
            self.note("probe_off", f"end-to-end probe off for this run ({self.off})")
            return None, None
        trainer = self.trainer(ids)
        return engines, trainer[0] if isinstance(trainer, list) else trainer

    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = probe_ids(self._vocab() if callable(self._vocab) else self._vocab)
        return self._ids

    def run(self, step: int) -> ProbeReport | None:
        start = time.perf_counter()
        engines, trainer = self._replies(self.ids())
        if engines is None:
            return None
        if self.baselines is not None and len(self.baselines) != len(engines):
            raise ValueError(f"the probe was calibrated on {len(self.baselines)} engine(s), now {len(engines)} answer")
        self.last = compare_probe(step, trainer, engines, self.band, self.baselines)
        self.seconds = time.perf_counter() - start
        return self.last


def coverage(trainer_elements: dict[str, int] | None, unreadable: Sequence[str], probed: bool) -> dict[str, float]:
    """``check/weights_read_back``: the share of the trainer's parameter elements compared with the
    engine's directly (None: no weights compared); ``check/weights_covered``: that plus, when the probe
    ran, the tensors only it reaches (those the engine could not hand back, or all of them)."""
    if trainer_elements is None:
        return {"check/weights_read_back": 0.0, "check/weights_covered": 1.0 if probed else 0.0}
    total = sum(trainer_elements.values()) or 1
    unread = sum(trainer_elements.get(name, 0) for name in unreadable)
    read = (total - unread) / total
    return {"check/weights_read_back": read, "check/weights_covered": 1.0 if probed else read}


def probe_only_note(trainer_elements: dict[str, int], unreadable: Sequence[str]) -> str:
    """The log's one line on the tensors that only the probe covers, by layer."""
    total = sum(trainer_elements.values()) or 1
    share = sum(trainer_elements.get(name, 0) for name in unreadable) / total
    units = Counter(layer_of(name) for name in unreadable)
    shown = ", ".join(f"{unit}.* ({count})" if count > 1 else unit for unit, count in list(units.items())[:6])
    more = f" and {len(units) - 6} more" if len(units) > 6 else ""
    short = sorted({name.rsplit(".", 2)[-2] for name in unreadable if name.count(".") >= 2})
    return (f"consistency check: {len(unreadable)} tensor(s), {share:.1%} of the parameters, cannot be read back "
            f"from the engine (kept only as packed CPU matmul kernels: {', '.join(short)}) and are covered only by "
            f"the end-to-end probe: {shown}{more} (rollout.cpu_weight_layout=plain makes them readable)")


def probe_diagnosis(probe: ProbeReport, weights: Any | None) -> tuple[str, str]:
    """(cause, message) for a probe out of band while the weights that could be read match (or none
    could be read): the difference lies in weights the engine keeps in a form the read-back cannot see."""
    where = f"engine {probe.engine}: mean |diff| {probe.abs_diff_mean:.3g} nats over {probe.tokens} tokens"
    if weights is None:
        return "probe_differs", (f"the probe sequence's log-probs differ between the engine and the trainer ({where}) "
                                 "and this engine's weights cannot be read back: the engine samples with other weights "
                                 "than the trainer's (not synced, or a bucket skipped or failed to load)")
    unread = getattr(weights, "unreadable", [])
    layers = sorted({layer_of(name) for name in unread})
    shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    return "weights_packed_differ", (
        f"weights the engine keeps packed differ from the trainer's (not synced / bucket skipped in a layer the "
        f"read-back cannot see): the probe sequence's log-probs differ ({where}, checked at step {probe.step}) while "
        f"the {weights.tensors} tensors that could be read back match; not read back: {len(unread)} tensor(s) in "
        f"{shown or 'no layer'}")
