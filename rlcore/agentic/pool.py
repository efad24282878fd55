"""The streaming rollout pool: prompt groups always in flight, finished ones handed to the trainer.

Why streaming: a rollout that waits for a whole batch drains the engines before every step (the
last, longest episodes run alone), and then the engines idle while the trainer updates. The pool
instead keeps ``groups_in_flight`` groups being played by the runner actors at all times; the
trainer takes ``n`` finished groups when it is ready (``get_groups``), and whatever is unfinished
keeps running into the next step, across weight updates. A background thread tops the pool up as
groups finish, so the engines never drain between steps.

Two bounds keep that honest:
- staleness: a group whose oldest model token is more than ``max_staleness`` policy versions
  older than the trainer's is dropped (counted in ``pool/dropped_stale`` and, with its reason,
  data source and rewards, in ``drops``), never trained on;
- backpressure: groups being played plus finished ones waiting for the trainer stay within
  ``groups_in_flight + max_ready``; beyond that the pool submits no new groups (the engines would
  only produce samples that go stale). With both a batch of groups, production matches what the
  trainer takes, and the groups it gets were sampled by the weights of the step before.

Failures: a runner actor that dies has its groups resubmitted to the others (``pool/resubmitted``)
and the pool goes on without it; an episode error (an env that raised or hung past its timeout)
is raised by ``get_groups`` naming the group, never swallowed, unless ``drop_failed``: then the
group is dropped as "failed", counted and logged, and the pool plays another.

Drops (``rlcore.agentic.drops``): every group not trained on (stale, failed, and at ``stop()`` those
still in flight or finished but never taken) is counted in ``drops`` by reason and data source,
with the rewards of its finished episodes (asked of the runners for unfinished groups), logged,
and summarised at the end (``drops.summary_text()``, ``drops.write(run folder)``).

Metrics (``metrics()``): ``pool/wait_s`` (the trainer waiting for groups), ``pool/staleness_mean``
and a histogram ``pool/staleness_<k>`` (fraction of handed-out groups k versions old),
``pool/in_flight``, ``pool/ready``, ``pool/dropped_stale``, ``pool/resubmitted``, and the drop
metrics: ``pool/dropped/<reason>``, ``pool/dropped_share/<data_source>``, ``pool/dropped_reward_mean``,
``pool/kept_reward_mean``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from rlcore.agentic.drops import DropLedger, episode_rewards
from rlcore.agentic.episode import Trajectory
from rlcore.single_controller.ray_group import plain_text


class RolloutError(RuntimeError):
    """Episodes of a group failed (an env error), or no runner is left to play them."""


@dataclass
class _Group:
    group_id: int
    task: Mapping[str, Any]
    runner: int
    ref: Any
    attempts: int = 1
    submitted: float = 0.0  # time.monotonic() when first submitted
    finished: float | None = None  # when its episodes came back

    def played_s(self) -> float:
        return (self.finished or time.monotonic()) - self.submitted


class RolloutPool:
    def __init__(self, runners: list[Any], tasks: Iterator[Mapping[str, Any]], group_size: int, groups_in_flight: int,
                 max_staleness: int = 1, max_ready: int | None = None, max_attempts: int = 3,
                 poll_s: float = 0.02, drop_failed: bool = False) -> None:
        if not runners:
            raise ValueError("RolloutPool needs at least one runner")
        if group_size < 1 or groups_in_flight < 1 or max_staleness < 0:
            raise ValueError(f"need group_size >= 1, groups_in_flight >= 1, max_staleness >= 0; got "
                             f"{group_size}, {groups_in_flight}, {max_staleness}")
        self.runners, self.alive = list(runners), [True] * len(runners)
        self.tasks, self.group_size, self.groups_in_flight = tasks, group_size, groups_in_flight
        self.max_staleness, self.max_attempts, self.poll_s = max_staleness, max_attempts, poll_s
        self.drop_failed = drop_failed
        self.drops = DropLedger()
        self.max_ready = groups_in_flight if max_ready is None else max_ready
        self._ids = itertools.count()
        self._in_flight: dict[Any, _Group] = {}  # object ref -> group
        self._ready: deque[tuple[_Group, list[Trajectory]]] = deque()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._staleness: Counter[int] = Counter()
        self._counts = Counter()
        self._wait_s = 0.0

    # ------------------------------------------------------------------ driver side
    def start(self) -> "RolloutPool":
        self._thread = threading.Thread(target=self._serve, name="rollout-pool", daemon=True)
        self._thread.start()
        return self

    def get_groups(self, n: int, current_version: int, timeout_s: float = 600.0) -> list[list[Trajectory]]:
        """``n`` finished groups at most ``max_staleness`` versions behind ``current_version``
        (oldest first); waits for them at most ``timeout_s``."""
        out: list[list[Trajectory]] = []
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(out) < n:
                if self._error is not None:
                    raise self._error
                while self._ready and len(out) < n:
                    group, trajs = self._ready.popleft()
                    oldest = min(t.oldest_version for t in trajs)
                    staleness = current_version - oldest
                    if staleness > self.max_staleness:
                        self._counts["dropped_stale"] += 1
                        self.drops.drop("stale", group.group_id, group.task, episode_rewards(trajs),
                                        f"oldest model token of policy version {oldest}, the trainer is at "
                                        f"{current_version} (max_staleness {self.max_staleness}); played "
                                        f"{group.played_s():.1f}s{_slowest(trajs)}")
                        continue
                    self._staleness[max(staleness, 0)] += 1
                    self.drops.kept(group.task, trajs)
                    out.append(trajs)
                self._cond.notify_all()  # room in the ready queue: the server may submit again
                if len(out) < n:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"the rollout pool gave {len(out)} of {n} groups within {timeout_s:g}s "
                                           f"({len(self._in_flight)} in flight)")
                    self._cond.wait(timeout=min(left, 1.0))
        self._wait_s += time.perf_counter() - start
        return out

    def metrics(self) -> dict[str, float]:
        """This step's pool metrics (the wait and the staleness histogram reset after each call)."""
        with self._cond:
            total = sum(self._staleness.values())
            out = {"pool/wait_s": self._wait_s, "pool/in_flight": float(len(self._in_flight)),
                   "pool/ready": float(len(self._ready)), "pool/dropped_stale": float(self._counts["dropped_stale"]),
                   "pool/resubmitted": float(self._counts["resubmitted"])}
            if total:
                out["pool/staleness_mean"] = sum(k * v for k, v in self._staleness.items()) / total
                out.update({f"pool/staleness_{k}": v / total for k, v in sorted(self._staleness.items())})
            self._staleness.clear()
            self._wait_s = 0.0
        out.update(self.drops.metrics())
        return out

    def describe(self) -> list[str]:
        """One line per group in flight, oldest first (what the trainer's watchdog reports of a stall)."""
        with self._cond:
            groups = sorted(self._in_flight.values(), key=lambda g: g.submitted)
            head = [f"{len(groups)} group(s) in flight, {len(self._ready)} finished and waiting for the trainer"]
            return head + [f"group {g.group_id} ({g.task.get('data_source', 'unknown')}) on runner {g.runner}: "
                           f"played {g.played_s():.1f}s, attempt {g.attempts}" for g in groups]

    def stop(self) -> None:
        """Stop playing; the groups in flight (cancelled) and those finished but never taken are counted
        as dropped (``in_flight_at_end``, ``unused_at_end``), with the rewards of their finished episodes."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._cond:
            in_flight, ready = list(self._in_flight.values()), list(self._ready)
            self._in_flight.clear()
            self._ready.clear()
        finished = self._finished_rewards(in_flight)
        for group in in_flight:
            self.drops.drop("in_flight_at_end", group.group_id, group.task, finished.get(group.group_id),
                            f"still being played when the run ended ({group.played_s():.1f}s)", log=False)
            ray.cancel(group.ref, force=False)
        for group, trajs in ready:
            self.drops.drop("unused_at_end", group.group_id, group.task, episode_rewards(trajs),
                            "finished, but the run ended before a step took it", log=False)

    def _finished_rewards(self, groups: list[_Group], timeout_s: float = 5.0) -> dict[Any, list[float]]:
        """The rewards of the finished episodes of ``groups``, asked of their runners (what a dropped group achieved);
        a runner that does not answer in time (or has no ``finished_rewards``) contributes nothing."""
        by_runner: dict[int, list[Any]] = {}
        for group in groups:
            if self.alive[group.runner]:
                by_runner.setdefault(group.runner, []).append(group.group_id)
        refs = {runner: self.runners[runner].finished_rewards.remote(ids) for runner, ids in by_runner.items()}
        out: dict[Any, list[float]] = {}
        deadline = time.monotonic() + timeout_s
        for ref in refs.values():
            try:
                out.update(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - a dead or old-style runner: rewards unknown, the drop still counts
                pass
        return out

    # ------------------------------------------------------------------ background thread
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._top_up()
                refs = list(self._in_flight)
                if not refs:
                    with self._cond:
                        self._cond.wait(timeout=self.poll_s * 10)
                    continue
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.poll_s, fetch_local=False)
                for ref in done:
                    self._collect(ref)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
            error = exc if isinstance(exc, RolloutError) else RolloutError(f"the rollout pool failed: {exc!r}")
            if error is not exc:
                error.__cause__ = exc
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _top_up(self) -> None:
        with self._cond:
            while (len(self._in_flight) < self.groups_in_flight
                   and len(self._in_flight) + len(self._ready) < self.groups_in_flight + self.max_ready
                   and not self._stop.is_set()):
                task = next(self.tasks)
                self._submit(_Group(next(self._ids), task, -1, None, submitted=time.monotonic()))

    def _submit(self, group: _Group) -> None:
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise RolloutError(f"every one of the {len(self.runners)} runner actors died")
        load = Counter(g.runner for g in self._in_flight.values())
        group.runner = min(live, key=lambda i: load[i])
        group.ref = self.runners[group.runner].run_group.remote(group.group_id, group.task, self.group_size)
        self._in_flight[group.ref] = group

    def _collect(self, ref: Any) -> None:
        with self._cond:
            group = self._in_flight.pop(ref)
        try:
            trajs = ray.get(ref)
        except RayActorError:
            with self._cond:
                self.alive[group.runner] = False
                if group.attempts >= self.max_attempts:
                    raise RolloutError(f"group {group.group_id} failed {group.attempts} times: its runners died")
                group.attempts += 1
                self._counts["resubmitted"] += 1
                self._submit(group)
            return
        except Exception as exc:
            if self.drop_failed:
                reason = plain_text(exc).strip().splitlines()
                self.drops.drop("failed", group.group_id, group.task, self._finished_rewards([group]).get(group.group_id),
                                f"on runner {group.runner} after {group.played_s():.1f}s: "
                                f"{reason[-1].strip(chr(39)) if reason else repr(exc)}")
                return
            raise RolloutError(f"group {group.group_id} (task {dict(group.task)!r}) failed on runner "
                               f"{group.runner}: {plain_text(exc)}") from exc
        group.finished = time.monotonic()
        with self._cond:
            self._ready.append((group, trajs))
            self._cond.notify_all()


def _slowest(trajs: list[Trajectory]) -> str:
    """", its slowest episode took X s" where the runner timed its episodes."""
    times = [t.metrics["episode/agent_s"] if "episode/agent_s" in t.metrics  # a chat agent's episode
             else t.metrics.get("episode/gen_s", 0.0) + t.metrics.get("episode/env_s", 0.0) for t in trajs]
    times = [x for x in times if x > 0]
    return f", its slowest episode {max(times):.1f}s" if times else ""
