"""Asynchronous engines against the synchronous HF engine: concurrent requests batched, requests that
join a running batch at staggered times, per-request budgets and finish reasons, streaming, version
stamps, bucketed weight updates between requests and in the middle of one; vLLM's AsyncLLM (one
fp32 engine) with an update in the middle of a request (partial rollout)."""

import asyncio
import dataclasses
import gc
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.engines.async_base import Completion, TokenChunk
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.engines.weights import pack_buckets
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import build_tiny_model

GREEDY = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, n=1, do_sample=False)
PROMPTS = ["1+1=", "2+2=", "12+3=", "7*8=", "100-99=", "a", "hello", "5-3="]
LOGPROB_TOL = 1e-5
BUCKET = 1 << 16  # several buckets for the tiny model (~1.2 MB in fp32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_async"), seed=0)


@pytest.fixture(scope="module")
def new_state(tmp_path_factory):
    """Other weights of the same architecture (another seed): greedy output really changes."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny_async_new"), seed=1)
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFEngine(ModelConfig(path=model_dir), RolloutConfig())


@pytest.fixture(scope="module")
def hf_new(model_dir, new_state):
    engine = HFEngine(ModelConfig(path=model_dir), RolloutConfig())
    engine.load_weights(new_state)
    return engine


@pytest.fixture(scope="module")
def engine(model_dir):
    """One async engine for the module: every test drives it from an event loop of its own."""
    return AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig(), engine_id="hf0")


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def reference(engine: HFEngine, prompt: list[int], sampling: SamplingSettings) -> tuple[list[int], torch.Tensor]:
    """The synchronous engine on this one prompt alone (no padding): tokens and log-probs."""
    out = engine.generate(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long),
                          torch.arange(len(prompt))[None], sampling)
    n = int(out.lengths[0])
    return out.responses[0, :n].tolist(), out.log_probs[0, :n]


class Peak:
    """The most rows an AsyncHFEngine decoded in one step while inside this block."""

    def __init__(self, async_engine):
        self.engine = async_engine

    def __enter__(self):
        self.engine.peak_batch = 0
        return self

    def __exit__(self, *exc):
        self.rows = self.engine.peak_batch


def assert_matches(completion: Completion, tokens: list[int], log_probs: torch.Tensor) -> None:
    assert completion.token_ids == tokens
    torch.testing.assert_close(torch.tensor(completion.log_probs), log_probs, atol=LOGPROB_TOL, rtol=0)


def test_concurrent_greedy_equals_sync_hf_per_prompt(engine, hf, tok):
    prompts = [ids(tok, t) for t in PROMPTS]

    async def run():
        return await asyncio.gather(*[engine.generate(p, GREEDY, session_id=i) for i, p in enumerate(prompts)])

    with Peak(engine) as peak:
        outs = asyncio.run(run())
    assert peak.rows == len(PROMPTS)  # one running batch, left-padded, for all of them
    reasons = []
    for prompt, out in zip(prompts, outs):
        tokens, log_probs = reference(hf, prompt, GREEDY)
        assert_matches(out, tokens, log_probs)
        assert out.policy_versions == [0] * len(tokens)
        assert out.engine_id == "hf0" and out.metrics["engine/queue_s"] >= 0
        expected = "stop" if tokens[-1] == tok.eos_token_id else "length"
        assert len(tokens) == GREEDY.max_new_tokens or expected == "stop"
        assert out.finish_reason == expected
        reasons.append(expected)
    assert set(reasons) == {"stop", "length"}  # the random model ends "1+1=" with eos, the others run on
    assert engine.num_running() == 0
    busy = engine.busy_s
    assert busy > 0
    time.sleep(0.05)
    assert engine.busy_s == busy  # idle time is not busy time


def test_per_request_budgets_and_finish_reasons_in_one_batch(engine, hf, tok):
    """Requests with other budgets and other stop ids share one running batch; each stops at its own."""
    full = {t: reference(hf, ids(tok, t), GREEDY) for t in ("a", "hello", "1+1=", "2+2=")}
    eos_at = full["1+1="][0].index(tok.eos_token_id) + 1
    assert eos_at == 5 and len(full["hello"][0]) == 12  # what the tiny model (seed 0) does
    stop_id = full["2+2="][0][2]
    assert stop_id not in full["2+2="][0][:2]
    requests = [("a", 2), ("hello", 6), ("1+1=", 6), ("1+1=", eos_at), ("1+1=", eos_at - 1)]

    async def run():
        plain = [engine.generate(ids(tok, t), dataclasses.replace(GREEDY, max_new_tokens=m)) for t, m in requests]
        stop = engine.generate(ids(tok, "2+2="), dataclasses.replace(GREEDY, max_new_tokens=6,
                                                                     stop_token_ids=(stop_id,)))
        return await asyncio.gather(*plain, stop)

    with Peak(engine) as peak:
        *outs, stopped = asyncio.run(run())
    assert peak.rows == len(requests) + 1  # all in one batch
    expected = [(2, "length"), (6, "length"), (eos_at, "stop"), (eos_at, "stop"), (eos_at - 1, "length")]
    for (text, budget), out, (n, reason) in zip(requests, outs, expected):
        tokens, log_probs = full[text]
        assert len(out.token_ids) == n, (text, budget)
        assert_matches(out, tokens[:n], log_probs[:n])
        assert out.finish_reason == reason, (text, budget)
        assert len(out.policy_versions) == n
    tokens, log_probs = full["2+2="]
    assert_matches(stopped, tokens[:3], log_probs[:3])
    assert stopped.finish_reason == "stop"


def test_a_stop_string_completed_by_the_last_budgeted_token_is_a_stop(engine, hf, tok):
    """The string ends the response exactly at its budget: it stopped ("stop", as vLLM reports it),
    it was not cut. A budget one short of the string is a cut ("length")."""
    tokens, log_probs = reference(hf, ids(tok, "hello"), GREEDY)
    text = tok.decode(tokens)
    assert text.startswith("sjg:") and text.count("g:") > 1  # the tiny model's (seed 0) greedy text
    stop = dataclasses.replace(GREEDY, stop=("g:",))

    async def run():
        return await asyncio.gather(*[engine.generate(ids(tok, "hello"), dataclasses.replace(stop, max_new_tokens=m))
                                      for m in (4, 6, 3)])

    with Peak(engine) as peak:
        outs = asyncio.run(run())
    assert peak.rows == 3
    for out, (n, reason) in zip(outs, [(4, "stop"), (4, "stop"), (3, "length")]):
        assert_matches(out, tokens[:n], log_probs[:n])
        assert out.finish_reason == reason, (n, reason)


def test_max_num_seqs_splits_the_pending_requests(model_dir, hf, tok):
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig(max_num_seqs=2))
    assert engine.max_batch_size == 2
    prompts = [ids(tok, t) for t in PROMPTS[:5]]

    async def run():
        return await asyncio.gather(*[engine.generate(p, GREEDY) for p in prompts])

    with Peak(engine) as peak:
        outs = asyncio.run(run())
    assert peak.rows == 2  # the others waited for a free row
    for prompt, out in zip(prompts, outs):
        assert_matches(out, *reference(hf, prompt, GREEDY))


def test_request_checks(engine, tok):
    async def run(prompt, sampling):
        return await engine.generate(prompt, sampling)

    with pytest.raises(ValueError, match="n=1"):
        asyncio.run(run(ids(tok, "a"), dataclasses.replace(GREEDY, n=2)))
    with pytest.raises(ValueError, match="at least one prompt token"):
        asyncio.run(run([], GREEDY))
    with pytest.raises(ValueError, match="one log-prob and one version per token"):
        Completion([1, 2], [0.0], "stop", [0, 0])
    with pytest.raises(ValueError, match="finish_reason"):
        Completion([1], [0.0], "eos", [0])


class SlowStep:
    """Makes the engine's decode steps signal when one starts, then take ``delay_s`` longer."""

    def __init__(self, async_engine, delay_s=0.05):
        self.batch, self.delay_s = async_engine.batch, delay_s
        self.started = threading.Event()
        self.count = 0

    def __call__(self, tokens):
        self.count += 1
        self.started.set()
        time.sleep(self.delay_s)
        return type(self.batch).step(self.batch, tokens)

    def __enter__(self):
        self.batch.step = self
        return self

    def __exit__(self, *exc):
        del self.batch.step


def _update_around_requests(engine, prompts, state, version):
    """Request A decoding when the update begins, request B sent after it began; the update
    (bucketed); then every prompt. Returns A, B, the update's metrics, the rest, #buckets."""

    async def run():
        buckets = list(pack_buckets(state.items(), BUCKET))
        with SlowStep(engine) as slow:
            running = asyncio.create_task(engine.generate(prompts[1], GREEDY))
            await asyncio.to_thread(slow.started.wait, 30)  # A is in the running batch
            update = asyncio.create_task(engine.update_weights(buckets, version))
            await asyncio.sleep(0)  # the update has begun: the engine admits no one now
            queued = asyncio.create_task(engine.generate(prompts[2], GREEDY))
            metrics = await update
            assert running.done()  # the update waited for the request in flight
        after = await asyncio.gather(*[engine.generate(p, GREEDY) for p in prompts])
        return await running, await queued, metrics, after, len(buckets)

    return asyncio.run(run())


def test_update_weights_in_buckets_changes_greedy_and_stamps_the_version(engine, hf, hf_new, tok, new_state):
    prompts = [ids(tok, t) for t in PROMPTS]
    old = [reference(hf, p, GREEDY) for p in prompts]
    new = [reference(hf_new, p, GREEDY) for p in prompts]
    assert sum(o[0] != n[0] for o, n in zip(old, new)) >= len(prompts) // 2  # the new weights differ

    running, queued, metrics, after, num_buckets = _update_around_requests(engine, prompts, new_state, version=1)
    assert num_buckets > 1
    assert_matches(running, *old[1])  # the request in flight finishes with the old weights ...
    assert running.policy_versions == [0] * len(running.token_ids)
    assert_matches(queued, *new[2])  # ... one that came during the update gets the new ones
    assert queued.policy_versions == [1] * len(queued.token_ids)
    assert engine.policy_version == 1 and metrics["engine/policy_version"] == 1.0
    assert metrics["engine/weight_update_s"] >= 0
    for out, (tokens, log_probs) in zip(after, new):  # ... and everything after with the new ones
        assert_matches(out, tokens, log_probs)
        assert out.policy_versions == [1] * len(tokens)


def test_updates_from_successive_event_loops(engine, hf, hf_new, tok, model_dir, new_state):
    """The engine outlives an event loop (notebooks and tests call asyncio.run again and again):
    an update with a request in flight in one loop, another one in the next loop."""
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    prompts = [ids(tok, t) for t in PROMPTS[:4]]
    for state, ref in ((new_state, hf_new), (original, hf), (new_state, hf_new)):
        version = engine.policy_version + 1
        _, queued, metrics, after, _ = _update_around_requests(engine, prompts, state, version)
        assert set(queued.policy_versions) == {version}
        assert metrics["engine/policy_version"] == version
        for prompt, out in zip(prompts, after):
            assert_matches(out, *reference(ref, prompt, GREEDY))
            assert set(out.policy_versions) == {version}


def test_update_protocol_errors(model_dir, new_state):
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())
    [bucket, *_] = pack_buckets(new_state.items(), BUCKET)

    async def run():
        with pytest.raises(RuntimeError, match="outside begin_update"):
            await engine.load_bucket(bucket)
        with pytest.raises(RuntimeError, match="without begin_update"):
            await engine.finish_update()
        await engine.begin_update(5)
        with pytest.raises(RuntimeError, match="another weight update"):
            await engine.begin_update(6)
        bad = next(pack_buckets([("model.not_a_weight", torch.zeros(2))], BUCKET))
        with pytest.raises(KeyError, match="not a parameter"):
            await engine.load_bucket(bad)
        await engine.load_bucket(bucket)
        await engine.finish_update()
        assert engine.policy_version == 5
        await engine.close()

    asyncio.run(run())


def test_requests_joining_a_running_batch_each_equal_a_solo_generate(model_dir, hf, tok):
    """Token-level continuous batching: requests arrive at staggered times, join the batch between
    decode steps and leave when done (others still running); each one's greedy tokens and
    log-probs are those of HF generate on its prompt alone."""
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())
    budgets = [20, 3, 12, 1, 16, 7, 24, 5]

    async def one(i, text):
        await asyncio.sleep(0.02 * i)
        return await engine.generate(ids(tok, text), dataclasses.replace(GREEDY, max_new_tokens=budgets[i]))

    async def run():
        with SlowStep(engine, delay_s=0.005) as slow:
            outs = await asyncio.gather(*[one(i, t) for i, t in enumerate(PROMPTS)])
        return outs, slow.count

    with Peak(engine) as peak:
        outs, steps = asyncio.run(run())
    for text, budget, out in zip(PROMPTS, budgets, outs):
        assert_matches(out, *reference(hf, ids(tok, text), dataclasses.replace(GREEDY, max_new_tokens=budget)))
    assert 1 < peak.rows < len(PROMPTS) or steps < sum(budgets)  # they overlapped, not one after another
    assert steps < sum(budgets) and engine.rows == [] and len(engine.batch) == 0
    asyncio.run(engine.close())


def test_a_sessions_next_turn_reuses_its_kv_and_still_equals_a_solo_generate(model_dir, hf, tok):
    """Multi-turn sessions: turn 2 extends turn 1's prompt and reply, so only its new tokens are
    prefilled (the rest from the session's cached KV, with other sessions' rows in the batch), and
    its greedy output is still HF generate's on the whole context alone. A request that does not
    extend the session's last one, or one after a weight update, starts from scratch."""
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())
    texts = ["1+1=", "12+3=", "hello", "7*8="]

    async def session(i, text):
        await asyncio.sleep(0.01 * i)
        first = await engine.generate(ids(tok, text), GREEDY, session_id=i)
        context = ids(tok, text) + first.token_ids + ids(tok, " no. again: ")
        second = await engine.generate(context, GREEDY, session_id=i)
        other = await engine.generate(ids(tok, "x" + text), GREEDY, session_id=i)  # not an extension
        return first, context, second, other

    async def run():
        return await asyncio.wait_for(asyncio.gather(*[session(i, t) for i, t in enumerate(texts)]), 60)

    results = asyncio.run(run())
    for text, (first, context, second, other) in zip(texts, results):
        assert first.metrics["engine/cached_prompt_tokens"] == 0
        assert second.metrics["engine/cached_prompt_tokens"] == len(ids(tok, text)) + len(first.token_ids) - 1
        assert_matches(second, *reference(hf, context, GREEDY))
        assert other.metrics["engine/cached_prompt_tokens"] == 0
        assert_matches(other, *reference(hf, ids(tok, "x" + text), GREEDY))
    assert set(engine.prefix_cache.entries) == set(range(len(texts)))

    async def after_update():
        state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        await engine.update_weights(pack_buckets(state.items(), BUCKET), 1)
        first, context, _, _ = results[0]
        return await engine.generate(context, GREEDY, session_id=0)

    again = asyncio.run(after_update())
    assert again.metrics["engine/cached_prompt_tokens"] == 0  # the update dropped the old weights' KV
    asyncio.run(engine.close())


def test_rows_of_other_sampling_settings_share_a_batch_with_their_own_processed_log_probs(model_dir, hf, tok):
    """Temperature / top-k / top-p rows next to greedy ones: each row's log-probs are the
    log-softmax of its own warped scores at its token (hand-computed, teacher-forced)."""
    from engine_fixtures import hand_log_probs

    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig(seed=3))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    settings = [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.8), {}]
    samplings = [dataclasses.replace(GREEDY, do_sample=bool(kw), max_new_tokens=10, **kw) for kw in settings]
    prompts = [ids(tok, t) for t in PROMPTS[:4]]

    async def run():
        return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, samplings)])

    with Peak(engine) as peak:
        outs = asyncio.run(run())
    assert peak.rows == 4
    for prompt, kw, out in zip(prompts, settings, outs):
        expected = hand_log_probs(model, prompt, out.token_ids, **kw)
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=LOGPROB_TOL, rtol=0)
    assert_matches(outs[3], *reference(hf, prompts[3], samplings[3]))
    asyncio.run(engine.close())


def test_streaming_yields_the_tokens_as_they_come_then_the_same_completion(engine, tok):
    prompt = ids(tok, "hello")
    long = dataclasses.replace(GREEDY, max_new_tokens=24, ignore_eos=True)

    async def run():
        arrivals, items = [], []
        with SlowStep(engine, delay_s=0.01):
            async for item in engine.generate_stream(prompt, long):
                arrivals.append(time.perf_counter())
                items.append(item)
        return items, arrivals, await engine.generate(prompt, long)

    items, arrivals, whole = asyncio.run(run())
    *chunks, final = items
    assert isinstance(final, Completion) and all(isinstance(c, TokenChunk) for c in chunks)
    assert len(chunks) > 10  # token by token, not the turn at once
    assert arrivals[-1] - arrivals[0] > 0.1  # the first chunk came well before the end (24 steps of >= 10 ms)
    assert [t for c in chunks for t in c.token_ids] == final.token_ids == whole.token_ids
    assert [lp for c in chunks for lp in c.log_probs] == final.log_probs
    assert [v for c in chunks for v in c.policy_versions] == final.policy_versions


def test_a_caller_that_goes_away_leaves_the_batch(model_dir, tok):
    """A cancelled request and a stream closed early are dropped at the next step, not run to the end."""
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())
    long = dataclasses.replace(GREEDY, max_new_tokens=2000, ignore_eos=True)

    async def run():
        with SlowStep(engine, delay_s=0.002) as slow:
            task = asyncio.create_task(engine.generate(ids(tok, "a"), long))
            await asyncio.to_thread(slow.started.wait, 30)
            task.cancel()
            stream = engine.generate_stream(ids(tok, "b"), long)
            first = await anext(stream)
            await stream.aclose()
            for _ in range(500):
                if not engine.rows and engine.num_running() == 0:
                    break
                await asyncio.sleep(0.01)
            return first, slow.count

    first, steps = asyncio.run(run())
    assert isinstance(first, TokenChunk) and engine.rows == [] and engine.num_running() == 0
    assert steps < 1000  # far from the 2000 tokens either would have run to
    asyncio.run(engine.close())


def test_an_update_in_flight_switches_versions_between_two_steps(model_dir, hf, hf_new, tok, new_state):
    """Partial rollout on HF: the swap lands between two decode steps of a running request; tokens
    before it are the old weights' greedy ones, after it the new weights' greedy continuation of
    the context so far (its KV recomputed), and ``policy_versions`` says where."""
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())
    prompt = ids(tok, "7*8=")
    long = dataclasses.replace(GREEDY, max_new_tokens=24, ignore_eos=True)
    old_tokens, _ = reference(hf, prompt, long)

    async def run():
        with SlowStep(engine, delay_s=0.01) as slow:
            task = asyncio.create_task(engine.generate(prompt, long))
            while slow.count < 6:
                await asyncio.sleep(0.005)
            metrics = await engine.update_weights(pack_buckets(new_state.items(), BUCKET), 1, in_flight=True)
            return await task, metrics

    out, metrics = asyncio.run(run())
    k = out.policy_versions.index(1)
    assert 0 < k < len(out.token_ids) and out.policy_versions == [0] * k + [1] * (len(out.token_ids) - k)
    assert out.token_ids[:k] == old_tokens[:k]
    new_tokens, new_log_probs = reference(hf_new, prompt + out.token_ids[:k],
                                          dataclasses.replace(long, max_new_tokens=len(out.token_ids) - k))
    assert out.token_ids[k:] == new_tokens and out.token_ids != old_tokens
    torch.testing.assert_close(torch.tensor(out.log_probs[k:]), new_log_probs, atol=LOGPROB_TOL, rtol=0)
    assert metrics["engine/policy_version"] == 1.0 == engine.policy_version
    asyncio.run(engine.close())


# ------------------------------------------------------------------ vLLM (one fp32 engine)
VLLM_MAX_NEW = 24
VLLM_BUCKET = 1 << 20  # about one decoder layer of the tiny model per bucket


@pytest.fixture(scope="module")
def vllm_loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def vllm_engine(model_dir, vllm_loop):
    pytest.importorskip("vllm")
    from rlcore.engines.async_vllm import AsyncVLLMEngine

    # plain: the updates through shared-memory buckets are copies into the matmul layers' own weights
    # (the packed layout is tested in process: test_vllm_in_place_sync.py)
    cfg = RolloutConfig(backend="vllm", dtype="float32", max_new_tokens=VLLM_MAX_NEW, kv_cache_memory_bytes=1 << 28,
                        max_model_len=128, cpu_weight_layout="plain", max_num_seqs=3)

    async def build():  # AsyncLLM belongs to the loop it runs on: every vLLM test uses this one
        return AsyncVLLMEngine(ModelConfig(path=model_dir), cfg, engine_id="v0")

    engine = vllm_loop.run_until_complete(build())
    yield engine
    vllm_loop.run_until_complete(engine.close())
    engine.llm = None  # AsyncLLM's __del__ shuts down again: let it run now, not at interpreter exit
    gc.collect()


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_concurrent_greedy_equals_hf(vllm_engine, vllm_loop, hf, tok):
    prompts = [ids(tok, t) for t in PROMPTS]
    sampling = dataclasses.replace(GREEDY, max_new_tokens=16)

    async def run():
        return await asyncio.gather(*[vllm_engine.generate(p, sampling, session_id=i) for i, p in enumerate(prompts)])

    assert vllm_engine.llm.vllm_config.scheduler_config.max_num_seqs == 3  # rollout.max_num_seqs
    assert len(prompts) > 3  # the others wait for a free sequence slot
    outs = vllm_loop.run_until_complete(run())
    for prompt, out in zip(prompts, outs):
        tokens, log_probs = reference(hf, prompt, sampling)
        assert_matches(out, tokens, log_probs)
        assert out.finish_reason == ("stop" if tokens[-1] == tok.eos_token_id else "length")
        assert out.policy_versions == [0] * len(tokens) and out.engine_id == "v0"
    assert vllm_engine.num_running() == 0


@pytest.mark.vllm
def test_vllm_engine_core_runs_its_norms_on_the_cpu_kernels(vllm_engine, vllm_loop):
    """The engine core is a process of its own: rlcore.engines.vllm_worker registered the CPU kernels
    there (as vLLM imported it) before the worker set the priorities the engine's kernel_config names."""
    from rlcore.engines.vllm_cpu_norm import PROVIDER

    providers = vllm_loop.run_until_complete(vllm_engine.llm.collective_rpc("norm_providers"))[0]
    assert providers["rms_norm"][0] == PROVIDER and providers["fused_add_rms_norm"][0] == PROVIDER
    assert providers["rms_norm"][-1] == "native"  # what the kernels cannot take


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_streams_the_tokens_then_the_same_completion_and_a_closed_stream_is_aborted(vllm_engine, vllm_loop,
                                                                                         hf, tok):
    prompt = ids(tok, "hello")
    sampling = dataclasses.replace(GREEDY, max_new_tokens=VLLM_MAX_NEW, ignore_eos=True)

    async def run():
        items = [item async for item in vllm_engine.generate_stream(prompt, sampling)]
        stream = vllm_engine.generate_stream(prompt, dataclasses.replace(sampling, max_new_tokens=100))
        first = await anext(stream)
        await stream.aclose()
        for _ in range(500):
            if vllm_engine.llm.output_processor.get_num_unfinished_requests() == 0:
                break
            await asyncio.sleep(0.01)
        return items, first, vllm_engine.llm.output_processor.get_num_unfinished_requests()

    items, first, unfinished = vllm_loop.run_until_complete(run())
    *chunks, final = items
    assert isinstance(final, Completion) and len(chunks) > 1 and isinstance(first, TokenChunk)
    tokens, log_probs = reference(hf, prompt, sampling)
    assert_matches(final, tokens, log_probs)
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert [lp for c in chunks for lp in c.log_probs] == final.log_probs
    versions = [vllm_engine.policy_version] * len(tokens)
    assert final.policy_versions == [v for c in chunks for v in c.policy_versions] == versions
    assert unfinished == 0 and vllm_engine.num_running() == 0  # the closed stream was aborted in vLLM


def check_top_logprobs(completion: Completion, model_dir: str, prompt: list[int], k: int) -> None:
    """Each step's k best (id, log-prob) are those of a full forward of the model, best first."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1]
    reference_top = torch.log_softmax(logits.float(), -1).topk(k)
    assert len(completion.top_logprobs) == len(completion.token_ids)
    for step, pairs in enumerate(completion.top_logprobs):
        assert [i for i, _ in pairs] == reference_top.indices[step].tolist()
        assert [v for _, v in pairs] == pytest.approx(reference_top.values[step].tolist(), abs=1e-4)
    assert completion.token_ids[0] == completion.top_logprobs[0][0][0]  # greedy: the best one


def test_hf_top_logprobs_rank_each_step(tok, model_dir):
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())  # the module's one has other weights by now
    prompt = ids(tok, "12+3=")
    out = asyncio.run(engine.generate(prompt, dataclasses.replace(GREEDY, top_logprobs=3)))
    check_top_logprobs(out, model_dir, prompt, 3)
    assert asyncio.run(engine.generate(prompt, GREEDY)).top_logprobs is None  # only when asked


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_top_logprobs_rank_each_step(vllm_engine, vllm_loop, tok, model_dir):
    prompt = ids(tok, "12+3=")
    out = vllm_loop.run_until_complete(vllm_engine.generate(prompt, dataclasses.replace(GREEDY, top_logprobs=3)))
    check_top_logprobs(out, model_dir, prompt, 3)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_update_in_flight_switches_versions_mid_response(vllm_engine, vllm_loop, hf, hf_new, tok, new_state,
                                                              model_dir):
    """Partial rollout: the weights change between two decode steps of one request. Tokens before
    the switch are the old weights' greedy ones, tokens after it the new weights' greedy
    continuation of the context so far (KV recomputed), and ``policy_versions`` says where."""
    prompt = ids(tok, "7*8=")
    long = dataclasses.replace(GREEDY, max_new_tokens=VLLM_MAX_NEW, ignore_eos=True)
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    old_tokens, _ = reference(hf, prompt, long)

    async def attempt(delay, version, state):
        task = asyncio.create_task(vllm_engine.generate(prompt, long))
        await asyncio.sleep(delay)
        await vllm_engine.begin_update(version, in_flight=True)
        for bucket in pack_buckets(state.items(), VLLM_BUCKET):
            await vllm_engine.load_bucket(bucket)
        metrics = await vllm_engine.finish_update()
        return await task, metrics

    async def reset(version):  # back to the original weights, between requests
        return await vllm_engine.update_weights(pack_buckets(original.items(), VLLM_BUCKET), version)

    # Where the request stands when the update begins depends on timing: adjust the delay until
    # the switch falls inside the response (a few tries at most).
    delay, version, tried = 0.05, vllm_engine.policy_version, []
    for _ in range(8):
        version += 1
        out, metrics = vllm_loop.run_until_complete(attempt(delay, version, new_state))
        versions = out.policy_versions
        tried.append((delay, versions))
        assert len(out.token_ids) == VLLM_MAX_NEW and out.finish_reason == "length"
        assert set(versions) <= {version - 1, version} and versions == sorted(versions)  # one switch
        if version - 1 in versions and version in versions:
            break
        delay = delay / 3 if version not in versions else delay * 2.5  # finished first / paused too early
        version += 1
        vllm_loop.run_until_complete(reset(version))
    else:
        pytest.fail(f"never caught the request mid-response: {tried}")

    k = versions.index(version)
    assert 0 < k < VLLM_MAX_NEW
    assert out.token_ids[:k] == old_tokens[:k]  # the old weights' greedy tokens ...
    context = prompt + out.token_ids[:k]
    cont = dataclasses.replace(long, max_new_tokens=VLLM_MAX_NEW - k)
    new_tokens, new_log_probs = reference(hf_new, context, cont)
    assert out.token_ids[k:] == new_tokens  # ... then the new weights' continuation of that context
    torch.testing.assert_close(torch.tensor(out.log_probs[k:]), new_log_probs, atol=LOGPROB_TOL, rtol=0)
    assert out.token_ids != old_tokens  # the switch did change the response

    assert 0 < metrics["engine/peak_bucket_bytes"] <= VLLM_BUCKET
    total = sum(v.numel() * v.element_size() for v in new_state.values())
    assert metrics["engine/weight_bytes"] >= total > metrics["engine/peak_bucket_bytes"]  # several buckets
    assert metrics["engine/policy_version"] == version == vllm_engine.policy_version

    async def fresh():
        return await vllm_engine.generate(prompt, long)

    after = vllm_loop.run_until_complete(fresh())  # a request after the update: all new
    assert after.token_ids == reference(hf_new, prompt, long)[0]
    assert after.policy_versions == [version] * VLLM_MAX_NEW


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_weight_checksums_after_a_bucketed_update_equal_the_trainers(vllm_engine, vllm_loop, new_state, model_dir):
    """The consistency check's read-back through AsyncLLM's worker (``BucketLoader.weight_checksums``):
    after an update in buckets, every HF tensor (fused q/k/v and gate/up parts included) matches
    the trainer's checksums; a tensor of another model is named. Refused during an update."""
    from rlcore.algos.consistency import weight_fingerprints as weight_checksums
    from rlcore.trainer.consistency import compare_weights

    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    version = vllm_engine.policy_version + 1

    async def run():
        await vllm_engine.update_weights(pack_buckets(new_state.items(), VLLM_BUCKET), version)
        sums = await vllm_engine.weight_checksums()
        await vllm_engine.begin_update(version + 1)
        try:
            with pytest.raises(RuntimeError, match="during a weight update"):
                await vllm_engine.weight_checksums()
        finally:
            for bucket in pack_buckets(original.items(), VLLM_BUCKET):
                await vllm_engine.load_bucket(bucket)
            await vllm_engine.finish_update()
        return sums

    sums = vllm_loop.run_until_complete(run())
    assert all(sums[name] is not None for name in new_state)  # plain layout: every tensor readable
    dtypes = {name: c[0] for name, c in sums.items()}
    report = compare_weights(1, {"tensors": weight_checksums(new_state.items(), dtypes)}, [sums])
    assert report.ok and report.tensors == len(new_state) and report.unreadable == []
    changed = {name for name in new_state if not torch.equal(new_state[name], original[name])}
    stale = compare_weights(1, {"tensors": weight_checksums(original.items(), dtypes)}, [sums])
    assert set(stale.differ) == changed and changed
