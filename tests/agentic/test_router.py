"""SessionRouter: stickiness, balance, release, removal and failover; two real HF engines end to end."""

import threading

import pytest
import torch

from rlcore.agentic.env import GuessNumberEnv
from rlcore.agentic.router import SessionRouter
from rlcore.models.tiny import build_tiny_model
from rlcore.workers.rollout.base import Generation, ModelConfig, RolloutConfig, SamplingSettings
from rlcore.workers.rollout.hf_rollout import HFRollout

GREEDY = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5, n=1, do_sample=False)


class FakeEngine:
    """Answers token ``tag`` three times, log-prob -tag; records every context; can be made to fail."""

    def __init__(self, tag, fail=False):
        self.tag, self.fail, self.contexts = tag, fail, []

    def generate(self, input_ids, attention_mask, position_ids, settings):
        assert input_ids.shape[0] == 1 and attention_mask.all()
        assert position_ids[0].tolist() == list(range(input_ids.shape[1]))
        if self.fail:
            raise ConnectionError(f"engine {self.tag} is down")
        self.contexts.append(input_ids[0].tolist())
        width = settings.max_new_tokens
        responses = torch.full((1, width), self.tag)
        return Generation(responses, torch.tensor([3]), torch.full((1, width), -float(self.tag)))


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
        self.contexts.append(input_ids[0].tolist())
        return self.backend.generate(input_ids, attention_mask, position_ids, settings)


def test_multi_turn_sessions_stay_on_one_real_engine(tmp_path):
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    engines = [Spy(HFRollout(ModelConfig(path=path), RolloutConfig(seed=i))) for i in range(2)]
    tok = engines[0].backend.tokenizer
    router = SessionRouter(engines)
    sessions = {}
    for s in range(3):  # different ranges: each session's prompt, hence every context, is its own
        env = GuessNumberEnv(tok, high=100 + 10 * s, max_turns=3)
        sessions[s] = (env, env.reset(target=50))
    turns = {s: [] for s in sessions}
    for _ in range(3):  # interleave the sessions' turns, as concurrent users would
        for s, (env, context) in list(sessions.items()):
            out = router.generate(s, context, GREEDY)
            turns[s].append((list(context), out))
            obs, _, done, _ = env.step(out.token_ids)
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
