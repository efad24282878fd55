"""Prompt sources (rlcore.data.sources): seeded, resumable, validation held out, clear errors, and the
reasoning-gym and verifiers adapters scoring exactly as the libraries do."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.data.sources import RowStream, open_source, prompt_key
from rlcore.rewards.registry import get_reward_fn, reward_fn_for_source
from rlcore.trainer.builder import build_data
from rlcore.trainer.config import load_config

pytest.importorskip("reasoning_gym")
FIXTURES = Path(__file__).with_name("source_fixtures.py")
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"


def data(tok, model_dir, tmp_path, source, *overrides):
    """(training loader, validation batches) of a GRPO config reading ``source``."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("grpo", overrides=[f"model.path={model_dir}", f"trainer.output_dir={tmp_path}",
                                         f"data.source={source}", "data.max_prompt_length=128",
                                         "data.train_batch_size=4", "data.source_val_size=6", *overrides])
    return build_data(load_config(cfg, recipes.grpo.SECTIONS), tok)


def prompts(batches, n):
    it = iter(batches)
    return [list(next(it)[1]["raw_prompt"]) for _ in range(n)]


def test_reasoning_gym_rows_are_seeded_held_out_and_resumable(tok, model_dir, tmp_path):
    loader, val = data(tok, model_dir, tmp_path, "reasoning_gym:chain_sum", "+data.source_kwargs.size=50")
    again, _ = data(tok, model_dir, tmp_path, "reasoning_gym:chain_sum", "+data.source_kwargs.size=50")
    other, _ = data(tok, model_dir, tmp_path, "reasoning_gym:chain_sum", "+data.source_kwargs.size=50", "data.seed=7")
    first = prompts(loader, 3)
    assert first == prompts(again, 3)  # same seed, same rows
    assert first != prompts(other, 3)
    val_prompts = set(val[0].non_tensor_batch["raw_prompt"])
    assert len(val_prompts) == 6 and not val_prompts & {p for batch in first for p in batch}
    import reasoning_gym
    item = reasoning_gym.create_dataset("chain_sum", seed=0, size=50)[0]
    assert first[0][0] == item["question"]  # the library's own rows, in its order

    state = loader.state_dict()  # after 3 batches: the rest of the stream, from a fresh loader
    resumed, _ = data(tok, model_dir, tmp_path, "reasoning_gym:chain_sum", "+data.source_kwargs.size=50")
    resumed.load_state_dict(state)
    assert prompts(resumed, 2) == prompts(loader, 2)
    assert resumed.state_dict() == loader.state_dict()


def test_a_generator_source_rolls_over_passes_and_resumes_across_them(tok, model_dir, tmp_path):
    source = f"{FIXTURES}:sums"  # 7 rows a pass; validation's 2 come from another seed
    loader, _ = data(tok, model_dir, tmp_path, source, "+data.source_kwargs.count=7", "data.source_val_size=2")
    batches = prompts(loader, 5)  # 20 rows: passes 0-2 (each pass another seed)
    fresh, _ = data(tok, model_dir, tmp_path, source, "+data.source_kwargs.count=7", "data.source_val_size=2")
    it = iter(fresh)
    next(it), next(it)
    state_after_2 = fresh.state_dict()
    assert state_after_2["pass"] == 1 and state_after_2["position"] == 2
    resumed, _ = data(tok, model_dir, tmp_path, source, "+data.source_kwargs.count=7", "data.source_val_size=2")
    resumed.load_state_dict(state_after_2)
    assert prompts(resumed, 3) == batches[2:]
    assert batches[0] + batches[1][:3] == [f"{r['prompt']}" for r in open_source(source, {"count": 7}, 0, "train").rows]
    assert reward_fn_for_source("test_sums") == "test_sums"
    assert get_reward_fn("test_sums")(" 12", "12") == 1.0


def test_a_source_that_ignores_the_seed_gets_a_held_out_split(tok, model_dir, tmp_path):
    """Validation under the training seed (as a source that ignores its seed gives): the same stream, so
    validation is its first rows and training never sees them."""
    loader, val = data(tok, model_dir, tmp_path, f"{FIXTURES}:sums", "+data.source_kwargs.count=5",
                       "data.source_val_seed=0", "data.source_val_size=2", "data.train_batch_size=3")
    held = set(val[0].non_tensor_batch["raw_prompt"])
    seen = {p for batch in prompts(loader, 4) for p in batch}
    assert len(held) == 2 and not held & seen and len(seen) >= 3


def test_errors_name_the_row_and_the_key(tok, model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"\(val, pass 0\) row 3: key 'answer' missing"):
        data(tok, model_dir, tmp_path, f"{FIXTURES}:bad_rows", "data.source_val_size=8")
    with pytest.raises(ValueError, match=r"\(train, pass 0\) row 3: key 'answer' missing"):  # at load, not step 1
        data(tok, model_dir, tmp_path, f"{FIXTURES}:bad_rows", "data.source_val_size=1")
    with pytest.raises(ValueError, match="reasoning-gym has no task 'chain_sums'"):
        data(tok, model_dir, tmp_path, "reasoning_gym:chain_sums")
    with pytest.raises(ValueError, match=r"do not fit the task's config"):
        data(tok, model_dir, tmp_path, "reasoning_gym:chain_sum", "+data.source_kwargs.bogus=1")
    with pytest.raises(ValueError, match="may not set 'seed'"):
        data(tok, model_dir, tmp_path, "reasoning_gym:chain_sum", "+data.source_kwargs.seed=1")
    with pytest.raises(ValueError, match="brings no reward"):
        data(tok, model_dir, tmp_path, f"{FIXTURES}:unscored", "data.source_val_size=1")
    with pytest.raises(ValueError, match="defines no 'nothing'"):
        data(tok, model_dir, tmp_path, f"{FIXTURES}:nothing")
    stream = RowStream(f"{FIXTURES}:bad_rows", {}, 0, "train")
    assert [next(stream)[0] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"\(train, pass 0\) row 3: key 'answer' missing"):
        next(stream)


def test_reasoning_gym_reward_is_its_own_score_answer():
    import reasoning_gym
    source = open_source("reasoning_gym:basic_arithmetic", {"size": 5}, 3, "train")
    dataset = reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=5)
    row = next(iter(source.rows))
    entry, answer = dataset[0], dataset[0]["answer"]
    assert row["extra_info"]["entry"] == entry and row["answer"] == answer
    cases = {answer: 1.0, f"x{answer}": len(answer) / (len(answer) + 1), f"<answer>{answer}</answer>": 1.0,
             f"I think <answer>{answer}</answer> is right": 1.0, "<answer>0.5</answer>": None, "": 0.0}
    for response, want in cases.items():
        got = source.reward(response, answer, extra_info=row["extra_info"])
        from reasoning_gym.utils import extract_answer
        library = dataset.score_answer(answer=extract_answer(response) or response.strip(), entry=entry)
        assert got == library and (want is None or got == pytest.approx(want)), response
    strict = open_source("reasoning_gym:basic_arithmetic", {"size": 5, "answer_from": "tag"}, 3, "train")
    assert strict.reward(answer, answer, extra_info=row["extra_info"]) == 0.0  # no tag: reasoning-gym's own eval


def test_verifiers_rows_and_rubric_score(tok, model_dir, tmp_path):
    pytest.importorskip("verifiers")
    env = f"verifiers:{FIXTURES}:arithmetic_env"
    loader, val = data(tok, model_dir, tmp_path, env, "data.source_val_size=4", "data.apply_chat_template=true")
    batch = next(iter(loader))[1]
    info = batch["extra_info"][0]["input"]
    assert batch["messages"][0] == info["prompt"] and batch["ground_truth"][0] == info["answer"]
    assert set(batch["data_source"]) == {"verifiers/arithmetic_env"}
    val_keys = {prompt_key(m) for m in val[0].non_tensor_batch["messages"]}
    assert not val_keys & {prompt_key(m) for m in batch["messages"]}
    score = get_reward_fn("verifiers/arithmetic_env")
    truth = info["answer"]
    # the rubric: 1.0 * correct + 0.2 * tagged, each function's score reported beside the sum (and
    # SingleTurnEnv's own num_turns metric, weight 0)
    assert score(f"<answer>{truth}</answer>", truth, extra_info=batch["extra_info"][0]) == \
        {"score": pytest.approx(1.2), "correct": 1.0, "tagged": 1.0, "num_turns": 1.0}
    assert score("<answer>-1</answer>", truth, extra_info=batch["extra_info"][0])["score"] == pytest.approx(0.2)
    assert score(truth, truth, extra_info=batch["extra_info"][0])["score"] == 0.0

    _, val = data(tok, model_dir, tmp_path, f"verifiers:{FIXTURES}:arithmetic_env", "+data.source_kwargs.with_eval=true",
                  "data.apply_chat_template=true")
    assert list(val[0].non_tensor_batch["ground_truth"]) == ["20"]  # its eval_dataset
    with pytest.raises(ValueError, match="multi-turn environment"):
        data(tok, model_dir, tmp_path, f"verifiers:{FIXTURES}:tool_env")
    with pytest.raises(ValueError, match="Could not import 'no_such_env'"):
        data(tok, model_dir, tmp_path, "verifiers:no_such_env")


def test_a_source_may_not_rebind_a_registered_reward():
    from rlcore.rewards.registry import bind_source_reward
    with pytest.raises(ValueError, match="registered reward function's name"):
        bind_source_reward("gsm8k", lambda response, ground_truth, **_: 0.0)
    with pytest.raises(ValueError, match="without ':'"):
        bind_source_reward("a:b", lambda response, ground_truth, **_: 0.0)
    bind_source_reward("test_rebound", lambda response, ground_truth, **_: 1.0)
    bind_source_reward("test_rebound", lambda response, ground_truth, **_: 2.0)  # the next run's source wins
    assert get_reward_fn("test_rebound")("", "") == 2.0


def test_verifiers_load_environment_by_id(tok, model_dir, tmp_path, monkeypatch):
    """``verifiers:<id>`` goes through verifiers.load_environment, which imports the id's module."""
    pytest.importorskip("verifiers")
    monkeypatch.syspath_prepend(str(FIXTURES.parent))
    loader, val = data(tok, model_dir, tmp_path, "verifiers:rlcore-vf-sums", "+data.source_kwargs.n=10",
                       "data.source_val_size=3", "data.apply_chat_template=true")
    assert len(val[0]) == 3 and set(next(iter(loader))[1]["data_source"]) == {"verifiers/rlcore-vf-sums"}


def test_the_example_verifiers_environment_scores_the_final_number(tok, model_dir, tmp_path):
    """examples/envs/verifiers_sums.py (the docs' SmolLM2 command): its rubric, run as the trainer runs it."""
    pytest.importorskip("verifiers")
    example = Path(__file__).resolve().parents[2] / "examples" / "envs" / "verifiers_sums.py"
    loader, _ = data(tok, model_dir, tmp_path, f"verifiers:{example}:load_environment", "+data.source_kwargs.n=40",
                     "data.source_val_size=4", "data.apply_chat_template=true")
    batch = next(iter(loader))[1]
    truth, extra = batch["ground_truth"][0], batch["extra_info"][0]
    a, b = (int(x) for x in extra["input"]["question"].removeprefix("What is ").removesuffix("?").split(" + "))
    assert truth == str(a + b)
    score = get_reward_fn(batch["data_source"][0])
    # 1.0 for the right final number (tagged, else the reply's last number), + 0.2 x the parser's format score
    tagged, plain, rambling = (score(text, truth, extra_info=extra) for text in (
        f"<answer>{truth}</answer>", f"{a} + {b} = {truth}", f"{a} + {b} = {truth}, which is {a + b + 1}"))
    assert tagged["correct_answer"] == 1.0 and plain["correct_answer"] == 1.0 and rambling["correct_answer"] == 0.0
    assert tagged["score"] == pytest.approx(1.0 + 0.2 * tagged["format_reward_func"])
    assert plain["score"] == pytest.approx(1.0 + 0.2 * plain["format_reward_func"])
