"""SessionRouter: stickiness, balance, release, removal and failover; two real HF engines end to end."""

import asyncio
import functools
import threading

import pytest
import torch

from rlcore.agentic.env import GuessNumberEnv
from rlcore.agentic.multi_turn import MultiTurnRollout
from rlcore.agentic.router import SessionRouter
from rlcore.models.tiny import build_tiny_model
from rlcore.engines.base import Generation, RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig

GREEDY = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5, n=1, do_sample=False)


def unpadded(input_ids, attention_mask, position_ids):
    """The rows of a left-padded batch, checking that positions count from 0 at each row's first token."""
    rows = []
    for ids, mask, positions in zip(input_ids, attention_mask.bool(), position_ids):
        assert not mask[: int((~mask).sum())].any()  # padding on the left only
        assert positions[mask].tolist() == list(range(int(mask.sum())))
        rows.append(ids[mask].tolist())
    return rows


class FakeEngine:
    """Answers token ``tag`` three times, log-prob -tag, on every row; records every context and the
    rows of each call; can be made to fail."""

    def __init__(self, tag, fail=False):
        self.tag, self.fail, self.contexts, self.calls = tag, fail, [], []

    def generate(self, input_ids, attention_mask, position_ids, settings):
        rows = unpadded(input_ids, attention_mask, position_ids)
        if self.fail:
            raise ConnectionError(f"engine {self.tag} is down")
        self.contexts += rows
        self.calls.append(len(rows))
        n, width = len(rows), settings.max_new_tokens
        return Generation(torch.full((n, width), self.tag), torch.full((n,), 3), torch.full((n, width), -float(self.tag)))


def test_sessions_stick_and_new_ones_go_to_the_least_loaded():
    router = SessionRouter([FakeEngine(10), FakeEngine(11), FakeEngine(12)])
    assert [router.route(s) for s in "abcde"] == [0, 1, 2, 0, 1]
    assert [router.route(s) for s in "edcba" * 3] == [1, 0, 2, 1, 0] * 3  # sticky
    assert router.load == {0: 2, 1: 2, 2: 1}
    router.release("a")
    router.release("d")
    assert router.load == {0: 0, 1: 2, 2: 1}
    assert [router.route(s) for s in "fg"] == [0, 0]  # engine 0 is now the least loaded, twice
    with pytest.raises(KeyError, match="unknown session 'zz'"):
        router.release("zz")


def test_many_sessions_are_balanced():
    router = SessionRouter([FakeEngine(i) for i in range(3)])
    for s in range(100):
        router.route(s)
    assert router.load == {0: 34, 1: 33, 2: 33}
    for s in range(0, 100, 3):  # release the 34 sessions of engine 0
        router.release(s)
    for s in range(100, 134):
        assert router.route(s) == 0
    assert router.load == {0: 34, 1: 33, 2: 33}


def test_round_robin_ignores_load_and_skips_removed_engines():
    router = SessionRouter([FakeEngine(i) for i in range(3)], policy="round_robin")
    assert [router.route(s) for s in range(4)] == [0, 1, 2, 0]
    router.release(1)
    assert router.route(4) == 1 and router.route(5) == 2  # not engine 1 first: order, not load
    assert router.remove_engine(1) == {4: 0}  # session 4 re-homed to the next in turn (wrapping)
    assert [router.route(s) for s in range(6, 9)] == [2, 0, 2]
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        SessionRouter([FakeEngine(0)], policy="random")


def test_removal_rehomes_only_that_engines_sessions():
    router = SessionRouter([FakeEngine(i) for i in range(3)])
    homes = {s: router.route(s) for s in range(9)}  # 3 sessions per engine
    moved = router.remove_engine(1)
    assert sorted(moved) == [s for s, e in homes.items() if e == 1]
    assert sorted(moved.values()) == [0, 0, 2] or sorted(moved.values()) == [0, 2, 2]
    assert router.load[0] + router.load[2] == 9 and abs(router.load[0] - router.load[2]) == 1
    for s, e in homes.items():
        if e != 1:
            assert router.route(s) == e  # the others keep their engine (and cache)
    with pytest.raises(KeyError, match="engine 1 is not in the router"):
        router.remove_engine(1)
    router.remove_engine(0)
    assert set(router.load) == {2} and router.load[2] == 9
    assert router.remove_engine(2) == {}
    with pytest.raises(RuntimeError, match="no rollout engines left"):
        router.route("new")


def test_generate_calls_the_sessions_engine_and_fails_over():
    engines = [FakeEngine(20), FakeEngine(21)]
    router = SessionRouter(engines)
    out = router.generate("a", [5, 6, 7], GREEDY)
    assert out == ([20, 20, 20], [-20.0, -20.0, -20.0], 0)
    assert router.generate("b", [8], GREEDY).engine == 1
    assert router.generate("a", [5, 6, 7, 20, 9], GREEDY).engine == 0
    assert engines[0].contexts == [[5, 6, 7], [5, 6, 7, 20, 9]] and engines[1].contexts == [[8]]

    engines[0].fail = True
    out = router.generate("a", [5, 6, 7, 20, 9, 20, 4], GREEDY)
    assert out.engine == 1 and out.token_ids == [21, 21, 21]
    assert router.failures == [(0, "ConnectionError('engine 20 is down')")]
    assert router.load == {1: 2}
    engines[1].fail = True
    with pytest.raises(RuntimeError, match="every rollout engine failed") as err:
        router.generate("b", [8], GREEDY)
    assert isinstance(err.value.__cause__, ConnectionError)

    strict = SessionRouter([FakeEngine(1, fail=True), FakeEngine(2)], failover=False)
    with pytest.raises(ConnectionError):
        strict.generate("a", [1], GREEDY)
    assert strict.load == {0: 1, 1: 0}  # the engine stays
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        strict.generate("a", [], GREEDY)
    with pytest.raises(TypeError, match="engine 0 .* has no generate"):
        SessionRouter([object()])


def test_generate_batch_sends_each_engine_its_sessions_as_one_batch_and_fails_over():
    engines = [FakeEngine(30), FakeEngine(31)]
    router = SessionRouter(engines)
    out = router.generate_batch(list("abcd"), [[5], [6, 7], [8, 9, 10], [11]], GREEDY)
    assert [o.engine for o in out] == [0, 1, 0, 1]
    assert [o.token_ids for o in out] == [[30] * 3, [31] * 3, [30] * 3, [31] * 3]
    assert out[1].log_probs == [-31.0] * 3
    assert engines[0].calls == [2] and engines[1].calls == [2]  # one batched call per engine
    assert engines[0].contexts == [[5], [8, 9, 10]] and engines[1].contexts == [[6, 7], [11]]

    engines[1].fail = True
    out = router.generate_batch(list("dbca"), [[11, 1], [6, 7, 1], [8, 9, 10, 1], [5, 1]], GREEDY)
    assert [o.engine for o in out] == [0, 0, 0, 0] and out[0].token_ids == [30] * 3
    assert engines[0].calls == [2, 2, 2]  # c, a; then d, b once re-homed
    assert engines[0].contexts[-2:] == [[11, 1], [6, 7, 1]]
    assert router.failures == [(1, "ConnectionError('engine 31 is down')")] and router.load == {0: 4}

    with pytest.raises(ValueError, match="duplicates"):
        router.generate_batch(["a", "a"], [[1], [2]], GREEDY)
    with pytest.raises(ValueError, match="2 contexts for 1 sessions"):
        router.generate_batch(["a"], [[1], [2]], GREEDY)


def test_concurrent_sessions_from_threads():
    router = SessionRouter([FakeEngine(i) for i in range(4)])
    errors = []

    def session(s):
        try:
            engine = {router.generate(s, [s + 4] * (turn + 1), GREEDY).engine for turn in range(5)}
            assert len(engine) == 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(s,)) for s in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert router.load == {0: 10, 1: 10, 2: 10, 3: 10}


# ------------------------------------------------------------------ two real HF engines
class Spy:
    """A real backend that also records the contexts it was asked to continue."""

    def __init__(self, backend):
        self.backend, self.contexts = backend, []

    def generate(self, input_ids, attention_mask, position_ids, settings):
        self.contexts += unpadded(input_ids, attention_mask, position_ids)
        return self.backend.generate(input_ids, attention_mask, position_ids, settings)

    @property
    def pad_token_id(self):
        return self.backend.pad_token_id


def test_multi_turn_sessions_stay_on_one_real_engine(tmp_path):
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    engines = [Spy(HFEngine(ModelConfig(path=path), RolloutConfig(seed=i))) for i in range(2)]
    tok = engines[0].backend.tokenizer
    router = SessionRouter(engines)
    sessions = {}
    for s in range(3):  # different ranges: each session's prompt, hence every context, is its own
        env = GuessNumberEnv(tok, high=100 + 10 * s, max_turns=3)
        sessions[s] = (env, asyncio.run(env.reset({"target": 50})))
    turns = {s: [] for s in sessions}
    for _ in range(3):  # interleave the sessions' turns, as concurrent users would
        for s, (env, context) in list(sessions.items()):
            out = router.generate(s, context, GREEDY)
            turns[s].append((list(context), out))
            result = asyncio.run(env.step(out.token_ids))
            obs, done = result.observation, result.terminated
            if done:
                del sessions[s]
            else:
                sessions[s] = (env, context + out.token_ids + obs)
    for s, calls in turns.items():
        homes = {out.engine for _, out in calls}
        assert len(homes) == 1 and len(calls) == 3
        home = homes.pop()
        assert all(context in engines[home].contexts for context, _ in calls)  # every turn ran there ...
        assert not any(context in engines[1 - home].contexts for context, _ in calls)  # ... and only there
        for (context, out), (next_context, _) in zip(calls, calls[1:]):  # each turn extends the last
            assert next_context[: len(context) + len(out.token_ids)] == context + out.token_ids
    assert [len(e.contexts) for e in engines] == [6, 3]  # sessions 0, 2 on engine 0; session 1 on engine 1
    # What the router returns is the engine's own greedy continuation.
    context, out = turns[1][2]
    ids = torch.tensor([context])
    direct = engines[1].backend.generate(ids, torch.ones_like(ids), torch.arange(len(context)).unsqueeze(0), GREEDY)
    assert out.token_ids == direct.responses[0, : int(direct.lengths[0])].tolist()
    torch.testing.assert_close(torch.tensor(out.log_probs), direct.log_probs[0, : len(out.token_ids)])


def test_multi_turn_rollout_over_a_router_of_two_real_engines(tmp_path):
    """Episodes are sessions: spread over both engines, each engine continuing only its own, and
    (greedy, the same weights on both) the trajectories are those of a single engine."""
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    backends = [HFEngine(ModelConfig(path=path), RolloutConfig(seed=i)) for i in range(2)]
    tok = backends[0].tokenizer
    spies = [Spy(b) for b in backends]
    router = SessionRouter(spies)
    env_factory = functools.partial(GuessNumberEnv, tok, max_turns=3)
    kw = dict(max_turns=3, max_total_tokens=120, settings=GREEDY)
    routed = MultiTurnRollout(router, tok, env_factory, **kw).run([{"target": t} for t in (7, 30, 55, 90)])
    single = MultiTurnRollout(backends[0], tok, env_factory, **kw).run([{"target": t} for t in (7, 30, 55, 90)])

    engines, turns = routed.non_tensor_batch["engine"].tolist(), routed.non_tensor_batch["num_turns"].tolist()
    assert engines == [0, 1, 0, 1]
    for e, spy in enumerate(spies):  # one context per turn of each of its own episodes, none of the others'
        assert len(spy.contexts) == sum(n for n, home in zip(turns, engines) if home == e)
    assert router.load == {0: 0, 1: 0} and router.sessions == {}  # released when the run ended
    for key in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(routed.batch[key], single.batch[key]), key
    torch.testing.assert_close(routed.batch["rollout_log_probs"], single.batch["rollout_log_probs"], atol=1e-5, rtol=0)
