"""Every group the rollout pool does not train on is counted with its reason, data source and the rewards of
its finished episodes: stale groups, failed ones (when told to drop them), and those cut when the run ends
(still in flight, or finished but never taken); the bias metrics and the end-of-run summary say so.

The pool runs over scripted runner actors: the real pool and Ray, with runners whose episodes take a given
time and earn a given reward (the runner interface: ``run_group`` and ``finished_rewards``)."""

import asyncio
import itertools
import json
import logging
import time

import pytest

from rlcore.agentic.drops import DropLedger, FinishedEpisodes, episode_rewards
from rlcore.agentic.episode import Trajectory


def traj(reward, version=0, episode_id=None):
    return Trajectory(prompt_ids=[1], token_ids=[2], policy_mask=[1], log_probs=[0.0], versions=[version],
                      reward=reward, episode_id=episode_id)


class ScriptedRunner:
    """Each episode i of a task sleeps ``task["delays"][i]`` s, then earns ``task["rewards"][i]`` as policy version
    ``task["version"]``, or raises where ``task["fail"] == i``."""

    def __init__(self):
        self.finished = FinishedEpisodes()
        self.done: dict[str, int] = {}  # episodes finished per data source: what the tests wait for, not the clock

    async def _episode(self, task, i):
        await asyncio.sleep(task["delays"][i])
        if task.get("fail") == i:
            raise RuntimeError(f"env exploded in episode {i}")
        self.done[task["data_source"]] = self.done.get(task["data_source"], 0) + 1
        return traj(task["rewards"][i], task["version"])

    def episodes_done(self, data_source):
        return self.done.get(data_source, 0)

    async def run_group(self, group_id, task, size):
        return await self.finished.gather(group_id, [self._episode(task, i) for i in range(size)], lambda t: t.reward)

    async def finished_rewards(self, group_ids):
        return self.finished.pop(group_ids)


def tasks(*head, tail):
    yield from head
    yield from itertools.repeat(tail)


def wait_for(pool, predicate, timeout_s=30.0):
    """Polls the pool's metrics until ``predicate`` holds (``timeout_s``: a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while not predicate(pool.metrics()):
        assert time.monotonic() < deadline, "the pool never got there"
        time.sleep(0.02)


def wait_for_episodes(runner, data_source, n, timeout_s=30.0):
    """Polls the scripted runner until ``n`` episodes of ``data_source`` have finished (a hang guard)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.get(runner.episodes_done.remote(data_source), timeout=timeout_s) < n:
        assert time.monotonic() < deadline, f"{n} {data_source} episode(s) never finished"
        time.sleep(0.02)


# ------------------------------------------------------------------ the ledger alone (hand-computed numbers)
def test_ledger_metrics_summary_and_rate_limited_log(tmp_path, caplog):
    ledger = DropLedger(log_every_s=3600)
    ledger.kept({"data_source": "easy"}, [traj(1.0), traj(0.5)])
    ledger.kept({"data_source": "hard"}, [traj(0.0), traj(0.0)])
    with caplog.at_level(logging.WARNING, logger="rlcore.agentic.drops"):
        ledger.drop("stale", 7, {"data_source": "hard"}, [0.25, 0.75], "2 versions behind")
        ledger.drop("in_flight_at_end", 8, {"data_source": "hard"}, [], "still running")
        ledger.drop("failed", 9, {}, None, "env exploded")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("rollout pool dropped group 7 (hard) as stale: 2 versions behind")
    assert "2 finished episode(s), reward mean 0.500" in lines[0]
    m = ledger.metrics()
    assert m["pool/dropped/stale"] == m["pool/dropped/in_flight_at_end"] == m["pool/dropped/failed"] == 1.0
    assert m["pool/dropped/unused_at_end"] == 0.0
    assert m["pool/dropped_share/easy"] == 0.0 and m["pool/dropped_share/hard"] == 2 / 3
    assert m["pool/dropped_share/unknown"] == 1.0
    assert m["pool/dropped_reward_mean"] == 0.5 and m["pool/kept_reward_mean"] == pytest.approx(1.5 / 4)
    assert ledger.metrics()["pool/dropped/stale"] == 0.0  # per step; shares and means are over the run
    ledger._last_log = float("-inf")  # the rate limit has passed: the next line counts the unlogged ones
    with caplog.at_level(logging.WARNING, logger="rlcore.agentic.drops"):
        ledger.drop("stale", 10, {"data_source": "easy"}, [1.0], "1 version behind")
    assert "(+2 more dropped since the last line: failed 1, in_flight_at_end 1)" in caplog.records[-1].getMessage()
    text, data = ledger.write(tmp_path)
    summary = json.loads(data.read_text())
    assert (summary["groups_kept"], summary["groups_dropped"]) == (2, 4)
    assert summary["dropped"]["stale"] == {"groups": 2, "finished_episodes": 3, "reward_mean": 2.0 / 3}
    assert summary["by_data_source"]["hard"]["dropped"] == {"stale": 1, "in_flight_at_end": 1}
    shown = text.read_text()
    assert shown.startswith("Rollout pool: 4 of 6 groups dropped (66.7%)") and len(shown.splitlines()) < 25
    assert "hard" in shown and "in_flight_at_end" in shown and "e.g. group 7 (hard) stale" in shown


def test_a_chat_agents_episode_counts_once_and_finished_episodes_are_kept_until_asked():
    segments = [traj(1.0, episode_id="g/0"), traj(1.0, episode_id="g/0"), traj(0.0, episode_id="g/1")]
    assert episode_rewards(segments) == [1.0, 0.0]
    finished = FinishedEpisodes()

    async def ok(reward):
        return traj(reward)

    async def boom():
        await asyncio.sleep(0.01)
        raise RuntimeError("boom")

    assert [t.reward for t in asyncio.run(finished.gather(1, [ok(0.5), ok(1.0)], lambda t: t.reward))] == [0.5, 1.0]
    with pytest.raises(RuntimeError):
        asyncio.run(finished.gather(2, [ok(0.25), boom()], lambda t: t.reward))
    assert finished.pop([1, 2, 3]) == {1: [], 2: [0.25], 3: []}  # a completed group is forgotten
    assert finished.pop([2]) == {2: []}


# ------------------------------------------------------------------ the pool over Ray runners
@pytest.fixture(scope="module")
def scripted(ray_cluster):
    import ray

    runner = ray.remote(ScriptedRunner).options(num_cpus=0, max_concurrency=64).remote()
    yield runner
    ray.kill(runner)


EASY = {"data_source": "easy", "delays": [0.0, 0.0], "rewards": [1.0, 1.0], "version": 0}
HARD = {"data_source": "hard", "delays": [0.0, 1.0], "rewards": [0.0, 0.5], "version": 0}  # one slow episode
TAIL = {"data_source": "tail", "delays": [0.0, 60.0], "rewards": [0.25, 1.0], "version": 0}  # never done in time


@pytest.mark.slow
def test_stale_and_cut_groups_are_counted_with_sources_and_rewards(scripted, tmp_path, caplog):
    from rlcore.agentic.pool import RolloutPool

    pool = RolloutPool([scripted], tasks(EASY, HARD, tail=TAIL), group_size=2, groups_in_flight=3, max_staleness=0,
                       max_ready=0).start()
    try:
        [kept] = pool.get_groups(1, current_version=0, timeout_s=30)
        assert [t.reward for t in kept] == [1.0, 1.0]
        # The hard group comes back at ~1 s, sampled by version 0; the trainer is at 1: stale, and said so.
        wait_for_episodes(scripted, "hard", 2)  # both its episodes played (the pool collects it within its poll)
        with caplog.at_level(logging.WARNING, logger="rlcore.agentic.drops"):
            with pytest.raises(TimeoutError, match="gave 0 of 1 groups"):
                pool.get_groups(1, current_version=1, timeout_s=3)
        line = next(r.getMessage() for r in caplog.records if "as stale" in r.getMessage())
        assert line.startswith("rollout pool dropped group 1 (hard) as stale: oldest model token of policy version 0, "
                               "the trainer is at 1 (max_staleness 0); played "), line
        assert "2 finished episode(s), reward mean 0.250" in line
        m = pool.metrics()
        assert m["pool/dropped/stale"] == m["pool/dropped_stale"] == 1.0
        assert m["pool/dropped_share/hard"] == 1.0 and m["pool/dropped_share/easy"] == 0.0
        assert m["pool/dropped_reward_mean"] == 0.25 and m["pool/kept_reward_mean"] == 1.0
        assert any("(tail) on runner 0: played" in line for line in pool.describe())
        wait_for(pool, lambda m: m["pool/in_flight"] == 3)
        in_flight = int(pool.metrics()["pool/in_flight"])
        wait_for_episodes(scripted, "tail", in_flight)  # each tail group's fast episode has finished
    finally:
        pool.stop()
    summary = pool.drops.summary()
    assert summary["dropped"]["in_flight_at_end"] == {"groups": in_flight, "finished_episodes": in_flight,
                                                      "reward_mean": 0.25}
    assert summary["by_data_source"]["tail"] == {"kept": 0, "dropped": {"in_flight_at_end": in_flight},
                                                 "dropped_share": 1.0}
    assert summary["kept_reward_mean"] == 1.0 and summary["groups_dropped"] == 1 + in_flight
    text, _ = pool.drops.write(tmp_path)
    shown = text.read_text()
    assert "stale" in shown and "in_flight_at_end" in shown and "hard" in shown and "tail" in shown


@pytest.mark.slow
def test_failed_groups_are_dropped_when_asked_and_unused_ones_counted_at_the_end(scripted):
    from rlcore.agentic.pool import RolloutError, RolloutPool

    broken = {"data_source": "flaky", "delays": [0.0, 0.2], "rewards": [0.75, 0.0], "version": 0, "fail": 1}
    pool = RolloutPool([scripted], tasks(broken, tail=EASY), group_size=2, groups_in_flight=2, max_ready=2,
                       drop_failed=True).start()
    try:
        assert [[t.reward for t in g] for g in pool.get_groups(2, current_version=0, timeout_s=30)] == [[1, 1], [1, 1]]
        deadline = time.monotonic() + 30
        while not pool.drops.dropped["failed"]:  # its second episode raises at 0.2 s
            assert time.monotonic() < deadline
            time.sleep(0.02)
        m = pool.metrics()
        assert m["pool/dropped/failed"] == 1.0 and m["pool/dropped_share/flaky"] == 1.0
        assert m["pool/dropped_reward_mean"] == 0.75  # the episode that finished before its sibling raised
        [record] = pool.drops.summary()["records"]
        assert record["reason"] == "failed" and record["detail"].endswith("RuntimeError: env exploded in episode 1")
        wait_for(pool, lambda m: m["pool/ready"] == 4)  # nobody takes them: backpressure stops at 2 + 2
    finally:
        pool.stop()
    assert pool.drops.summary()["dropped"]["unused_at_end"] == {"groups": 4, "finished_episodes": 8, "reward_mean": 1.0}
    # Without drop_failed (the default) an episode error still fails the run, naming the group.
    strict = RolloutPool([scripted], tasks(broken, tail=EASY), group_size=2, groups_in_flight=1).start()
    try:
        with pytest.raises(RolloutError, match=r"(?s)group 0 .* env exploded in episode 1"):
            strict.get_groups(1, current_version=0, timeout_s=30)
    finally:
        strict.stop()
