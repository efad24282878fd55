"""The asynchronous rollout end to end on a local Ray: HF engine servers, session-sticky routing with
failover when a server dies, the streaming RolloutPool over runner actors (staleness, backpressure,
a runner dying, a hung env), and streaming FSDP weights to the servers in buckets.

The module shares two engine servers. The weight push comes last: it changes the servers' weights,
and the tests before it compare trajectories with the original model's.
"""

import asyncio
import dataclasses
import itertools
import time

import numpy as np
import pytest
import ray
import torch
from transformers import AutoTokenizer

from rlcore.agentic.async_router import AsyncSessionRouter
from rlcore.agentic.episode import Trajectory
from rlcore.agentic.pool import RolloutError, RolloutPool
from rlcore.agentic.runner import EpisodeRunner, EpisodeSpec, generate_prompts, start_runners
from rlcore.data.dataset import collate_prompts
from rlcore.engines.async_base import Completion, TokenChunk
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.engines.server import EngineDiedError, RemoteEngine, start_engine_servers
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import build_tiny_model
from rlcore.protocol import DataProto

GREEDY = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, n=1, do_sample=False)
TASKS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "seed": i}
         for i, (a, b) in enumerate([(1, 1), (2, 3), (12, 30), (7, 8), (40, 9), (5, 0)])]
SLOW_STEPS = {"step_latency_s": 0.3, "latency_sigma": 0.0}  # every env step takes 0.3 s exactly


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_async_rollout"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def spec(model_dir, env="arithmetic_retry", **kw) -> EpisodeSpec:
    return EpisodeSpec(env, model_dir, GREEDY, **{"max_turns": 3, "max_total_tokens": 40, **kw})


def start_servers(count, model_dir) -> list[RemoteEngine]:
    return start_engine_servers(count, ModelConfig(path=model_dir), RolloutConfig(), num_cpus=0.5)


@pytest.fixture(scope="module")
def servers(ray_cluster, model_dir):
    engines = start_servers(2, model_dir)
    yield engines
    for engine in engines:
        ray_cluster.kill(engine.handle)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The episodes of TASKS on one engine in this process, uninterrupted."""
    runner = EpisodeRunner(spec(model_dir), [AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())])

    async def run():
        return await asyncio.gather(*[runner.play(task, i) for i, task in enumerate(TASKS)])

    trajs = asyncio.run(run())
    assert max(t.turns for t in trajs) > 1  # the random model answers wrong: episodes go on
    return trajs


class Recorder:
    """An engine that records, per call, the session, the engine that served it and the context."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    @property
    def pad_token_id(self):
        return self.engine.pad_token_id

    def num_running(self):
        return self.engine.num_running()

    async def generate(self, prompt_ids, sampling, session_id=None):
        completion = await self.engine.generate(prompt_ids, sampling, session_id)
        self.calls.append((session_id, completion.engine_id, list(prompt_ids)))
        return completion


def assert_same_trajectories(got: list[Trajectory], expected: list[Trajectory]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.prompt_ids == e.prompt_ids and g.token_ids == e.token_ids and g.policy_mask == e.policy_mask
        assert (g.reward, g.turns, g.terminated, g.truncated) == (e.reward, e.turns, e.terminated, e.truncated)
        np.testing.assert_allclose(g.log_probs, e.log_probs, atol=1e-5)
        assert g.versions == e.versions


def play_all(runner, tasks=TASKS, prefix="ep"):
    async def run():
        return await asyncio.gather(*[runner.play(task, (prefix, i)) for i, task in enumerate(tasks)])

    return asyncio.run(run())


# ------------------------------------------------------------------ the router alone (no Ray)
class FakeEngine:
    """Answers [tag]; can be marked dead (EngineDiedError); records the sessions it served."""

    pad_token_id = 0

    def __init__(self, tag):
        self.tag, self.dead, self.running, self.sessions = tag, False, 0, []

    def num_running(self):
        return self.running

    async def generate(self, prompt_ids, sampling, session_id=None):
        await asyncio.sleep(0)
        if self.dead:
            raise EngineDiedError(f"engine {self.tag} died during generate")
        self.sessions.append(session_id)
        return Completion([self.tag], [-1.0], "stop", [0], engine_id=f"e{self.tag}")


def route(router, session):
    return asyncio.run(router.generate([1, 2], GREEDY, session))


def test_async_router_sticky_least_loaded_and_failover():
    engines = [FakeEngine(10), FakeEngine(11), FakeEngine(12)]
    router = AsyncSessionRouter(engines)
    assert [route(router, s).engine_id for s in "abcd"] == [0, 1, 2, 0]  # the router's index
    assert [route(router, s).token_ids for s in "dcba"] == [[10], [12], [11], [10]]  # sticky
    router.release("b")
    router.release("never-seen")  # harmless
    assert route(router, "e").engine_id == 1  # the engine with the fewest sessions
    router.release("a")
    router.release("d")
    assert route(router, "f").engine_id == 0 and route(router, "g").engine_id == 0

    busy = AsyncSessionRouter([FakeEngine(1), FakeEngine(2)])
    busy.engines[0].running = 2
    assert route(busy, "x").engine_id == 1  # no sessions anywhere: fewer running requests wins
    assert route(busy, "y").engine_id == 0  # but sessions count first

    engines[1].dead = True  # session e lives there: its next turn is retried elsewhere
    out = route(router, "e")
    assert out.engine_id in (0, 2) and router.retries == 1 and router.alive == [True, False, True]
    assert router.sessions["e"] == out.engine_id
    assert route(router, "e").engine_id == out.engine_id  # and stays there
    assert engines[1].sessions == ["b", "b", "e"]  # nothing after it died
    # the per-engine session counts least-loaded reads, kept as sessions come, go and are re-homed
    assert router.live_sessions == [sum(1 for e in router.sessions.values() if e == i) for i in range(3)]
    assert router.live_sessions[1] == 0 and sum(router.live_sessions) == 4  # c, e, f, g; e left the dead one

    engines[0].dead = engines[2].dead = True
    with pytest.raises(EngineDiedError):
        route(router, "h")
    with pytest.raises(EngineDiedError, match="all 3 engines died"):
        route(router, "h")
    strict = AsyncSessionRouter([FakeEngine(1), FakeEngine(2)], max_retries=0)
    strict.engines[0].dead = True
    with pytest.raises(EngineDiedError, match="engine 1 died"):
        route(strict, "a")
    assert strict.alive == [False, True] and strict.retries == 0
    with pytest.raises(ValueError, match="at least one engine"):
        AsyncSessionRouter([])


# ------------------------------------------------------------------ routing
@pytest.mark.slow
def test_every_turn_of_a_session_on_one_server_and_sessions_spread(servers, model_dir, reference):
    recorders = [Recorder(s) for s in servers]
    runner = EpisodeRunner(spec(model_dir), recorders)
    trajs = play_all(runner)
    assert_same_trajectories(trajs, reference)  # RemoteEngine over Ray: the in-process engine's tokens

    calls = [c for r in recorders for c in r.calls]
    by_session = {}
    for session, served_by, context in calls:
        by_session.setdefault(session, []).append((served_by, context))
    assert len(by_session) == len(TASKS)
    homes = {}
    for i, traj in enumerate(trajs):
        turns = by_session[("ep", i)]
        assert len(turns) == traj.turns
        assert len({served_by for served_by, _ in turns}) == 1  # sticky
        homes[i] = turns[0][0]
        assert traj.engine_id == homes[i]  # the router's index, the server's own id here
        contexts = sorted((c for _, c in turns), key=len)  # each turn continues the last
        for before, after in zip(contexts, contexts[1:]):
            assert after[: len(before)] == before
    assert sorted(homes.values()) == [0, 0, 0, 1, 1, 1]  # new sessions to the least-loaded server
    assert [len(r.calls) for r in recorders] == [sum(t.turns for i, t in enumerate(trajs) if homes[i] == e)
                                                 for e in (0, 1)]
    assert runner.router.sessions == {} and runner.router.retries == 0  # released when over
    assert runner.stats()["episodes_done"] == len(TASKS)


@pytest.mark.slow
def test_a_server_killed_mid_run_fails_over_token_exact(servers, model_dir, reference, ray_cluster):
    victim = start_servers(1, model_dir)[0]
    recorders = [Recorder(servers[0]), Recorder(victim)]
    runner = EpisodeRunner(spec(model_dir, env_kwargs=SLOW_STEPS), recorders)

    async def run():
        episodes = [asyncio.create_task(runner.play(task, ("ep", i))) for i, task in enumerate(TASKS)]
        deadline = time.monotonic() + 120
        while not recorders[1].calls:  # the victim served a first turn: its sessions are in their env step
            assert time.monotonic() < deadline, "the second server never served a turn"
            await asyncio.sleep(0.01)
        ray_cluster.kill(victim.handle)
        return await asyncio.gather(*episodes)

    trajs = asyncio.run(run())
    assert_same_trajectories(trajs, reference)  # retried turns are token-exact
    router = runner.router
    assert router.retries > 0 and router.alive == [True, False]
    moved = {s for s, _, _ in recorders[1].calls} & {s for s, _, _ in recorders[0].calls}
    assert moved  # sessions that began on the victim finished on the survivor
    with pytest.raises(EngineDiedError, match="engine 0 died during generate"):
        asyncio.run(victim.generate([5, 6], GREEDY))


@pytest.mark.slow
def test_a_stream_through_a_server_comes_token_by_token_and_closing_it_cancels_the_request(servers, tok):
    """generate_stream over Ray (a streaming actor method) and the sticky router: the chunks, then
    the completion generate gives; a stream closed after its first chunk is cancelled in the
    server's engine (long before its 20000 tokens)."""
    prompt = tok.encode("12+30=", add_special_tokens=False)
    short = dataclasses.replace(GREEDY, max_new_tokens=12, ignore_eos=True)
    endless = dataclasses.replace(GREEDY, max_new_tokens=20000, ignore_eos=True)
    router = AsyncSessionRouter(servers)

    async def run():
        items = [item async for item in router.generate_stream(prompt, short, "s")]
        whole = await router.generate(prompt, short, "s")
        stream = router.generate_stream(prompt, endless, "t")
        first = await anext(stream)
        start = time.monotonic()
        await stream.aclose()
        while any([(await e.stats())["num_running"] for e in servers]):
            assert time.monotonic() - start < 120, "the closed stream kept running"  # a hang guard
            await asyncio.sleep(0.02)
        return items, whole, first

    items, whole, first = asyncio.run(run())
    *chunks, final = items
    assert isinstance(final, Completion) and len(chunks) > 1 and isinstance(first, TokenChunk)
    assert [t for c in chunks for t in c.token_ids] == final.token_ids == whole.token_ids
    assert final.engine_id == whole.engine_id == router.sessions["s"]  # sticky, streamed or not


# ------------------------------------------------------------------ the rollout pool
def task_stream():
    """Tasks without end, each with a seed of its own."""
    for n in itertools.count():
        yield {**TASKS[n % len(TASKS)], "seed": n}


@pytest.fixture(scope="module")
def runners(servers, model_dir):
    actors = start_runners(2, spec(model_dir, env_kwargs={"step_latency_s": 0.05, "latency_sigma": 0.0}), servers)
    yield actors
    for actor in actors:
        ray.kill(actor)


def wait_for(pool, predicate, timeout_s=60.0):
    """Poll the pool's metrics until ``predicate(metrics)`` holds; returns those metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = pool.metrics()
        if predicate(metrics):
            return metrics
        assert time.monotonic() < deadline, f"the pool never got there: {metrics}"
        time.sleep(0.02)


def assert_groups(groups, n, group_size):
    assert len(groups) == n
    for group in groups:
        assert len(group) == group_size and all(isinstance(t, Trajectory) and t.turns >= 1 for t in group)
        assert len({tuple(t.prompt_ids) for t in group}) == 1  # one task per group


@pytest.mark.slow
def test_pool_streams_groups_drops_stale_ones_and_applies_backpressure(runners):
    pool = RolloutPool(runners, task_stream(), group_size=2, groups_in_flight=3, max_staleness=1).start()
    try:
        groups = pool.get_groups(2, current_version=0, timeout_s=120)
        assert_groups(groups, 2, 2)
        metrics = pool.metrics()
        assert metrics["pool/staleness_0"] == 1.0 and metrics["pool/staleness_mean"] == 0.0
        wait_for(pool, lambda m: m["pool/in_flight"] > 0)  # the pool keeps playing after handing out groups

        # Staleness: every group so far is version 0; a trainer at version 5 (max_staleness 1) gets none.
        wait_for(pool, lambda m: m["pool/ready"] >= 1)
        with pytest.raises(TimeoutError, match="gave 0 of 1 groups"):
            pool.get_groups(1, current_version=5, timeout_s=1.5)
        metrics = pool.metrics()
        assert metrics["pool/dropped_stale"] >= 1
        assert_groups(pool.get_groups(1, current_version=1, timeout_s=120), 1, 2)  # 1 behind: still fine
        assert pool.metrics()["pool/staleness_1"] == 1.0

        # Backpressure: with nobody taking groups, groups played + waiting stay within
        # groups_in_flight + max_ready (3 + 3), and once they all wait nothing more is submitted.
        metrics = wait_for(pool, lambda m: m["pool/in_flight"] == 0 and m["pool/ready"] >= 3)
        assert metrics["pool/ready"] <= 3 + 3
        time.sleep(0.5)
        assert pool.metrics()["pool/in_flight"] == 0  # still nothing submitted
        ready = int(pool.metrics()["pool/ready"])
        assert_groups(pool.get_groups(ready, current_version=0, timeout_s=5), ready, 2)
        wait_for(pool, lambda m: m["pool/in_flight"] > 0)  # room again: the pool refills
    finally:
        pool.stop()


@pytest.mark.slow
def test_pool_resubmits_the_groups_of_a_dead_runner(runners, servers, model_dir):
    victim = start_runners(1, spec(model_dir, env_kwargs=SLOW_STEPS), servers)[0]
    ray.get(victim.stats.remote(), timeout=120)  # started
    pool = RolloutPool([runners[0], victim], task_stream(), group_size=2, groups_in_flight=4).start()
    try:
        deadline = time.monotonic() + 120  # a hang guard
        while not any(" on runner 1: " in line for line in pool.describe()):  # a group is being played there
            assert time.monotonic() < deadline, pool.describe()
            time.sleep(0.01)
        ray.kill(victim)  # within a poll of it starting: not done (an env step alone takes 0.3 s)
        assert_groups(pool.get_groups(4, current_version=0, timeout_s=120), 4, 2)
        metrics = pool.metrics()
        assert metrics["pool/resubmitted"] >= 1
        assert pool.alive == [True, False]
    finally:
        pool.stop()
    # With every runner dead, the pool says so instead of waiting.
    orphan = RolloutPool([victim], task_stream(), group_size=2, groups_in_flight=1).start()
    try:
        with pytest.raises(RolloutError, match="every one of the 1 runner actors died"):
            orphan.get_groups(1, current_version=0, timeout_s=60)
    finally:
        orphan.stop()


@pytest.mark.slow
def test_a_hung_env_is_a_rollout_error_naming_it(servers, model_dir):
    hung = spec(model_dir, env="tests.agentic.async_envs:HangingEnv", step_timeout_s=0.5)
    [runner] = start_runners(1, hung, servers)
    pool = RolloutPool([runner], task_stream(), group_size=2, groups_in_flight=2).start()
    try:
        with pytest.raises(RolloutError, match=r"HangingEnv\.step did not return within 0\.5s") as err:
            pool.get_groups(1, current_version=0, timeout_s=120)
        assert "group " in str(err.value) and "runner 0" in str(err.value)
        with pytest.raises(RolloutError):  # and it stays raised
            pool.get_groups(1, current_version=0, timeout_s=1)
    finally:
        pool.stop()
        ray.kill(runner)


# ------------------------------------------------------------------ weight push (last: changes the servers)
@pytest.mark.slow
def test_push_weights_streams_the_actors_weights_to_the_servers(servers, model_dir, tok):
    from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
    from rlcore.workers.actor import ActorWorker

    prompts = DataProto.from_dict(*collate_prompts(
        [{"input_ids": torch.tensor(tok(t)["input_ids"])} for t in ["12+3=", "7*8=", "100-99=", "a"]],
        tok.pad_token_id))
    validate = RolloutConfig(max_new_tokens=8)

    def served_greedy():
        prompts.meta_info = {"validate": True}
        return generate_prompts(servers, prompts, validate).batch["responses"]

    def hf_greedy(state):
        engine = HFEngine(ModelConfig(path=model_dir), RolloutConfig())
        if state is not None:
            engine.load_weights(state)
        mask = prompts.batch["attention_mask"]
        out = engine.generate(prompts.batch["input_ids"], mask, prompts.batch["position_ids"],
                              SamplingSettings.resolve(validate, {"validate": True}))
        return out.responses

    before = served_greedy()
    assert torch.equal(before, hf_greedy(None))

    actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": model_dir}, "actor": {
        "optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "grad_clip": None, "ppo_micro_batch_size_per_gpu": 4,
        "shuffle": False}}))
    actor.init_model()
    prompts.meta_info = {"temperature": 1.0}
    batch = generate_prompts(servers, prompts, RolloutConfig(max_new_tokens=8, seed=0))
    batch = batch.union(actor.compute_log_prob(batch))
    batch.batch["advantages"] = batch.batch["response_mask"].float()
    actor.update_policy(batch)
    new_state = actor.get_full_state_dict()

    assert torch.equal(served_greedy(), before)  # nothing changes without a push
    bucket_bytes = 1 << 20  # about one decoder layer of the tiny model
    metrics = actor.push_weights(servers, 1, bucket_bytes=bucket_bytes)
    assert metrics["sync/buckets"] > 1
    assert 0 < metrics["sync/peak_bucket_bytes"] <= bucket_bytes
    assert metrics["sync/bytes"] >= sum(v.numel() * v.element_size() for v in new_state.values())

    after = served_greedy()
    assert not torch.equal(after, before)  # the update did change the policy ...
    assert torch.equal(after, hf_greedy(new_state))  # ... and the servers hold the actor's weights
    for server in servers:
        assert ray.get(server.handle.info.remote())["policy_version"] == 1
        assert ray.get(server.handle.stats.remote())["policy_version"] == 1.0
