"""End-to-end runs of the recipes at tiny sizes: the real YAML configs composed by Hydra with
overrides, a few steps each, on the in-process backend and (GRPO, with its warm start, and async
GRPO) on Ray.

Each run's metrics.jsonl must hold the expected keys with finite values. A PPO run killed after
its step-2 checkpoint and resumed with trainer.resume=auto must log exactly the metrics of an
uninterrupted run, step for step.
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import recipes.agentic_grpo
import recipes.async_grpo
import recipes.chat_agent_grpo
import recipes.grpo
import recipes.multi_turn_grpo
import recipes.ppo
import recipes.sft
from rlcore.data.arithmetic import make_split, write_jsonl
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.config import ConfigError, load_config
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.warmstart import warm_start
from rlcore.trainer.jsonl_rows import without_machine_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.sft.__file__).parent / "config"
REPO = CONFIG_DIR.parent.parent
TINY_DATA = ["data.train_batch_size=4", "data.arithmetic.n_train=16", "data.arithmetic.n_val=6"]
COMMON_RL = ["actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=2", "rollout.max_new_tokens=4"]


def comparable_metrics(run: TrainingRun) -> list[dict]:
    """A run's logged rows without the wall-clock keys, which differ between any two runs: what a
    resumed run must log exactly like an uninterrupted one."""
    return without_machine_metrics(read_jsonl_metrics(run.dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("recipe_model"), hidden_size=64, num_heads=2, num_kv_heads=1)


def config(name: str, tmp_path: Path, *overrides: str):
    base = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.total_steps=2",
            "trainer.val_freq=1", *TINY_DATA]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(name, overrides=[*base, *overrides])


def check_metrics(run: TrainingRun, steps: int, keys: set[str]) -> list[dict]:
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps + 1))  # step 0: validation before training
    for row in rows[1:]:
        missing = keys - row.keys()
        assert not missing, f"step {row['step']} lacks {sorted(missing)}"
    for row in rows:
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert not bad, f"step {row['step']}: non-finite {bad}"
    return rows


RL_KEYS = {"actor/pg_loss", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm", "reward/score/mean",
           "reward/score/std", "critic/advantages/mean", "response_length/mean", "response_length/max",
           "val/reward_mean", "rollout/tokens_per_s", "timing_s/gen", "timing_s/update_actor", "throughput/step"}


def test_sft_trains_validates_and_exports(tmp_path, tiny_model):
    run = recipes.sft.train(config("sft", tmp_path, f"model.path={tiny_model}", "trainer.backend=local"))
    check_metrics(run, 2, {"sft/nll", "sft/grad_norm", "val/reward_mean", "timing_s/update_actor"})
    assert (run.dir / "hf" / "config.json").exists() and (run.dir / "hf" / "tokenizer.json").exists()


def test_sft_trains_on_the_column_data_response_key_names(tmp_path, tiny_model):
    """Worked solutions as the target: the column reaches the batch through the loader (a row that lacks it
    fails at load time), and the NLL is over the solution's tokens, not the bare answer's."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "solution": f"{a} + {b} = {a + b}", "data_source": "arithmetic"}
            for a in range(1, 5) for b in range(1, 5)]
    data = write_jsonl(tmp_path / "solutions.jsonl", rows)
    files = [f"data.train_files={data}", f"data.val_files={data}", f"model.path={tiny_model}", "trainer.backend=local"]
    run = recipes.sft.train(config("sft", tmp_path, *files, "data.response_key=solution"))
    with_solutions = check_metrics(run, 2, {"sft/nll", "val/reward_mean"})
    run = recipes.sft.train(config("sft", tmp_path, *files, "trainer.run_name=answers"))
    bare = check_metrics(run, 2, {"sft/nll"})
    # "a + b = c" (c < 10) and eos on the character tokenizer: 10 tokens a row; the bare answer "c": 2
    assert [r["response_length/mean"] for r in with_solutions[1:]] == [10.0, 10.0]
    assert [r["response_length/mean"] for r in bare[1:]] == [2.0, 2.0]
    with pytest.raises(ValueError, match="'solution'"):
        recipes.sft.train(config("sft", tmp_path, *files, "data.response_key=solution", "data.train_files="
                                 + str(write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "1+1=", "answer": "2", "data_source": "arithmetic"}]))))


def test_grpo_builds_its_warm_start_then_trains_on_ray(tmp_path, ray_cluster, capsys):
    warm = [f"warmstart.dir={tmp_path}/warm", "warmstart.steps=2"]
    cfg = config("grpo", tmp_path, "trainer.backend=ray", "trainer.cpus_per_proc=1", *COMMON_RL, *warm)
    run = recipes.grpo.train(cfg)
    rows = check_metrics(run, 2, RL_KEYS | {"actor/kl_loss", "memory/pss_peak_gib"})
    assert not any("timing_s/old_log_prob" in r for r in rows)  # one optimizer step per batch: not needed
    # the run's memory: every process of it (here the driver, Ray's daemons and the rank) once, at its end
    memory = json.loads((run.dir / "memory.json").read_text())
    names = {who.split("[")[0] for who in memory["peak_pss_bytes"]}
    assert {"driver", "raylet", "ray::WorkerHost"} <= names, names
    assert rows[-1]["memory/pss_peak_gib"] * 2**30 <= memory["peak_pss_total_bytes"]
    assert "memory: peak " in capsys.readouterr().out
    [marker] = (tmp_path / "warm").glob("*/warmstart.json")
    info = json.loads(marker.read_text())
    assert Path(info["model_dir"], "config.json").exists() and 0.0 <= info["val_reward"] <= 1.0
    mtime = marker.stat().st_mtime_ns
    cfg.trainer.run_name = "again"
    assert warm_start(load_config(cfg, recipes.grpo.SECTIONS)) == info["model_dir"]
    assert marker.stat().st_mtime_ns == mtime  # reused, not rebuilt


@pytest.mark.parametrize("backend, max_staleness", [("local", 0), ("ray", 1)])
def test_async_grpo_trains_on_rows_at_most_max_staleness_old(tmp_path, tiny_model, backend, max_staleness, request):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    cfg = config("async_grpo", tmp_path, f"model.path={tiny_model}", f"trainer.backend={backend}",
                 "trainer.total_steps=3", f"replay.max_staleness={max_staleness}", *COMMON_RL)
    run = recipes.async_grpo.train(cfg)
    generated_elsewhere = {"timing_s/gen"}  # by the producer: its speed is in rollout/*, not a stage of the step
    rows = check_metrics(run, 3, RL_KEYS - generated_elsewhere | {
        "actor/kl_loss", "actor/is/weight_mean", "replay/staleness_mean", "timing_s/wait_rollout", "timing_s/sync_weights"})
    staleness = [r["replay/staleness_mean"] for r in rows[1:]]
    assert staleness[0] == 0.0  # the first batch comes from the starting weights
    assert all(s in (0.0, 1.0) and s <= max_staleness for s in staleness), staleness


def test_async_grpo_resume_gives_the_engine_the_checkpointed_weights(tmp_path, tiny_model):
    """On-policy (max_staleness 0) with a large lr: IS weights of 1 after resuming mean the engine
    samples with the restored weights, not the starting model's."""
    length_reward = Path(__file__).with_name("length_reward.py")  # random-model samples must score apart
    overrides = [f"model.path={tiny_model}", "trainer.backend=local", "trainer.save_freq=2", "actor.lr=5e-2",
                 "replay.max_staleness=0", f"reward.reward_fn={length_reward}:reward_by_length", *COMMON_RL,
                 "rollout.n=4"]
    first = recipes.async_grpo.train(config("async_grpo", tmp_path, *overrides))
    assert any(r.get("actor/grad_norm", 0) > 0 for r in read_jsonl_metrics(first.dir / "metrics.jsonl"))
    resumed = recipes.async_grpo.train(config("async_grpo", tmp_path, *overrides, "trainer.total_steps=3",
                                              "trainer.resume=auto"))
    assert resumed.start_step == 2
    rows = read_jsonl_metrics(resumed.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["actor/is/weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_multi_turn_grpo_trains_on_episodes_of_policy_and_env_tokens(tmp_path, tiny_model):
    cfg = config("multi_turn_grpo", tmp_path, f"model.path={tiny_model}", "trainer.backend=local", *COMMON_RL,
                 "env.max_total_tokens=40")
    run = recipes.multi_turn_grpo.train(cfg)
    rows = check_metrics(run, 2, RL_KEYS | {"actor/kl_loss", "episode/reward_mean", "episode/turns_mean",
                                            "episode/first_try_right"})
    # A random model is never right: every episode uses all its tries.
    assert all(r["episode/turns_mean"] == 3 and r["episode/reward_mean"] == 0 for r in rows[1:])


def test_ppo_with_critic_and_kl_in_reward_on_given_data_files(tmp_path, tiny_model):
    train, val = make_split(12, 4, seed=3, max_operand=9)
    files = [f"data.train_files=[{write_jsonl(tmp_path / 'tr.jsonl', train)}]",
             f"data.val_files={write_jsonl(tmp_path / 'va.jsonl', val)}", "reward.reward_fn=arithmetic"]
    cfg = config("ppo", tmp_path, f"model.path={tiny_model}", "trainer.backend=local", *COMMON_RL, *files,
                 "critic.ppo_micro_batch_size_per_gpu=8", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2")
    run = recipes.ppo.train(cfg)
    assert not (tmp_path / "data").exists()  # the given files, not the arithmetic task
    check_metrics(run, 2, RL_KEYS | {"actor/kl_old_ref", "critic/vf_loss", "critic/values/mean", "critic/returns/mean",
                                     "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"})


def test_killed_run_resumes_to_the_same_metrics(tmp_path, tiny_model, monkeypatch):
    """Greedy rollouts: every other source of randomness (update shuffles, driver RNG) is checkpointed."""
    overrides = [f"model.path={tiny_model}", "trainer.backend=local", "trainer.total_steps=4", "trainer.save_freq=2",
                 "rollout.do_sample=false", "rollout.n=1", "rollout.max_new_tokens=4", "actor.lr=1e-2",
                 "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "algorithm.kl_ctrl.type=adaptive"]
    whole = recipes.ppo.train(config("ppo", tmp_path, *overrides, "trainer.run_name=whole"))

    original_end_step = TrainingRun.end_step

    def crash_after_step_3(self, step, *args, **kwargs):
        original_end_step(self, step, *args, **kwargs)
        if step == 3:  # logged, but after the step-2 checkpoint: the resumed run must redo it
            raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(TrainingRun, "end_step", crash_after_step_3)
    with pytest.raises(KeyboardInterrupt):
        recipes.ppo.train(config("ppo", tmp_path, *overrides, "trainer.run_name=killed"))
    monkeypatch.setattr(TrainingRun, "end_step", original_end_step)
    resumed = recipes.ppo.train(config("ppo", tmp_path, *overrides, "trainer.run_name=killed", "trainer.resume=auto"))
    assert resumed.start_step == 2

    expected, got = comparable_metrics(whole), comparable_metrics(resumed)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    assert got == expected
    assert any(r["actor/pg_loss"] != 0 for r in expected[1:])  # the policy really trained


def test_ppo_keeps_and_says_its_best_validation(tmp_path, tiny_model, capfd):
    """val/best and val/best_step on every validated row; <run>/hf_best holds the best step's policy: a run
    started from it validates (step 0, greedy, the same prompts) to the recorded best."""
    reward = Path(__file__).with_name("length_reward.py")  # greedy answers that change score apart
    overrides = [f"model.path={tiny_model}", "trainer.backend=local", "trainer.total_steps=4", "actor.lr=5e-2",
                 "rollout.do_sample=true", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
                 f"reward.reward_fn={reward}:reward_by_characters", *COMMON_RL]
    run = recipes.ppo.train(config("ppo", tmp_path, *overrides))
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    scores = [r["val/reward_mean"] for r in rows]
    best = max(scores)
    best_step = scores.index(best)  # a row per step from 0: the first step of the best score
    assert [(r["val/best"], r["val/best_step"]) for r in rows] == [
        (max(scores[:i + 1]), scores.index(max(scores[:i + 1]))) for i in range(len(rows))]
    assert best_step != 4 and len(set(scores)) > 1  # these settings: the policy drifts off its start (best: step 0)
    assert json.loads((run.dir / "hf_best" / "best.json").read_text()) == {"step": best_step, "val/reward_mean": best}
    said = f"last validation (step 4), best {best:.4g} at step {best_step}; its weights: {run.dir / 'hf_best'}"
    assert said in capfd.readouterr().out
    again = recipes.ppo.train(config("ppo", tmp_path, *overrides, f"model.path={run.dir / 'hf_best'}",
                                     "trainer.run_name=from_best", "trainer.total_steps=1"))
    assert read_jsonl_metrics(again.dir / "metrics.jsonl")[0]["val/reward_mean"] == best


VLLM_ROLLOUT = ["rollout.backend=vllm", "rollout.dtype=float32", "rollout.kv_cache_memory_bytes=268435456",
                "rollout.cpu_weight_layout=plain",  # "auto" times the matmuls: which weights read back would vary
                "rollout.max_model_len=128"]


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_sampled_grpo_resumes_to_the_same_metrics(tmp_path, tiny_model, engine):
    """Sampled rollouts: each step's sampling seed comes from (trainer.seed, batch index), so a run
    stopped at its step-2 checkpoint and resumed logs the uninterrupted run's metrics at steps 3-4."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    length_reward = Path(__file__).with_name("length_reward.py")  # random-model samples must score apart
    overrides = [f"model.path={tiny_model}", "trainer.backend=local", "trainer.save_freq=2", "rollout.do_sample=true",
                 "actor.lr=5e-2", "actor.ppo_mini_batch_size=2", f"reward.reward_fn={length_reward}:reward_by_length",
                 *COMMON_RL, *(VLLM_ROLLOUT if engine == "vllm" else [])]
    whole = recipes.grpo.train(config("grpo", tmp_path, *overrides, "trainer.run_name=whole", "trainer.total_steps=4"))
    recipes.grpo.train(config("grpo", tmp_path, *overrides, "trainer.run_name=split"))  # 2 steps, checkpoint at 2
    resumed = recipes.grpo.train(config("grpo", tmp_path, *overrides, "trainer.run_name=split", "trainer.total_steps=4",
                                        "trainer.resume=auto"))
    assert resumed.start_step == 2

    expected, got = comparable_metrics(whole), comparable_metrics(resumed)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    for want, have in zip(expected[3:], got[3:]):
        # vLLM's CPU kernels sum in an order that depends on the batch they run in, so the engine-side
        # log-probs (and only they) may move in the last float32 bits between two processes; the sampled
        # tokens, rewards and every trainer number must still be exactly equal.
        engine_numerics = {k for k in want if k.startswith("check/logprob")} if engine == "vllm" else set()
        for k in engine_numerics:
            assert have.get(k) == pytest.approx(want[k], abs=1e-6), k
        exact = {k: v for k, v in want.items() if k not in engine_numerics}
        assert {k: have.get(k) for k in exact} == exact, {k: (v, have.get(k)) for k, v in exact.items() if have.get(k) != v}
    assert len({r["reward/score/mean"] for r in expected[1:]}) > 1  # sampled: the scores vary from step to step


@pytest.mark.vllm
def test_grpo_that_gives_memory_back_learns_the_same(tmp_path, tiny_model):
    """``trainer.release_memory`` (the engine's packed weights let go through each update and packed
    again by the sync, its KV cache between generations; with ``trainer.trim_in_update`` the heap trimmed before each backward; the
    trims between layers come every 6th layer, none in this 2-layer model: tests/engines/test_host_memory.py)
    against a run that keeps everything: the same sampled tokens, metrics and final weights."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file

    length_reward = Path(__file__).with_name("length_reward.py")
    rollout = [o for o in VLLM_ROLLOUT if not o.startswith("rollout.cpu_weight_layout")] + ["rollout.cpu_weight_layout=packed"]
    overrides = [f"model.path={tiny_model}", "trainer.backend=local", "rollout.do_sample=true", "actor.lr=5e-2",
                 "actor.ppo_mini_batch_size=2", f"reward.reward_fn={length_reward}:reward_by_length", *COMMON_RL, *rollout]
    runs = {flag: recipes.grpo.train(config("grpo", tmp_path, *overrides, f"trainer.run_name={flag}",
                                            f"trainer.release_memory={flag}", f"trainer.trim_in_update={flag}"))
            for flag in ("true", "false")}
    released, kept = (comparable_metrics(runs[flag]) for flag in ("true", "false"))
    assert released == kept
    weights = {flag: load_file(str(runs[flag].dir / "hf" / "model.safetensors")) for flag in runs}
    assert weights["true"].keys() == weights["false"].keys()
    assert all(torch.equal(weights["true"][k], weights["false"][k]) for k in weights["true"])


def test_unknown_key_on_the_command_line_is_an_error_naming_it(tmp_path, preloaded_python):
    """Once through the command line (``python -m recipes.ppo ARGS`` in a process of its own, forked from an
    interpreter that imported torch & co. once: a fresh one costs ~6 s of CPU) to show the command fails naming
    the key; the other kinds through the same composition and check in this process."""
    proc = preloaded_python.run("recipes.ppo", "+foo.bar=1", f"trainer.output_dir={tmp_path}", cwd=REPO, timeout=600)
    assert proc.returncode != 0
    assert "['foo']" in proc.stderr + proc.stdout, proc.stderr[-2000:]
    for override in ("foo.bar=1", "actor.lrr=1"):  # not in the schema: Hydra refuses to compose it
        with pytest.raises(ConfigCompositionException, match=re.escape(f"Could not override '{override[:-2]}'")):
            config("ppo", tmp_path, override)
    with pytest.raises(ConfigError, match=re.escape("unknown config key(s) ['foo']")):
        recipes.ppo.train(config("ppo", tmp_path / "in_process", "+foo.bar=1"))
    assert not (tmp_path / "in_process").exists()  # no run folder


def test_a_value_of_the_wrong_type_fails_before_anything_starts(tmp_path):
    """actor.lr=abc is refused by the typed schema as the config is composed (as the command line composes it),
    naming the key, before a warm start or a worker."""
    with pytest.raises(ConfigCompositionException, match=re.escape("actor.lr=abc")):
        recipes.grpo.train(config("grpo", tmp_path, "actor.lr=abc"))
    assert not any(tmp_path.iterdir())  # no run folder, no warm start: it stopped before anything started


def test_cfg_job_prints_every_section_with_its_defaults():
    """What ``python -m recipes.grpo --cfg job`` prints: the composed job config as YAML."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        printed = OmegaConf.to_yaml(compose("grpo"))
    for section in recipes.grpo.SECTIONS:
        assert f"\n{section}:\n" in f"\n{printed}", section
    for key in ("clip_ratio_high", "gpu_memory_utilization", "timeout_s", "ppo_micro_batch_size_per_gpu",
                "adv_estimator", "cpus_per_proc", "train_batch_size", "max_new_tokens"):
        assert f" {key}:" in printed, key


def test_agentic_grpo_trains_on_streamed_episodes_from_engine_servers(tmp_path, tiny_model, ray_cluster):
    """Engine server, runner actor, streaming pool, bucketed weight push: every step's groups are at
    most max_staleness versions old, the weights reach the engine as the next version."""
    cfg = config("agentic_grpo", tmp_path, f"model.path={tiny_model}", "trainer.backend=local", *COMMON_RL,
                 "trainer.total_steps=3", "env.max_total_tokens=40", "env.kwargs.step_latency_s=0.01",
                 "agentic.cpus_per_engine=1", "agentic.bucket_mb=0.1")
    run = recipes.agentic_grpo.train(cfg)
    rows = check_metrics(run, 3, RL_KEYS - {"rollout/tokens_per_s", "timing_s/gen"} | {
        "actor/kl_loss", "actor/is/weight_mean", "episode/reward_mean", "episode/turns_mean", "pool/wait_s",
        "pool/staleness_mean", "engine/idle_frac", "sync/push_s", "sync/peak_bucket_bytes", "timing_s/wait_rollout"})
    assert all(r["pool/staleness_mean"] <= 1 for r in rows[1:])
    assert rows[1]["pool/staleness_mean"] == 0  # the first groups come from the starting weights
    # 0.1 MiB buckets: the model travels in several (a decoder layer, ~0.15 MiB here, alone in one),
    # and no bucket ever holds the whole model.
    assert all(r["sync/buckets"] > 1 and r["sync/peak_bucket_bytes"] < r["sync/bytes"] / 2 for r in rows[1:])


def test_chat_agent_grpo_trains_a_black_box_openai_agent(tmp_path, tiny_model, ray_cluster):
    """The example agent (stock openai client) in a runner actor, talking to the chat proxy there:
    every step trains on its episodes' segments, each row's reward one the agent's rule can give."""
    cfg = config("chat_agent_grpo", tmp_path, f"model.path={tiny_model}", "trainer.backend=local", *COMMON_RL,
                 "trainer.total_steps=2", "agentic.cpus_per_engine=1", "agentic.bucket_mb=0.1")
    run = recipes.chat_agent_grpo.train(cfg)
    rows = check_metrics(run, 2, RL_KEYS - {"rollout/tokens_per_s", "timing_s/gen"} | {
        "actor/kl_loss", "episode/reward_mean", "episode/requests_mean", "episode/segments_mean",
        "pool/staleness_mean", "sync/push_s", "timing_s/wait_rollout"})
    for r in rows[1:]:
        assert 1 <= r["episode/requests_mean"] <= 3 and r["episode/segments_mean"] == 1.0
        assert r["reward/score/max"] in (0.0, 0.25, 0.5, 1.0)  # the agent's rewards: 0.5 ** (try - 1), or 0
        assert r["pool/dropped_share/arithmetic"] >= 0.0 and "pool/dropped/stale" in r and "pool/kept_reward_mean" in r
    # Nothing vanishes silently: the groups trained on are "kept", those left at the end are counted as dropped.
    drops = json.loads((run.dir / "drops.json").read_text())
    assert drops["groups_kept"] == 2 * cfg.data.train_batch_size
    assert drops["by_data_source"]["arithmetic"]["kept"] == drops["groups_kept"]
    at_end = sum(drops["dropped"].get(r, {}).get("groups", 0) for r in ("in_flight_at_end", "unused_at_end"))
    assert at_end >= 1 and (run.dir / "drops.txt").read_text().startswith("Rollout pool: ")


def test_chat_agent_grpo_trains_an_agent_written_with_the_anthropic_client(tmp_path, tiny_model, ray_cluster):
    """The same agent on the stock anthropic client (the proxy's /v1/messages route), one step: its episodes
    are trained on, with its rule's rewards, and a try is each question asked."""
    cfg = config("chat_agent_grpo", tmp_path, f"model.path={tiny_model}", "trainer.backend=local", *COMMON_RL,
                 "trainer.total_steps=1", "agentic.cpus_per_engine=1", "agentic.bucket_mb=0.1",
                 "agent.path=examples/agents/arithmetic_anthropic.py:RetryAgent")
    run = recipes.chat_agent_grpo.train(cfg)
    [row] = check_metrics(run, 1, {"actor/pg_loss", "episode/reward_mean", "episode/requests_mean",
                                   "episode/tries_mean", "episode/first_try_right"})[1:]
    assert 1 <= row["episode/requests_mean"] <= 3 and row["episode/tries_mean"] == row["episode/requests_mean"]
    assert row["reward/score/max"] in (0.0, 0.25, 0.5, 1.0)
