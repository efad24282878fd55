"""Which weights does an engine hold? The weight comparison's diagnosis, from exact fingerprints.

A tensor that differs from the trainer's (``rlcore.algos.consistency.tensor_fingerprint``: any
changed bit) says only that something is wrong. What is wrong shows in *what* the engine holds
instead, so the check remembers the fingerprints of a few versions of the weights the engine was
meant to hold (``KnownVersions``): those of the start of the run (before the first update) and of
the last few checks (each the trainer's weights right after that step's sync). Kept by step, at
most ``KEEP`` of them besides the start; a version is a dict of small tuples, no tensors.

Per engine, each differing tensor is then *stale* (it equals an older version's: the newest such
step is named) or *unknown* (it equals none), and (``classify``):

- not synced: the engine holds one older version whole (every tensor that changed since that
  step is stale on it; the rest, unchanged since, match anyway, such as norms an lr=1e-6 step left
  bit-identical after a cast to bf16);
- partly synced: the differing tensors are stale but the engine holds no one version whole (some
  buckets took the update, others did not): named grouped by decoder layer;
- differ from every version known: some tensor is neither the trainer's nor any remembered
  version's (a corrupted or failed load, another model's weights, or a sync missed at a step the
  check never saw).

Without a remembered version (a check that could not read the engines before the first update)
the tensors are counted as before: all of them differ, not synced; some, partly synced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcore.engines.weights import layer_of

KEEP = 4  # versions remembered besides the start: the last few checks'

Fingerprints = Mapping[str, tuple]


class KnownVersions:
    """``step -> {name: fingerprint}`` of the weights the engines were meant to hold after that step
    (step ``start``: before the first update). The start is always kept, then the ``KEEP`` latest."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.versions: dict[int, dict[str, tuple]] = {}

    def remember(self, step: int, fingerprints: Fingerprints, start: bool = False) -> None:
        if start:
            self.start, self.versions = step, {}
        self.versions[step] = {name: tuple(fp) for name, fp in fingerprints.items()}
        later = sorted(s for s in self.versions if s != self.start)
        for old in later[:-KEEP]:
            del self.versions[old]

    def before(self, step: int) -> dict[int, dict[str, tuple]]:
        """The versions of steps before ``step``, newest first."""
        return {s: self.versions[s] for s in sorted(self.versions, reverse=True) if s < step}


@dataclass
class EngineVerdict:
    """What one engine holds, of the tensors that differ from the trainer's."""

    stale: dict[str, int] = field(default_factory=dict)  # name -> the newest older step whose tensor it holds
    unknown: list[str] = field(default_factory=list)  # names equal to no known version
    holds: int | None = None  # the step whose weights the engine holds whole (not synced), if one


def classify(trainer: Fingerprints, engine: Fingerprints, differ: list[str],
             known: Mapping[int, Fingerprints]) -> EngineVerdict:
    """``differ``: the names whose engine fingerprint is not the trainer's; ``known``: older
    versions, newest first (``KnownVersions.before``). See the module docstring."""
    verdict = EngineVerdict()
    for name in differ:
        step = next((s for s, fps in known.items() if fps.get(name) == tuple(engine[name])), None)
        if step is None:
            verdict.unknown.append(name)
        else:
            verdict.stale[name] = step
    if differ and not verdict.unknown:
        compared = [name for name in trainer if engine.get(name) is not None]
        verdict.holds = next((s for s, fps in known.items()
                              if all(fps.get(n) == tuple(engine[n]) for n in compared if n in fps)), None)
    return verdict


def layers_named(names: list[str]) -> str:
    """``names`` grouped by the unit a weight bucket keeps whole (a decoder layer, else the tensor),
    with counts, and a few names as examples."""
    units = Counter(layer_of(name) for name in names)
    shown = "; ".join(f"{unit}.* ({count})" if count > 1 else unit for unit, count in units.items())
    return shown + " - e.g. " + ", ".join(names[:3])


def _step_name(step: int, start: int | None) -> str:
    return f"step {step}'s weights" + (" (the run's starting weights)" if step == start else "")


def weights_cause(report: Any) -> tuple[str, str]:
    """(cause key, message) of a ``WeightReport`` that is not ok: see the module docstring."""
    bad = report.differ + report.missing
    engines = sorted({i for hit in report.where.values() for i in hit})
    where = f"; on engine(s) {engines}" if engines else ""
    checked = f"checked at step {report.step}"
    if report.verdicts is None:  # no version known: counting only
        if len(bad) >= report.tensors:
            return "weights_not_synced", (f"weights not synced: all {report.tensors} tensors of the engine differ from "
                                          f"the trainer's ({checked}); the engine samples with old weights (a missing "
                                          "or failed sync after an update)")
        return "weights_partial", (f"weights partly synced: {len(bad)} of {report.tensors} tensors differ from the "
                                   f"trainer's on the engine ({layers_named(bad)}{where}; {checked}): a weight bucket "
                                   "was skipped or failed to load")
    unknown = sorted({n for v in report.verdicts for n in v.unknown} | set(report.missing))
    stale = {n: s for v in report.verdicts for n, s in v.stale.items()}
    if unknown:
        also = f"; {len(stale)} more hold older steps' weights" if stale else ""
        steps = ", ".join(str(s) for s in sorted(report.known_steps)) or "none"
        return "weights_unknown", (f"weights differ from every version known: {len(unknown)} of {report.tensors} "
                                   f"tensors on the engine ({layers_named(unknown)}{where}) are neither the trainer's "
                                   f"nor those of any step the check remembers (steps {steps}){also} ({checked}): a "
                                   "corrupted or failed load, another model's weights, or a sync missed at a step "
                                   "that was not checked")
    held = {v.holds for v in report.verdicts if v.stale}
    if None not in held and len(held) == 1:
        holds = _step_name(held.pop(), report.start)
        return "weights_not_synced", (f"weights not synced: the engine holds {holds}: all {len(bad)} "
                                      f"tensors that changed since differ from the trainer's (of {report.tensors} "
                                      f"compared{where}; {checked}); the engine samples with old weights (a missing "
                                      "or failed sync after an update)")
    steps = ", ".join(str(s) for s in sorted(set(stale.values())))
    return "weights_partial", (f"weights partly synced: {len(bad)} of {report.tensors} tensors differ from the "
                               f"trainer's on the engine, holding older weights (of step {steps}) while the rest are "
                               f"current: {layers_named(sorted(stale))}{where}; {checked}: a weight bucket was skipped "
                               "or failed to load")
