"""A stop signal during a step's first update gives the step up while that update has not stepped its
optimizer (rlcore.workers.update_stop): the workers drop the gradients accumulated so far, the step before
is checkpointed, the process exits with 128 + the signal's number, and the resumed run logs exactly the
metrics of an uninterrupted one. Past the first optimizer step (PPO's several mini-batches), or in a later
update of the step (PPO's actor update after the critic's), the step finishes and is saved, as before.

The signal is sent from inside the update itself (its loss at a chosen micro-batch of a chosen step), so
where it lands never depends on the machine's speed (with Ray: from the rank's process, which then waits
until the driver's abandon signal has reached it)."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from hooked_runs import run_hooked
from hydra import compose, initialize_config_dir

import recipes.grpo
import recipes.ppo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.run_checkpoint import find_latest_checkpoint, load_run_state
from rlcore.trainer.stop_signal import RunStopped
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.workers.actor import ActorWorker
from rlcore.workers.critic import CriticWorker
from rlcore.trainer.jsonl_rows import without_machine_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
LENGTH_REWARD = Path(__file__).resolve().parents[1] / "recipes" / "length_reward.py"  # random-model samples score apart


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("stop_update_model"), hidden_size=64, num_heads=2, num_kv_heads=1)


def overrides(model: str, out: Path, mini: str = "null") -> list[str]:
    """8 rows a step (4 prompts x 2); the actor's update: one mini-batch (GRPO's default: one optimizer
    step) of 4 micro-batches of 2 rows, every row trained (no zero-advantage skipping)."""
    return [f"model.path={model}", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", "trainer.val_freq=0",
            "trainer.save_freq=0", "trainer.backend=local", "data.train_batch_size=4", "data.arithmetic.n_train=16",
            "data.arithmetic.n_val=4", "actor.ppo_micro_batch_size_per_gpu=2", f"actor.ppo_mini_batch_size={mini}",
            "actor.skip_zero_advantage_rows=false", "actor.lr=5e-2", "rollout.n=2", "rollout.max_new_tokens=6",
            "rollout.do_sample=true", f"reward.reward_fn={LENGTH_REWARD}:reward_by_length"]


# PPO: critic and actor each take 2 optimizer steps a batch (mini-batches of 2 prompts = 4 rows, one epoch),
# each of 2 micro-batches of 2 rows.
PPO = ["actor.ppo_epochs=1", "critic.ppo_mini_batch_size=2", "critic.ppo_epochs=1",
       "critic.ppo_micro_batch_size_per_gpu=2", "critic.lr=1e-2"]


def train(recipe, name: str, *args: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return recipe.train(compose(name, overrides=list(args)))


def comparable(path: Path) -> list[dict]:
    return without_machine_metrics(read_jsonl_metrics(path))


class SignalInUpdate:
    """Sends ``sig`` to this process from ``cls._loss`` at micro-batch ``at_micro`` (1-based, counted over
    the whole call) of the worker's ``at_update``-th update call; ``micros`` counts that call's losses."""

    def __init__(self, monkeypatch, cls: type, sig: int, at_update: int, at_micro: int) -> None:
        self.micros = 0
        real = cls._loss

        def loss(worker, micro, scale):
            if worker.update_calls == at_update - 1:  # the calls before this one completed
                self.micros += 1
                if self.micros == at_micro:
                    os.kill(os.getpid(), sig)  # the handler runs as soon as this returns: mid-update
            return real(worker, micro, scale)

        monkeypatch.setattr(cls, "_loss", loss)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory) -> list[dict]:
    run = train(recipes.grpo, "grpo", *overrides(tiny_model, tmp_path_factory.mktemp("whole")), "trainer.total_steps=4")
    return comparable(run.dir / "metrics.jsonl")


def test_grpo_a_signal_mid_update_drops_the_gradients_saves_the_step_before_and_the_resumed_run_matches(
        tmp_path, tiny_model, uninterrupted, monkeypatch, capsys):
    trigger = SignalInUpdate(monkeypatch, ActorWorker, signal.SIGTERM, at_update=3, at_micro=2)
    with pytest.raises(RunStopped) as stopped:
        train(recipes.grpo, "grpo", *overrides(tiny_model, tmp_path), "trainer.total_steps=4")
    assert stopped.value.code == 143
    assert trigger.micros == 2  # left at the boundary after micro-batch 2 of 4: no optimizer step
    run_dir = tmp_path / "grpo" / "default"
    ckpt = run_dir / "checkpoints" / "global_step_2"
    assert find_latest_checkpoint(ckpt.parent) == (2, ckpt)
    assert not (ckpt.parent / "global_step_3").exists()
    loader = load_run_state(ckpt)["loader"]
    assert (loader["epoch"], loader["position"]) == (0, 2)  # where step 3's prompts start
    assert [r["step"] for r in read_jsonl_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    out = capsys.readouterr()
    assert "SIGTERM received: abandoning the current step's update (unless it made an optimizer step)" in out.err
    assert f"stopped by SIGTERM during step 3 (abandoned); checkpoint {ckpt} (step 2)" in out.out
    assert "had made an optimizer step" not in out.out

    monkeypatch.undo()
    resumed = train(recipes.grpo, "grpo", *overrides(tiny_model, tmp_path), "trainer.total_steps=4",
                    "trainer.resume=auto")
    assert resumed.start_step == 2
    # the weights, AdamW's moments, the LR schedule and the update counter were those of step 2: equal to the last bit
    assert comparable(run_dir / "metrics.jsonl") == uninterrupted
    assert len({r["actor/grad_norm"] for r in uninterrupted}) == 4  # the updates differ: equality means something


@pytest.mark.parametrize("cls, at_micro, saved, micros", [
    (CriticWorker, 3, 3, 4),  # the critic's second mini-batch: its first optimizer step made, it finishes
    (ActorWorker, 1, 3, 4),  # the step's second update (the critic's made its steps): it finishes
    (CriticWorker, 2, 2, 2),  # the critic's first mini-batch, before any optimizer step: the step is given up
], ids=["critic-after-first-step", "actor-after-critic", "critic-before-first-step"])
def test_ppo_an_update_past_an_optimizer_step_finishes_and_saves_its_step(tmp_path, tiny_model, monkeypatch, capsys,
                                                                          cls, at_micro, saved, micros):
    trigger = SignalInUpdate(monkeypatch, cls, signal.SIGTERM, at_update=3, at_micro=at_micro)
    with pytest.raises(RunStopped) as stopped:
        train(recipes.ppo, "ppo", *overrides(tiny_model, tmp_path, mini="2"), *PPO, "trainer.total_steps=4")
    assert stopped.value.code == 143
    assert trigger.micros == micros
    ckpts = tmp_path / "ppo" / "default" / "checkpoints"
    assert find_latest_checkpoint(ckpts) == (saved, ckpts / f"global_step_{saved}")
    assert [r["step"] for r in read_jsonl_metrics(ckpts.parent / "metrics.jsonl")] == list(range(1, saved + 1))
    out = capsys.readouterr().out
    if saved == 3:
        assert "stopped by SIGTERM after step 3" in out
        # asked while the critic's update was still abandonable: the driver learns from its reply that it stepped
        assert ("step 3's update had made an optimizer step: finishing the step and saving it" in out) == (
            cls is CriticWorker)
    else:
        assert "stopped by SIGTERM during step 3 (abandoned)" in out


HOOK_DIR = Path(__file__).with_name("update_stop_hook")  # its sitecustomize.py signals from inside a Ray rank's update
RAY = ["trainer.backend=ray", "trainer.cpus_per_proc=1"]


def run_grpo(preloaded_python, tmp_path: Path, out: Path, model: str, *args: str,
             stop_at: str | None = None) -> subprocess.CompletedProcess:
    return run_hooked(preloaded_python, "grpo", HOOK_DIR, "RLCORE_TEST_UPDATE_STOP_AT", tmp_path,
                      [*overrides(model, out), *RAY, *args], stop_at)


@pytest.mark.timeout(600)
def test_ray_a_signal_mid_update_reaches_the_rank_which_gives_the_update_up(tmp_path, tiny_model, preloaded_python):
    """One Ray rank (the in-process test above checks the resumed run's metrics: the same worker code)."""
    stopped = run_grpo(preloaded_python, tmp_path, tmp_path / "split", tiny_model, "trainer.total_steps=3",
                       stop_at=f"{int(signal.SIGTERM)},3,2")  # step 3's update, at its second micro-batch of 4
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    # the rank was asked (SIGUSR2) while in micro-batch 2 and left at the boundary after it
    assert json.loads((tmp_path / "driver.pid.json").read_text()) == {"micros": 2, "asked": True}
    run_dir = tmp_path / "split" / "grpo" / "default"
    ckpt = run_dir / "checkpoints" / "global_step_2"
    assert find_latest_checkpoint(ckpt.parent) == (2, ckpt)
    assert [r["step"] for r in read_jsonl_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    assert f"stopped by SIGTERM during step 3 (abandoned); checkpoint {ckpt} (step 2)" in stopped.stdout
