"""The consistency check's verdicts: is the run training on what it sampled, with the weights it sampled with?

Measured every step at no extra forward pass (``rlcore.workers.mismatch``: the ``check/*`` metrics
of the actor's update), plus, every ``trainer.check.weight_checksum_freq`` steps, at step 1 and
on the step a log-prob band is first left (once per excursion), an exact fingerprint of every
engine tensor against the trainer's (``rlcore.algos.consistency.tensor_fingerprint``), and once
before the first step (``start``). Rewards that are NaN or infinite are refused by name
(``check_rewards``), never turned into numbers.

When a measure leaves its band the run warns once per cause, naming the likely one from what was
measured, in this order (docs/correctness.md, "Consistency check"):

1. weights: tensors whose fingerprint differs from the trainer's, judged by what the engine holds
   instead (``rlcore.trainer.weight_versions``): an older step's weights whole, not synced; older
   weights in some layers only, a partial sync (a bucket skipped or failed to load), naming the
   layers; weights of no version known, a corrupted or failed load.
   With them, the end-to-end probe (``rlcore.trainer.probe_check``): a fixed sequence scored by the
   engine and the trainer; out of its band while the tensors read back match: weights the engine
   keeps packed (or cannot hand back at all) differ from the trainer's.
2. one-sided log-probs: the sampler's log-probs above the trainer's (or below) on nearly every
   token by a steady margin: one side scores a top-p/top-k truncated distribution and the other the
   full one ("top-p/top-k log-probs not processed" alike).
3. later turns only: first-turn tokens agree, later turns differ: the trainer scores a context the
   sampler never saw, a chat template re-rendered (re-tokenised) earlier turns.
4. dtype: the engine's weights or the trainer's compute dtype are not the configured ones (an engine
   silently in bf16 where the config says fp32).
5. precision: symmetric noise above the band expected for the run's dtype pair.
6. otherwise: unexplained, with what was ruled out.

The bands know the precision (``rlcore.trainer.check_bands``): a clean bf16 run is expected to differ
by more than a clean fp32 one, so a configured pair of dtypes (bf16 on either side or both) is said
once at start, with why and the band chosen, and warns nothing while it stays inside that band. A
one-sided difference, one confined to later turns, and a dtype that is not the configured one are
named whatever the band.

``trainer.check.strict=true`` raises ``ConsistencyError`` instead of warning.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlcore.algos.consistency import compare_fingerprints
from rlcore.protocol import DataProto
from rlcore.trainer.check_bands import LATER_TURNS, LOW, ONE_SIDED, Bands, later_turns_only, one_sided, outside
from rlcore.trainer.probe_check import ProbeCheck, coverage, probe_diagnosis, probe_only_note
from rlcore.trainer.weight_versions import EngineVerdict, KnownVersions, classify, layers_named, weights_cause
from rlcore.workers.mismatch import CheckConfig

SHOWN = 5  # names listed in a message
DESCRIBING_COLUMNS = ("data_source", "reward_fn", "env", "agent", "uid", "engine")


class ConsistencyError(RuntimeError):
    """The trainer and the sampler disagree (``trainer.check.strict``), or a reward is not a finite number."""


@dataclass
class WeightReport:
    """One comparison of the engines' weights with the trainer's."""

    step: int
    tensors: int  # tensors compared: the trainer's, less those an engine could not read back
    differ: list[str]  # names that differ on at least one engine (engine index in ``where``)
    missing: list[str]
    where: dict[str, list[int]]
    engine_dtype: str | None
    trainer_dtype: str | None
    unreadable: list[str] = field(default_factory=list)  # on some engine, kept only packed: not compared
    verdicts: list[EngineVerdict] | None = None  # per engine, what it holds instead (None: no version known)
    known_steps: list[int] = field(default_factory=list)  # the older versions it was judged against
    start: int | None = None  # the step of the run's starting version

    @property
    def ok(self) -> bool:
        return not self.differ and not self.missing

    def metrics(self) -> dict[str, float]:
        out = {"check/weights_mismatch": float(len(self.differ) + len(self.missing)),
               "check/weights_checked": float(self.tensors)}
        if self.verdicts is not None and not self.ok:
            out["check/weights_stale"] = float(len({n for v in self.verdicts for n in v.stale}))
        if self.unreadable:
            out["check/weights_unreadable"] = float(len(self.unreadable))
        return out


def compare_weights(step: int, trainer: dict[str, Any], engines: Sequence[dict[str, tuple]],
                    known: KnownVersions | None = None) -> WeightReport:
    """``trainer``: the actor's ``weight_checksums`` reply; ``engines``: each engine's fingerprints;
    ``known``: older versions to judge differing tensors by (``rlcore.trainer.weight_versions``)."""
    where: dict[str, list[int]] = {}
    missing: set[str] = set()
    older = known.before(step) if known is not None else {}
    verdicts = []
    # an entry None: the engine keeps that tensor only in a form it cannot read back (vLLM's packed
    # CPU matmul kernels); it is neither compared nor missing, only counted
    unreadable = {name for engine in engines for name, c in engine.items() if c is None}
    for i, engine in enumerate(engines):
        readable = {name: tuple(c) for name, c in engine.items() if c is not None}
        compared = {name: tuple(c) for name, c in trainer["tensors"].items() if name not in unreadable}
        found = compare_fingerprints(compared, readable)
        for name in found["differ"]:
            where.setdefault(name, []).append(i)
        missing.update(found["missing"])
        verdicts.append(classify(compared, readable, found["differ"], older))
    dtypes = Counter(c[0] for engine in engines for c in engine.values() if c is not None)
    return WeightReport(step, len(trainer["tensors"].keys() - unreadable), sorted(where), sorted(missing), where,
                        dtypes.most_common(1)[0][0] if dtypes else None, trainer.get("dtype"),
                        sorted(unreadable & trainer["tensors"].keys()), verdicts if older else None, sorted(older),
                        known.start if known is not None else None)


def diagnose(m: dict[str, float], weights: WeightReport | None,
             dtypes: tuple[str | None, str | None] = (None, None), bands: Bands | None = None) -> tuple[str, str]:
    """(cause key, message) for measures out of band: see the module docstring for the order.
    ``weights``: this step's comparison, if one ran; ``dtypes``: (engine, trainer) as last reported;
    ``bands``: the run's (the configured dtypes, the band of their pair); None: judged as fp32."""
    if weights is not None and not weights.ok:
        return weights_cause(weights)  # not synced, partly synced or unknown weights: rlcore.trainer.weight_versions
    key = "check/logprob_abs_diff_mean"
    abs_mean, signed = m.get(key, 0.0), m.get("check/logprob_diff_mean", 0.0)
    if abs_mean > 0 and abs(signed) >= ONE_SIDED * abs_mean:
        side = "above" if signed < 0 else "below"
        how = ("the sampler reports its processed (truncated) distribution and the trainer scores the full one"
               if signed < 0 else "the trainer truncates and the sampler reports the full distribution")
        return "top_p_top_k", (f"top-p/top-k log-probs not processed alike: the sampler's log-probs are {side} the "
                               f"trainer's on nearly every token, by {abs(signed):.3g} nats on average: {how} "
                               "(the actor must get the rollout's top_p / top_k in meta_info)")
    first, later = m.get(key + "/turn_first"), m.get(key + "/turn_later")
    if later is not None and first is not None and later > LATER_TURNS * max(first, 1e-6):
        return "template", (f"template re-tokenised earlier turns: first-turn tokens agree (mean |diff| {first:.3g}) "
                            f"but later turns differ ({later:.3g}): the trainer scores a context the sampler did not "
                            "see (a chat template that re-renders or drops earlier turns' content)")
    fault = bands.dtype_fault(*dtypes) if bands is not None else None
    if fault is not None or (bands is None and None not in dtypes and dtypes[0] != dtypes[1]):
        return "dtype", (fault or f"dtype differs (engine {dtypes[0]}, trainer {dtypes[1]})") + (
            f": symmetric numeric noise of {abs_mean:.3g} nats per token; train and sample in the configured dtypes "
            "(rollout.dtype, model.mixed_precision)")
    pair = bands.expected if bands is not None and bands.known() else dtypes
    if (pair[0] in LOW or pair[1] in LOW) and abs(signed) < 0.5 * abs_mean:
        band = bands.pair() if bands is not None else None
        return "precision", (f"numeric noise above the band expected for engine {pair[0]}, trainer {pair[1]}: "
                             f"{abs_mean:.3g} nats per token apart, symmetric"
                             + (f" (band: {band.text()}, {band.source})" if band is not None else "")
                             + "; more than measured for this pair on the models in docs/correctness.md ('Bands'): "
                             "set trainer.check.max_abs_diff_mean if this model is known to differ more, or correct "
                             "it with actor.use_rollout_is")
    checked = (f"the weights match (checked at step {weights.step}) and both sides use {dtypes[0]}"
               if weights is not None else "weights not checked this step")
    return "unexplained", (f"trainer and sampler disagree (mean |diff| {abs_mean:.3g} nats) with no cause measured: "
                           f"{checked}; not one-sided (top-p/top-k) and not confined to later turns")


def out_of_band(m: dict[str, float], cfg: CheckConfig, bands: Bands | None = None) -> list[str]:
    """The measures out of the pair's band (``bands``; None: fp32's, or ``cfg``'s override), as text.
    Where tokens carry versions, only the current version's (lag 0) are judged: older tokens differ by
    the policy's own change, as they should."""
    return outside(m, (bands or Bands(cfg)).pair(), tuple(cfg.ratio_band))


def stamp_row_versions(batch: DataProto, current_version: int, key: str = "policy_version") -> None:
    """Rows tagged with the policy version that sampled them (non-tensor ``key``, as the replay buffer
    tags them): every response token gets its row's version (``token_versions``) and the batch the
    trainer's (``meta_info["policy_version"]``), so the check judges only current-version tokens
    and reports the stale ones by lag."""
    rows = torch.as_tensor(batch.non_tensor_batch[key].astype("int64"))
    batch.batch["token_versions"] = rows[:, None].expand_as(batch.batch["responses"]).clone()
    batch.meta_info["policy_version"] = int(current_version)


def check_rewards(batch: DataProto, key: str = "token_level_scores") -> dict[str, float]:
    """Refuse NaN / infinite rewards by name (rows, and the columns that say where they came from);
    ``check/nan_rewards`` (0) when every reward is finite."""
    scores = batch.batch[key]
    bad = ~torch.isfinite(scores)
    if scores.dim() > 1:
        bad = bad.any(dim=-1)
    rows = torch.nonzero(bad).flatten().tolist()
    if not rows:
        return {"check/nan_rewards": 0.0}
    described = []
    for row in rows[:SHOWN]:
        cols = {c: batch.non_tensor_batch[c][row] for c in DESCRIBING_COLUMNS if c in batch.non_tensor_batch}
        value = scores[row][~torch.isfinite(scores[row])][0] if scores.dim() > 1 else scores[row]
        described.append(f"row {row} ({float(value)}" + "".join(f", {c}={v!r}" for c, v in cols.items()) + ")")
    more = f" and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
    raise ConsistencyError(f"{len(rows)} non-finite reward(s) in {key}: {'; '.join(described)}{more}. A reward must be a "
                           "finite number; the reward function or env that produced it is at fault, and it is not "
                           "replaced by a number")


class Recorder(Protocol):
    """Where the check's warnings and notes are kept (``rlcore.trainer.verdicts.VerdictLog``)."""

    def warning(self, step: int, cause: str, message: str, tensors: Sequence[str] = ()) -> None: ...

    def info(self, step: int, cause: str, message: str, tensors: Sequence[str] = ()) -> None: ...


class ConsistencyCheck:
    """Judges each step's ``check/*`` metrics and, when due, the engines' weights; warns once per
    cause or raises (strict). ``engines``: a callable returning each engine's weight checksums
    (``RolloutWorker.weight_checksums`` of a hybrid group; ``engine_weight_checksums`` of servers),
    set with ``watch`` when the engines come later than the run."""

    def __init__(self, cfg: CheckConfig, actor: Any = None, engines: Callable[[], list[dict]] | None = None,
                 out: Any = None, probe: ProbeCheck | None = None, record: Recorder | None = None,
                 expected: tuple[str | None, str | None] = (None, None), why: str = "") -> None:
        """``expected``: the (engine, trainer) dtypes the run's config says (``check_bands.expected_dtypes``),
        and ``why``; unknown ones are taken from the first weight comparison."""
        self.cfg, self.actor, self.engines = cfg, actor, engines
        self.out = out or sys.stderr
        self.probe = probe  # the end-to-end probe (rlcore.trainer.probe_check), run with every weight comparison
        self.record = record  # keeps every warning and note (the run's VerdictLog: <run>/check.jsonl)
        self._elements: dict[str, int] | None = None  # the trainer's elements per tensor, at the last comparison
        self.bands = Bands(cfg, expected, why)
        self._announce()
        self._step = 0  # the step being judged: where a note of the probe is kept
        self._hear(probe)
        self.warned: dict[str, str] = {}  # cause key -> message, each warned once
        self.last_weights: WeightReport | None = None
        self._out = False  # the last step left a band
        self._unsupported: str | None = None
        self._said_unreadable = False
        self.known = KnownVersions()  # the weights engines were meant to hold at the start and at recent checks

    def start(self, step: int) -> None:
        """Before the first step (``step``: 0, or a resumed run's): fingerprint the engines' weights
        and the trainer's, so that a later comparison can tell an engine still holding them (not
        synced) from one holding weights of no known version; a difference already now is warned."""
        if not (self.cfg.enable and self.cfg.weight_checksum_freq > 0 and self.can_check_weights()):
            return
        report = self.check_weights(step, start=True)
        if report is not None and not report.ok:
            bad = report.differ + report.missing
            self.report(step, "weights_start", f"the engine's weights differ from the trainer's before step "
                        f"{step + 1}: {len(bad)} of {report.tensors} tensors ({layers_named(bad)}): the engine "
                        "loaded other weights than the trainer (another checkpoint or revision, or a resumed run "
                        "whose engine was not synced)")

    def watch(self, engines: Callable[[], list[dict]], probe: ProbeCheck | None = None) -> None:
        """Compare ``engines`` from now on; a ``probe`` is calibrated here: call it while the engines
        hold the trainer's weights (before the first update, after a resume's sync)."""
        self.engines = engines
        if probe is not None:
            self.probe = probe
            self._hear(probe)
            self.calibrate()

    def _hear(self, probe: ProbeCheck | None) -> None:
        """The probe's notes said and kept like the check's own."""
        if probe is not None:
            probe.note = lambda cause, text: self.say(self._step, cause, text)

    def calibrate(self) -> None:
        """The probe's noise with identical weights (``ProbeCheck.calibrate``): its bands follow the run's."""
        if self.cfg.enable and self.probe is not None:
            self.probe.calibrate()

    def after_step(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """After the step's sync: judge it; returns the metrics it adds (``check/weights_*``, ``check/probe_*``,
        ``check/band_*`` once calibrated)."""
        freq = self.cfg.weight_checksum_freq
        due = freq > 0 and (step == 1 or step % freq == 0)  # by step number, which a resumed run continues
        tokens, self._step = "check/tokens" in metrics, step
        # no sampled token trained on this step: nothing to judge in the log-probs; with engines to check
        # (all advantages zero, every row skipped) a comparison that was due still runs; SFT, reward model: none
        if not self.cfg.enable or not (tokens or (due and self.connected())):
            return {}
        ratio_band = tuple(self.cfg.ratio_band)
        found = outside(metrics, self.bands.pair(), ratio_band) if tokens else []  # beyond a clean run of this pair
        # leaving the calibrated band, or a difference no band absorbs: compare the weights now, once per excursion
        signals = tokens and (one_sided(metrics) or later_turns_only(metrics))
        alert = tokens and (bool(outside(metrics, self.bands.trigger(), ratio_band)) or signals)
        new_excursion = alert and not self._out
        self._out = alert if tokens else self._out
        added: dict[str, float] = {}
        checked = (due or new_excursion) and self.can_check_weights() and self.check_weights(step) is not None
        if checked and (due or not self.last_weights.ok):  # a resumed run logs what an uninterrupted one did
            added = self.last_weights.metrics()
            if not self.last_weights.ok:
                found.append(f"{added['check/weights_mismatch']:g} engine tensor(s) differ from the trainer's")
        probe = self.probe.run(step) if (due or new_excursion) and self.probe is not None else None
        if due and (checked or probe is not None):  # the share verified, every check that was due
            added.update(coverage(self._elements if checked else None,
                                  self.last_weights.unreadable if checked else [], probe is not None))
        if probe is not None and (due or not probe.ok):
            added.update(probe.metrics())
            if not probe.ok:
                found.append(probe.finding())
        last = self.last_weights
        dtypes = (last.engine_dtype, last.trainer_dtype) if last is not None else (None, None)
        if found or self.bands.dtype_fault(*dtypes) or signals:
            found = found or (outside(metrics, self.bands.trigger(), ratio_band) if tokens else []) or [self.signal(metrics)]
            if probe is not None and not probe.ok and not (checked and not last.ok):
                cause, message = probe_diagnosis(probe, last if checked else None)
            else:
                cause, message = diagnose(metrics, last if checked else None, dtypes, self.bands)
            self.report(step, cause, f"{'; '.join(found)}. Likely cause: {message}")
        elif checked and last.ok and tokens:
            calibrated = self.bands.calibrate(step, metrics, weights_ok=True)
            if calibrated is not None:
                added.update(calibrated[0])
                if self.bands.calibrated.limits() != self.bands.pair().limits():  # tighter than the pair's: worth a line
                    self.say(step, "band_calibrated", calibrated[1].split(": ", 1)[1])
        return added

    def connected(self) -> bool:
        """Whether there is anything to compare: engines' weights or an end-to-end probe."""
        return self.can_check_weights() or self.probe is not None

    @staticmethod
    def signal(m: dict[str, float]) -> str:
        """A difference inside the band that no band absorbs, as text."""
        key = "check/logprob_abs_diff_mean"
        if one_sided(m):
            return f"mean trainer - sampler log-prob {m.get('check/logprob_diff_mean', 0.0):.3g} (one-sided)"
        if later_turns_only(m):
            return f"later turns' mean |d| {m[key + '/turn_later']:.3g} vs first turn's {m[key + '/turn_first']:.3g}"
        return f"mean |trainer - sampler| log-prob {m.get(key, 0.0):.3g} with dtypes not as configured"

    def _announce(self) -> None:
        line = self.bands.announce()
        if line is not None:
            print(line, file=self.out, flush=True)

    def can_check_weights(self) -> bool:
        return self.actor is not None and self.engines is not None and self._unsupported is None

    def check_weights(self, step: int, start: bool = False) -> WeightReport | None:
        """Compare every engine's weights with the trainer's now (``last_weights``), judged against the
        versions remembered (``known``), then remember the trainer's as step ``step``'s; None when the
        engines cannot report fingerprints (said once, then off for the run)."""
        engines = self.engines()
        if any(engine is None for engine in engines):  # an engine whose weights have no HF names to compare
            self._unsupported = "the rollout engine does not report weight checksums"
            self.say(step, "weights_unsupported", f"weight checksums off for this run ({self._unsupported}; the "
                     "log-prob measures stay on)")
            return None
        dtypes = {name: c[0] for name, c in engines[0].items() if c is not None} if engines else {}
        trainer = self.actor.weight_checksums(dtypes)
        trainer = trainer[0] if isinstance(trainer, list) else trainer
        self.last_weights = compare_weights(step, trainer, engines, self.known)
        self.known.remember(step, trainer["tensors"], start=start)
        self._elements = {name: int(c[1]) for name, c in trainer["tensors"].items()}  # (dtype, elements, hash)
        if not self.bands.known():  # a check built without the configured dtypes: take the ones found
            self.bands.learn(self.last_weights.engine_dtype, self.last_weights.trainer_dtype)
            self._announce()
        unread = len(self.last_weights.unreadable)
        if unread and not self._said_unreadable and self.probe is not None:
            self._said_unreadable = True
            self.say(step, "weights_probe_only", probe_only_note(self._elements, self.last_weights.unreadable)
                     .removeprefix("consistency check: "), self.last_weights.unreadable)
        if unread and not self._said_unreadable:
            self._said_unreadable = True
            self.say(step, "weights_unreadable", f"{unread} tensor(s) could not be read back from the engine (kept "
                     f"only as packed CPU matmul kernels, e.g. {self.last_weights.unreadable[0]}) and are not "
                     f"compared; {self.last_weights.tensors} are (rollout.cpu_weight_layout=plain makes every one "
                     "readable)", self.last_weights.unreadable)
        return self.last_weights

    def say(self, step: int, cause: str, text: str, tensors: Sequence[str] = ()) -> None:
        """A note said once (the caller's flag): to ``out`` and, kept, to ``record``."""
        print(f"consistency check: {text}", file=self.out, flush=True)
        if self.record is not None:
            self.record.info(step, cause, text, tensors)

    def report(self, step: int, cause: str, message: str) -> None:
        text = f"consistency check, step {step}: {message}"
        if self.record is not None:  # every time, before a strict run stops: the file says why it did
            weights = self.last_weights
            named = weights.differ + weights.missing if weights is not None and cause.startswith("weights") else []
            self.record.warning(step, cause, text, named)
        if self.cfg.strict:
            raise ConsistencyError(text + " (trainer.check.strict=true)")
        if cause not in self.warned:
            self.warned[cause] = text
            print(f"WARNING {text} (warned once per cause; trainer.check.strict=true stops the run)",
                  file=self.out, flush=True)

