"""Every group the rollout pool does not train on, counted with its reason, and the bias that makes.

Why: an asynchronous pipeline that quietly drops groups changes the data the policy learns from.
A group holding one slow episode goes stale; the slow episodes are the long, hard prompts of some
data source; dropping them silently tilts training toward the easy ones and nobody sees it. So
each drop is counted by reason and data source, with the reward of whatever episodes of the group
did finish, against the reward of the groups that were kept.

Reasons:
    stale             finished, but older than ``max_staleness`` when the trainer asked for it
    failed            an episode raised (only with ``drop_failed``; the default raises the error)
    in_flight_at_end  still being played when the run ended
    unused_at_end     finished, waiting for a trainer that had already taken its last step

Per step (``metrics()``): ``pool/dropped/<reason>`` (groups dropped since the last call), over the
run so far ``pool/dropped_share/<data_source>`` (dropped / played to an end, of that source),
``pool/dropped_reward_mean`` (finished episodes of dropped groups) and ``pool/kept_reward_mean``.
Each drop is logged, at most one line per ``log_every_s`` (the others counted in the next line).
At the end, ``summary_text()`` is one screen, and ``write(folder)`` leaves ``drops.txt`` and
``drops.json`` (the same, plus up to ``MAX_RECORDS`` individual drops) in the run folder.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.agentic.episode import Trajectory

logger = logging.getLogger(__name__)
REASONS = ("stale", "failed", "in_flight_at_end", "unused_at_end")
MAX_RECORDS = 200  # individual drops kept for drops.json (the counts cover all of them)


def episode_rewards(trajs: Sequence[Trajectory]) -> list[float]:
    """One reward per episode: a chat agent's episode may be several segments (same ``episode_id``),
    each carrying the episode's reward; count it once."""
    seen, out = set(), []
    for t in trajs:
        if t.episode_id is not None:
            if t.episode_id in seen:
                continue
            seen.add(t.episode_id)
        out.append(float(t.reward))
    return out


class FinishedEpisodes:
    """A runner's rewards of the episodes that finished in each group it is still playing (or that
    failed), so that the pool can say what a group it drops had achieved (``finished_rewards``)."""

    def __init__(self) -> None:
        self._groups: dict[Any, list[float]] = {}

    async def gather(self, group_id: Any, episodes: Sequence[Awaitable], reward_of: Callable[[Any], float]) -> list:
        """``asyncio.gather`` of a group's episodes, recording each one's reward as it finishes. A group
        that completes is forgotten (the pool has it); one that fails is kept until ``pop``."""
        done = self._groups.setdefault(group_id, [])

        async def one(episode: Awaitable) -> Any:
            result = await episode
            done.append(float(reward_of(result)))
            return result

        results = await asyncio.gather(*[one(e) for e in episodes])
        self._groups.pop(group_id, None)
        return list(results)

    def pop(self, group_ids: Sequence[Any]) -> dict[Any, list[float]]:
        return {g: list(self._groups.pop(g, [])) for g in group_ids}


def data_source(task: Mapping[str, Any]) -> str:
    return str(task.get("data_source") or "unknown")


class _Sum:
    __slots__ = ("n", "total")

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0

    def add(self, values: Sequence[float]) -> None:
        self.n += len(values)
        self.total += float(sum(values))

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


class DropLedger:
    def __init__(self, log_every_s: float = 10.0) -> None:
        self.log_every_s = log_every_s
        self._lock = threading.Lock()
        self.dropped: Counter[str] = Counter()  # reason -> groups, over the run
        self._since_metrics: Counter[str] = Counter()
        self.kept_by_source: Counter[str] = Counter()
        self.dropped_by_source: defaultdict[str, Counter[str]] = defaultdict(Counter)  # source -> reason -> groups
        self.kept_reward, self.dropped_reward = _Sum(), _Sum()
        self.reward_by_reason: defaultdict[str, _Sum] = defaultdict(_Sum)
        self.records: list[dict] = []
        self._last_log = float("-inf")
        self._unlogged: Counter[str] = Counter()

    def kept(self, task: Mapping[str, Any], trajs: Sequence[Trajectory]) -> None:
        with self._lock:
            self.kept_by_source[data_source(task)] += 1
            self.kept_reward.add(episode_rewards(trajs))

    def drop(self, reason: str, group_id: Any, task: Mapping[str, Any], rewards: Sequence[float] | None,
             detail: str, log: bool = True) -> None:
        """Count one dropped group; ``rewards``: its finished episodes' (None: not known)."""
        if reason not in REASONS:
            raise ValueError(f"unknown drop reason {reason!r}; one of {REASONS}")
        source, rewards = data_source(task), list(rewards or [])
        with self._lock:
            self.dropped[reason] += 1
            self._since_metrics[reason] += 1
            self.dropped_by_source[source][reason] += 1
            self.dropped_reward.add(rewards)
            self.reward_by_reason[reason].add(rewards)
            if len(self.records) < MAX_RECORDS:
                self.records.append({"reason": reason, "group": group_id, "data_source": source,
                                     "finished_episodes": len(rewards), "rewards": rewards, "detail": detail})
            line = None
            now = time.monotonic()
            if log and now - self._last_log >= self.log_every_s:
                more = sum(self._unlogged.values())
                extra = (f" (+{more} more dropped since the last line: "
                         f"{', '.join(f'{r} {n}' for r, n in sorted(self._unlogged.items()))})") if more else ""
                line = f"rollout pool dropped group {group_id} ({source}) as {reason}: {detail}{_rewards(rewards)}{extra}"
                self._last_log, self._unlogged = now, Counter()
            elif log:
                self._unlogged[reason] += 1
        if line:
            logger.warning(line)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {f"pool/dropped/{reason}": float(self._since_metrics[reason]) for reason in REASONS}
            self._since_metrics.clear()
            for source in sorted(set(self.kept_by_source) | set(self.dropped_by_source)):
                dropped = sum(self.dropped_by_source[source].values())
                out[f"pool/dropped_share/{source}"] = dropped / (dropped + self.kept_by_source[source])
            if self.dropped_reward.mean is not None:
                out["pool/dropped_reward_mean"] = self.dropped_reward.mean
            if self.kept_reward.mean is not None:
                out["pool/kept_reward_mean"] = self.kept_reward.mean
        return out

    def summary(self) -> dict:
        with self._lock:
            sources = sorted(set(self.kept_by_source) | set(self.dropped_by_source))
            kept, dropped = sum(self.kept_by_source.values()), sum(self.dropped.values())
            return {
                "groups_kept": kept, "groups_dropped": dropped,
                "dropped": {r: {"groups": self.dropped[r], "finished_episodes": self.reward_by_reason[r].n,
                                "reward_mean": self.reward_by_reason[r].mean} for r in REASONS if self.dropped[r]},
                "by_data_source": {s: {"kept": self.kept_by_source[s], "dropped": dict(self.dropped_by_source[s]),
                                       "dropped_share": _share(sum(self.dropped_by_source[s].values()),
                                                               self.kept_by_source[s])} for s in sources},
                "kept_reward_mean": self.kept_reward.mean, "kept_episodes": self.kept_reward.n,
                "dropped_reward_mean": self.dropped_reward.mean, "dropped_finished_episodes": self.dropped_reward.n,
                "records": list(self.records),
            }

    def summary_text(self, max_examples: int = 5) -> str:
        s = self.summary()
        total = s["groups_kept"] + s["groups_dropped"]
        lines = [f"Rollout pool: {s['groups_dropped']} of {total} groups dropped "
                 f"({100 * _share(s['groups_dropped'], s['groups_kept']):.1f}%), never trained on."]
        if s["groups_dropped"]:
            lines.append(f"  {'reason':<18}{'groups':>7}{'finished episodes':>19}{'their reward mean':>19}")
            for reason, row in s["dropped"].items():
                lines.append(f"  {reason:<18}{row['groups']:>7}{row['finished_episodes']:>19}"
                             f"{_fmt(row['reward_mean']):>19}")
        lines.append(f"  {'data source':<18}{'kept':>7}{'dropped':>9}{'share':>8}  by reason")
        for source, row in s["by_data_source"].items():
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(row["dropped"].items())) or "-"
            lines.append(f"  {source:<18}{row['kept']:>7}{sum(row['dropped'].values()):>9}"
                         f"{100 * row['dropped_share']:>7.1f}%  {reasons}")
        lines.append(f"  reward mean: kept groups {_fmt(s['kept_reward_mean'])} ({s['kept_episodes']} episodes), "
                     f"finished episodes of dropped groups {_fmt(s['dropped_reward_mean'])} "
                     f"({s['dropped_finished_episodes']} episodes)")
        for record in s["records"][:max_examples]:
            lines.append(f"  e.g. group {record['group']} ({record['data_source']}) {record['reason']}: "
                         f"{record['detail']}{_rewards(record['rewards'])}")
        return "\n".join(lines)

    def write(self, folder: Path) -> tuple[Path, Path]:
        """``drops.txt`` (the summary) and ``drops.json`` (the numbers, with the individual drops) in ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        text, data = folder / "drops.txt", folder / "drops.json"
        text.write_text(self.summary_text() + "\n")
        data.write_text(json.dumps(self.summary(), indent=1, default=str) + "\n")
        return text, data


def _share(dropped: int, kept: int) -> float:
    return dropped / (dropped + kept) if dropped + kept else 0.0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _rewards(rewards: Sequence[float]) -> str:
    if not rewards:
        return "; no episode of it finished"
    return f"; {len(rewards)} finished episode(s), reward mean {sum(rewards) / len(rewards):.3f}"
