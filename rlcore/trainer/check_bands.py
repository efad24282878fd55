"""The bands of the consistency check: how far apart a clean run's trainer and sampler log-probs are
expected to be, for the run's dtype pair and model.

Why per pair: two programs computing one model in fp32 agree to ~1e-7 nats per token; as soon as
either side computes in bf16 (8 significant bits) they differ by 1e-3..1e-1, growing with the model
(measured here: docs/correctness.md, "Bands"). A single band set for fp32 warns on every clean bf16
run, and a check that warns on every clean run gets switched off. So:

- ``pair_band``: the default band of each (engine dtype, trainer dtype) pair, set from measurements
  on the tiny models and SmolLM2-135M with both engines, with head-room; ``trainer.check.
  max_abs_diff_mean`` / ``max_out_of_band`` override it when set (null: by pair).
- ``Bands.calibrate``: the first step whose weights were compared and found identical, whose noise is
  symmetric and is not confined to later turns, and that stays inside the pair's band, measures the
  run's own noise floor. The calibrated band (``CALIBRATE_FACTOR`` x that, never below the fp32 band,
  never above the pair's) is recorded once (``check/band_*`` metrics and a line in the log). Leaving
  it makes the check compare the weights at once; only leaving the pair's band with no structural
  cause found is a "precision" warning.
- What is never absorbed into a band, whatever the pair: a one-sided difference (the same sign on
  nearly every token: top-p/top-k log-probs processed on one side only), a difference confined to
  later turns (a re-rendered template), and an engine whose dtype is not the configured one: those
  are named whenever they are seen (``structural``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlcore.workers.mismatch import CheckConfig

ONE_SIDED = 0.9  # |mean of d| / mean of |d| above this: the same sign on (nearly) every token
SYMMETRIC = 0.5  # |mean of d| / mean of |d| below this: noise that goes both ways (calibration takes only that)
LATER_TURNS = 10.0  # later turns' mean |d| this many times the first turn's: the context differs
CALIBRATE_FACTOR = 5.0  # the calibrated band: this many times the noise measured with the weights verified identical
MIN_CALIBRATION_TOKENS = 32  # fewer current-version tokens than this: too few to set a floor from


@dataclass(frozen=True)
class Band:
    """Mean |trainer - sampler| log-prob allowed (nats), and share of tokens allowed outside the ratio band."""

    abs_diff_mean: float
    out_of_band: float
    source: str = ""

    def limits(self) -> tuple[float, float]:
        return self.abs_diff_mean, self.out_of_band

    def text(self) -> str:
        return f"mean |d| <= {self.abs_diff_mean:.3g} nats, <= {self.out_of_band:.1%} of tokens outside the ratio band"


FP32 = Band(1e-4, 0.01, "fp32 on both sides")  # measured ~2e-7 nats, max |d| ~2e-6
# (engine, trainer) -> band. Set from the measurements in docs/correctness.md ("Bands"), with head-room.
# Measured (clean runs, mean |d| per step; share of tokens outside [0.9, 1.1]): the tiny model 5e-4..3.5e-3,
# 0%, with the HF and vLLM engines and every bf16 pair; SmolLM2-135M 0.027..0.066, 6..23% (HF engine fp32,
# trainer bf16), 0.037..0.041, 14..15% (HF, bf16 on both sides), 0.042..0.043, 15..16% (vLLM, bf16 on
# both sides). The band: ~2x the largest.
BF16_BAND = (0.15, 0.4)
DEFAULT_BANDS: dict[tuple[str, str], Band] = {
    ("bfloat16", "float32"): Band(*BF16_BAND, "the measured default for a bf16 engine, fp32 trainer"),
    ("float32", "bfloat16"): Band(*BF16_BAND, "the measured default for an fp32 engine, bf16 trainer"),
    ("bfloat16", "bfloat16"): Band(*BF16_BAND, "the measured default for bf16 on both sides"),
}
LOW = ("bfloat16", "float16")


def canonical(dtype: str | None) -> str | None:
    """``torch.bfloat16``, ``bf16`` and ``bfloat16`` are one dtype."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(name, name)


def pair_band(engine: str | None, trainer: str | None) -> Band:
    """The default band of a dtype pair (fp16 counts as bf16: it has more mantissa bits, so less noise)."""
    engine, trainer = canonical(engine), canonical(trainer)
    if engine is None or trainer is None or (engine not in LOW and trainer not in LOW):
        return FP32
    as_bf16 = lambda d: "bfloat16" if d in LOW else d  # noqa: E731
    return DEFAULT_BANDS.get((as_bf16(engine), as_bf16(trainer)), FP32)


def one_sided(m: Mapping[str, float], floor: float = FP32.abs_diff_mean) -> bool:
    """The same sign on nearly every token, by more than fp32 noise: a distribution processed on one side only."""
    abs_mean, signed = m.get("check/logprob_abs_diff_mean", 0.0), m.get("check/logprob_diff_mean", 0.0)
    return abs_mean > floor and abs(signed) >= ONE_SIDED * abs_mean


def later_turns_only(m: Mapping[str, float], floor: float = FP32.abs_diff_mean) -> bool:
    """Later turns differ, by more than fp32 noise, many times more than first turns: the context differs."""
    key = "check/logprob_abs_diff_mean"
    first, later = m.get(key + "/turn_first"), m.get(key + "/turn_later")
    return first is not None and later is not None and later > floor and later > LATER_TURNS * max(first, 1e-6)


def symmetric(m: Mapping[str, float]) -> bool:
    abs_mean, signed = m.get("check/logprob_abs_diff_mean", 0.0), m.get("check/logprob_diff_mean", 0.0)
    return abs(signed) < SYMMETRIC * abs_mean or abs_mean <= FP32.abs_diff_mean


def current(m: Mapping[str, float]) -> tuple[float | None, float | None, float | None]:
    """(mean |d|, share out of the ratio band, tokens) of the current-version tokens: lag 0 where
    tokens carry versions (older ones differ by the policy's own change, as they should)."""
    lag = "/lag_0" if "check/tokens/lag_0" in m else ""
    if lag == "" and any(k.startswith("check/tokens/lag_") for k in m):
        return None, None, None  # only stale tokens this step: nothing the check can compare
    return (m.get("check/logprob_abs_diff_mean" + lag), m.get("check/ratio_out_of_band" + lag),
            m.get("check/tokens" + lag, m.get("check/tokens")))


def outside(m: Mapping[str, float], band: Band, ratio_band: tuple[float, float]) -> list[str]:
    """The measures of the current-version tokens outside ``band``, as text."""
    abs_mean, share, _ = current(m)
    found = []
    if abs_mean is not None and abs_mean > band.abs_diff_mean:
        found.append(f"mean |trainer - sampler| log-prob {abs_mean:.3g} > {band.abs_diff_mean:g}")
    if share is not None and share > band.out_of_band:
        lo, hi = ratio_band
        found.append(f"{share:.1%} of tokens with a ratio outside [{lo:g}, {hi:g}] > {band.out_of_band:.1%}")
    return found


def expected_dtypes(cfg: Mapping | Any) -> tuple[tuple[str | None, str | None], str]:
    """(engine, trainer) dtypes a run's config says it samples and trains in, and why (the reasons
    ``rlcore.trainer.choices`` recorded under ``resolved``, or "set in the config"). The trainer's is
    its compute dtype: ``model.mixed_precision``, else ``model.dtype``; the engine's ``rollout.dtype``,
    else (HF engine) ``model.dtype``. None where the config leaves it open."""
    model, rollout = (cfg.get("model") or {}), (cfg.get("rollout") or {})
    resolved = cfg.get("resolved") or {}
    trainer = model.get("mixed_precision")
    trainer = None if trainer == "auto" else (trainer or model.get("dtype") or "float32")
    engine = rollout.get("dtype")
    if engine is None and (rollout.get("backend") or "hf") == "hf":
        engine = model.get("dtype") or "float32"

    def why(key: str, value: str | None) -> str:
        entry = resolved.get(key)
        return f"{key}={value} ({entry['why']})" if entry else f"{key}={value}"

    reason = "; ".join((why("rollout.dtype", engine), why("model.mixed_precision", trainer)))
    return (canonical(engine), canonical(trainer)), reason


class Bands:
    """The run's bands: ``pair`` from the expected (engine, trainer) dtypes (or, unknown, from the first
    weight comparison), the override from ``trainer.check``, and the calibrated one."""

    def __init__(self, cfg: CheckConfig, expected: tuple[str | None, str | None] = (None, None), why: str = "") -> None:
        self.cfg, self.why = cfg, why
        self.expected = (canonical(expected[0]), canonical(expected[1]))
        self.calibrated: Band | None = None
        self.announced = False

    def known(self) -> bool:
        return None not in self.expected

    def learn(self, engine: str | None, trainer: str | None) -> None:
        """Dtypes the config left unsaid, as the first weight comparison found them."""
        if not self.known():
            self.expected = (self.expected[0] or canonical(engine), self.expected[1] or canonical(trainer))

    def pair(self) -> Band:
        """The band a clean run of this pair stays inside (the override, where set)."""
        base = pair_band(*self.expected)
        cfg = self.cfg
        if cfg.max_abs_diff_mean is None and cfg.max_out_of_band is None:
            return base
        return Band(base.abs_diff_mean if cfg.max_abs_diff_mean is None else cfg.max_abs_diff_mean,
                    base.out_of_band if cfg.max_out_of_band is None else cfg.max_out_of_band, "trainer.check")

    def trigger(self) -> Band:
        """Leaving this band compares the weights at once: the calibrated band, else the pair's."""
        return self.calibrated or self.pair()

    def dtype_fault(self, engine: str | None, trainer: str | None) -> str | None:
        """A message when the dtypes the weight comparison found are not the configured ones."""
        found = (canonical(engine), canonical(trainer))
        if not self.known() or None in found or found == self.expected:
            return None
        return (f"dtype differs from the configuration (engine {found[0]}, trainer {found[1]}; the config says engine "
                f"{self.expected[0]}, trainer {self.expected[1]}: {self.why or 'as set'}): one side loads or computes "
                "in a dtype it was not asked for, so its numeric noise is not the one this run's band expects")

    def announce(self) -> str | None:
        """The line said once at start where the pair is not fp32 on both sides: which dtypes, why, which band."""
        if self.announced or not self.known():
            return None
        self.announced = True
        if self.expected == ("float32", "float32") and self.cfg.max_abs_diff_mean is None:
            return None  # the band the check always had: nothing to explain
        engine, trainer = self.expected
        differ = "differ" if engine != trainer else "agree"
        then = ", then calibrated from the first step whose weights compare equal" if self.cfg.calibrate else ""
        return (f"consistency check: engine {engine}, trainer {trainer} ({differ}: {self.why or 'as configured'}); "
                f"band {self.pair().text()} ({self.pair().source}; docs/correctness.md, 'Bands'){then}")

    def calibrate(self, step: int, m: Mapping[str, float], weights_ok: bool) -> tuple[dict[str, float], str] | None:
        """Set the calibrated band from this step when it qualifies (weights verified identical, enough
        tokens, symmetric noise, not confined to later turns, inside the pair's band); returns the
        metrics and the line that record it, once."""
        if self.calibrated is not None or not self.cfg.calibrate or not weights_ok:
            return None
        abs_mean, share, tokens = current(m)
        pair = self.pair()
        if (abs_mean is None or share is None or (tokens or 0) < MIN_CALIBRATION_TOKENS or not symmetric(m)
                or later_turns_only(m) or one_sided(m) or abs_mean > pair.abs_diff_mean or share > pair.out_of_band):
            return None
        floor = FP32 if pair.abs_diff_mean >= FP32.abs_diff_mean else pair
        self.calibrated = Band(min(pair.abs_diff_mean, max(floor.abs_diff_mean, CALIBRATE_FACTOR * abs_mean)),
                               min(pair.out_of_band, max(floor.out_of_band, CALIBRATE_FACTOR * share)),
                               f"calibrated at step {step}")
        line = (f"consistency check, step {step}: calibrated {self.calibrated.text()} ({CALIBRATE_FACTOR:g}x the "
                f"symmetric noise measured with the weights verified identical: mean |d| {abs_mean:.3g}, "
                f"{share:.1%} out of the ratio band; the pair's band {pair.text()})")
        return {"check/band_abs_diff_mean": self.calibrated.abs_diff_mean,
                "check/band_out_of_band": self.calibrated.out_of_band}, line
