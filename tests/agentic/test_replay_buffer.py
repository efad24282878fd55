"""ReplayBuffer (hand-built batches), importance weights (hand numbers), and the async loop with a
real in-process rollout worker and FSDP actor on a tiny model."""

import math
import time

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rlcore.agentic.replay_buffer import AsyncRolloutLoop, ReplayBuffer, importance_weights
from rlcore.data.arithmetic import make_arithmetic_examples
from rlcore.data.dataset import collate_prompts
from rlcore.models.tiny import build_tiny_model
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker
from rlcore.workers.rollout import RolloutWorker


def make_rows(prompts, responses, t_p=None, t_r=None, row_ids=None, temperature=1.0) -> DataProto:
    """A rollout batch: left-padded prompts, right-padded responses (pad 0), log-prob -(row_id + j/10)."""
    n = len(prompts)
    t_p = t_p or max(map(len, prompts))
    t_r = t_r or max(map(len, responses))
    row_ids = list(range(n)) if row_ids is None else row_ids
    p = torch.zeros((n, t_p), dtype=torch.long)
    pm = torch.zeros_like(p)
    r = torch.zeros((n, t_r), dtype=torch.long)
    rm = torch.zeros_like(r)
    lp = torch.zeros((n, t_r))
    for i, (pi, ri) in enumerate(zip(prompts, responses)):
        p[i, t_p - len(pi):], pm[i, t_p - len(pi):] = torch.tensor(pi), 1
        r[i, : len(ri)], rm[i, : len(ri)] = torch.tensor(ri), 1
        lp[i, : len(ri)] = -(row_ids[i] + torch.arange(len(ri)) / 10)
    mask = torch.cat([pm, rm], 1)
    return DataProto.from_dict(
        {"prompts": p, "responses": r, "response_mask": rm, "input_ids": torch.cat([p, r], 1),
         "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "rollout_log_probs": lp,
         "uid_num": torch.tensor(row_ids)},
        {"row_id": np.array(row_ids, dtype=np.int64)},
        {"temperature": temperature, "rollout/gen_time_s": 1.0},
    )


def simple(row_ids, temperature=1.0):
    return make_rows([[5, 6]] * len(row_ids), [[7, 8]] * len(row_ids), row_ids=row_ids, temperature=temperature)


def test_fifo_eviction_and_version_bookkeeping():
    buf = ReplayBuffer(capacity=5, max_staleness=10)
    buf.add(simple([0, 1, 2]), policy_version=0)
    buf.add(simple([3, 4, 5]), policy_version=1)
    assert (len(buf), buf.num_added, buf.num_evicted) == (5, 6, 1)  # row 0, the oldest, went
    out = buf.pop_batch(2, current_version=1)
    assert out.non_tensor_batch["row_id"].tolist() == [1, 2]
    assert out.non_tensor_batch["policy_version"].tolist() == [0, 0]
    assert out.meta_info == {"temperature": 1.0}  # per-batch metrics are not carried
    out = buf.pop_batch(3, current_version=1)
    assert out.non_tensor_batch["row_id"].tolist() == [3, 4, 5]
    assert out.non_tensor_batch["policy_version"].tolist() == [1, 1, 1]
    assert len(buf) == 0
    buf.add(simple([6, 7, 8, 9, 10, 11, 12]), policy_version=2)  # one batch larger than the buffer
    assert buf.pop_batch(5, 2).non_tensor_batch["row_id"].tolist() == [8, 9, 10, 11, 12]
    assert buf.num_evicted == 3


def test_staleness_filter_counts_drops():
    buf = ReplayBuffer(capacity=100, max_staleness=1)
    for version in range(2):
        buf.add(simple([10 * version, 10 * version + 1]), policy_version=version)
    assert buf.drop_stale(current_version=1) == 0
    buf.add(simple([20, 21]), policy_version=2)
    assert buf.drop_stale(current_version=2) == 2  # version 0 is 2 behind
    out = buf.sample(4, current_version=2, rng=np.random.default_rng(0))
    assert sorted(out.non_tensor_batch["row_id"].tolist()) == [10, 11, 20, 21]
    assert len(buf) == 4  # sampling leaves rows in place
    out = buf.pop_batch(2, current_version=3)  # now version 1 is stale too
    assert out.non_tensor_batch["row_id"].tolist() == [20, 21]
    assert (buf.num_dropped_stale, len(buf)) == (4, 0)
    on_policy = ReplayBuffer(capacity=10, max_staleness=0)
    on_policy.add(simple([1]), 4)
    with pytest.raises(ValueError, match="asked for 1 rows but the buffer holds 0 fresh rows"):
        on_policy.pop_batch(1, current_version=5)
    on_policy.add(simple([2]), 6)
    with pytest.raises(ValueError, match="newer than the current version 5"):
        on_policy.drop_stale(5)


def test_sample_is_seeded_distinct_and_bounded():
    buf = ReplayBuffer(capacity=10, max_staleness=0)
    buf.add(simple(list(range(10))), 0)
    a = buf.sample(6, 0, np.random.default_rng(7)).non_tensor_batch["row_id"].tolist()
    b = buf.sample(6, 0, np.random.default_rng(7)).non_tensor_batch["row_id"].tolist()
    assert a == b == np.random.default_rng(7).choice(10, size=6, replace=False).tolist()
    assert len(set(a)) == 6
    with pytest.raises(ValueError, match="asked for 11 rows"):
        buf.sample(11, 0, np.random.default_rng(0))


def test_rows_of_different_widths_are_padded_then_trimmed():
    buf = ReplayBuffer(capacity=10, max_staleness=0, pad_token_id=0)
    buf.add(make_rows([[11], [12, 13]], [[21, 22], [23]], t_p=2, t_r=3, row_ids=[0, 1]), 0)
    buf.add(make_rows([[31, 32, 33]], [[41]], row_ids=[2]), 0)
    out = buf.pop_batch(3, 0)
    b = out.batch
    # Prompt side left-padded to 3, response side trimmed to 2 (no row uses a third response token).
    assert b["prompts"].tolist() == [[0, 0, 11], [0, 12, 13], [31, 32, 33]]
    assert b["responses"].tolist() == [[21, 22], [23, 0], [41, 0]]
    assert b["input_ids"].tolist() == [[0, 0, 11, 21, 22], [0, 12, 13, 23, 0], [31, 32, 33, 41, 0]]
    assert b["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert b["response_mask"].tolist() == [[1, 1], [1, 0], [1, 0]]
    assert b["rollout_log_probs"].tolist() == [[0.0, pytest.approx(-0.1)], [-1.0, 0.0], [-2.0, 0.0]]
    real = b["attention_mask"].bool()
    assert b["position_ids"][real].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3]
    assert b["uid_num"].tolist() == [0, 1, 2]
    # Rows taken alone come back at their own widths.
    buf.add(make_rows([[31, 32, 33]], [[41]], row_ids=[2]), 0)
    buf.add(make_rows([[11], [12, 13]], [[21, 22], [23]], t_p=2, t_r=3, row_ids=[0, 1]), 0)
    assert buf.pop_batch(1, 0).batch["input_ids"].tolist() == [[31, 32, 33, 41]]
    assert buf.pop_batch(2, 0).batch["input_ids"].tolist() == [[0, 11, 21, 22], [12, 13, 23, 0]]


def test_bad_batches_are_refused():
    buf = ReplayBuffer(capacity=10, max_staleness=0)
    with pytest.raises(ValueError, match="capacity >= 1"):
        ReplayBuffer(capacity=0, max_staleness=0)
    with pytest.raises(KeyError, match="'input_ids', 'attention_mask', 'responses'"):
        buf.add(DataProto.from_dict({"x": torch.zeros(2)}), 0)
    buf.add(simple([0]), 0)
    with pytest.raises(ValueError, match="temperature 0.5 differs"):
        buf.add(simple([1], temperature=0.5), 0)
    with pytest.raises(KeyError, match="differ from the buffer's"):
        buf.add(simple([1]).select(batch_keys=["input_ids", "responses", "attention_mask"]), 0)
    popped = buf.pop_batch(1, 0)
    with pytest.raises(ValueError, match="already has a 'policy_version'"):
        buf.add(popped, 0)


def test_importance_weights_hand_numbers():
    # Row 0 fresh (current == behaviour), row 1 stale; the last token of each row is padding.
    behaviour = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -2.0, 0.0]])
    current = torch.tensor([[-1.0, -2.0, -9.0], [-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    batch = DataProto.from_dict({"rollout_log_probs": behaviour, "response_mask": mask})
    w, metrics = importance_weights(batch, current, cap=2.0, level="token")
    expected = torch.tensor([[1.0, 1.0, 0.0], [math.exp(-0.5), 2.0, 0.0]])  # exp(1.0) capped at 2
    torch.testing.assert_close(w, expected)
    assert metrics["is/capped_frac"] == pytest.approx(0.25)
    assert metrics["is/weight_mean"] == pytest.approx((2 + math.exp(-0.5) + 2) / 4)
    w, _ = importance_weights(batch, current, cap=2.0, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [math.exp(0.5)] * 2 + [0.0]]))


# ------------------------------------------------------------------ real rollout and actor
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_rb"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def groups(model_dir):
    rollout = LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {
        "model": {"path": model_dir}, "rollout": {"max_new_tokens": 4, "temperature": 0.9, "seed": 0}}))
    rollout.init_model()
    actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": model_dir}, "actor": {
        "optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "grad_clip": None, "use_rollout_is": True,
        "ppo_micro_batch_size_per_gpu": 4, "shuffle": False}}))
    actor.init_model()
    return rollout, actor


def prompt_batches(tok, batch_size=4, n_batches=1000):
    """Arithmetic prompts, left-padded, as a prompt loader yields them."""
    rows = make_arithmetic_examples(batch_size * n_batches, seed=0)
    for start in range(0, len(rows), batch_size):
        items = [{"input_ids": torch.tensor(tok(r["prompt"])["input_ids"]), "answer": r["answer"]}
                 for r in rows[start: start + batch_size]]
        yield DataProto.from_dict(*collate_prompts(items, tok.pad_token_id))


def train_step(actor, batch):
    """One actor update on the batch (advantage +1 on every token), as an async recipe would."""
    batch = batch.union(actor.compute_log_prob(batch))
    batch.batch["advantages"] = batch.batch["response_mask"].float()
    actor.update_policy(batch)
    return batch


def test_stale_rows_get_weights_away_from_one(groups, tok):
    rollout, actor = groups
    prompts = prompt_batches(tok)
    buf = ReplayBuffer(capacity=16, max_staleness=1)
    rollout.update_weights(actor.get_full_state_dict())
    buf.add(rollout.generate_sequences(next(prompts)), policy_version=0)
    train_step(actor, buf.sample(4, 0, np.random.default_rng(0)))
    rollout.update_weights(actor.get_full_state_dict())
    buf.add(rollout.generate_sequences(next(prompts)), policy_version=1)

    batch = buf.sample(8, current_version=1, rng=np.random.default_rng(0))
    current = actor.compute_log_prob(batch).batch["old_log_probs"]
    weights, _ = importance_weights(batch, current, cap=10.0)
    mask = batch.batch["response_mask"].bool()
    fresh = torch.tensor(batch.non_tensor_batch["policy_version"] == 1)
    assert fresh.sum() == 4
    torch.testing.assert_close(weights[fresh][mask[fresh]], torch.ones(int(mask[fresh].sum())), atol=1e-4, rtol=0)
    assert (weights[~fresh][mask[~fresh]] - 1).abs().max() > 1e-2


def test_async_loop_trains_on_fresh_rows_with_exact_versions(groups, tok):
    rollout, actor = groups
    rollout.update_weights(actor.get_full_state_dict())
    buf = ReplayBuffer(capacity=8, max_staleness=0)
    popped = 0
    with AsyncRolloutLoop(rollout, prompt_batches(tok), buf, version=0) as loop:
        for step in range(3):
            batch = loop.pop_batch(4, timeout=120)
            popped += 4
            assert batch.non_tensor_batch["policy_version"].tolist() == [step] * 4
            trained = train_step(actor, batch)
            # The rows were sampled by exactly the weights the actor had at that version.
            mask = trained.batch["response_mask"].bool()
            torch.testing.assert_close(trained.batch["old_log_probs"][mask], trained.batch["rollout_log_probs"][mask],
                                       atol=1e-4, rtol=0)
            loop.publish_weights(actor.get_full_state_dict(), version=step + 1)
        with pytest.raises(ValueError, match="versions must increase"):
            loop.publish_weights({}, version=3)
        with pytest.raises(ValueError, match="never be served"):
            loop.pop_batch(9)
    assert buf.num_added == popped + len(buf) + buf.num_dropped_stale + buf.num_evicted
    assert buf.num_evicted == 0  # the producer waits instead of overrunning the buffer


def test_async_loop_samples_the_next_batch_while_the_trainer_trains(groups, tok):
    """Capacity of one batch, staleness 1: once the trainer pops, the producer samples the next batch
    with the weights it has, before any are published: one step off-policy, the two overlapping."""
    rollout, actor = groups
    rollout.update_weights(actor.get_full_state_dict())
    buf = ReplayBuffer(capacity=4, max_staleness=1)
    with AsyncRolloutLoop(rollout, prompt_batches(tok), buf, version=0) as loop:
        assert loop.pop_batch(4, timeout=120).non_tensor_batch["policy_version"].tolist() == [0] * 4
        deadline = time.monotonic() + 120
        while len(buf) < 4 and time.monotonic() < deadline:  # the trainer would be updating now
            time.sleep(0.02)
        assert len(buf) == 4, "the producer did not refill the buffer after a pop"
        loop.publish_weights(actor.get_full_state_dict(), version=1)
        assert loop.pop_batch(4, timeout=120).non_tensor_batch["policy_version"].tolist() == [0] * 4


def test_async_loop_reports_producer_end_and_failure(groups, tok):
    rollout, _ = groups
    one_batch = list(prompt_batches(tok, n_batches=1))
    with AsyncRolloutLoop(rollout, one_batch, ReplayBuffer(capacity=8, max_staleness=0)) as loop:
        assert len(loop.pop_batch(4, timeout=60)) == 4
        with pytest.raises(RuntimeError, match="producer has finished"):
            loop.pop_batch(4, timeout=60)
    bad = [one_batch[0].select(batch_keys=["input_ids", "attention_mask"])]
    with AsyncRolloutLoop(rollout, bad, ReplayBuffer(capacity=8, max_staleness=0)) as loop:
        with pytest.raises(RuntimeError, match="producer failed.*position_ids"):
            loop.pop_batch(4, timeout=60)


def test_sampling_filters_travel_with_the_rows_and_must_match():
    """top_k / top_p give rollout_log_probs their meaning (the actor scores under them), like the
    temperature: kept in meta_info, and batches under other filters are refused."""
    buf = ReplayBuffer(capacity=10, max_staleness=10)
    first = simple([0, 1])
    first.meta_info.update(top_k=5, top_p=0.9)
    buf.add(first, policy_version=0)
    unfiltered = simple([2])
    with pytest.raises(ValueError, match="sampling filters"):
        buf.add(unfiltered, policy_version=0)
    second = simple([3])
    second.meta_info.update(top_k=5, top_p=0.9)
    buf.add(second, policy_version=0)
    assert buf.pop_batch(3, current_version=0).meta_info == {"temperature": 1.0, "top_k": 5, "top_p": 0.9}
