"""A stop signal during a step's generation gives the step up (rlcore.trainer.stop_signal): the engine stops
mid-generation, the step before is checkpointed as it was when the abandoned step began, the process exits
with 128 + the signal's number, and the resumed run logs exactly the metrics of an uninterrupted one.

The signal is sent from inside the generation itself (a forward hook on the engine's model, at a chosen
forward of a chosen step's generate), so where it lands never depends on the machine's speed."""

import os
import signal
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.run_checkpoint import find_latest_checkpoint, load_run_state
from rlcore.trainer.stop_signal import RunStopped
from rlcore.trainer.tracking import read_jsonl_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
LENGTH_REWARD = Path(__file__).resolve().parents[1] / "recipes" / "length_reward.py"  # random-model samples score apart
TIMING = ("timing_s/", "throughput/", "rollout/gen_time_s", "rollout/tokens_per_s")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("stop_model"), hidden_size=64, num_heads=2, num_kv_heads=1)


def overrides(model: str, out: Path) -> list[str]:
    return [f"model.path={model}", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", "trainer.val_freq=0",
            "trainer.save_freq=0", "trainer.backend=local", "data.train_batch_size=4", "data.arithmetic.n_train=16",
            "data.arithmetic.n_val=4", "actor.ppo_micro_batch_size_per_gpu=8", "actor.ppo_mini_batch_size=2",
            "actor.lr=5e-2", "rollout.n=2", "rollout.max_new_tokens=6", "rollout.do_sample=true",
            f"reward.reward_fn={LENGTH_REWARD}:reward_by_length"]


def grpo(*args: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return recipes.grpo.train(compose("grpo", overrides=list(args)))


def comparable(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_jsonl_metrics(path)]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("whole")
    run = grpo(*overrides(tiny_model, out), "trainer.total_steps=4")
    return comparable(run.dir / "metrics.jsonl")


class SignalInGeneration:
    """Sends ``sig`` to this process at forward ``at_forward`` of the ``at_call``-th ``HFEngine.generate``."""

    def __init__(self, monkeypatch, sig: int, at_call: int, at_forward: int) -> None:
        self.sig, self.at_call, self.at_forward = sig, at_call, at_forward
        self.calls = self.forwards = 0
        real = HFEngine.generate

        def generate(engine, *args, **kwargs):
            self.calls += 1
            if self.calls != self.at_call:
                return real(engine, *args, **kwargs)
            hook = engine.model.register_forward_pre_hook(self._forward)
            try:
                return real(engine, *args, **kwargs)
            finally:
                hook.remove()

        monkeypatch.setattr(HFEngine, "generate", generate)

    def _forward(self, module, args):
        self.forwards += 1
        if self.forwards == self.at_forward:
            os.kill(os.getpid(), self.sig)  # the handler runs as soon as this returns: mid-generation


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_generation_saves_the_step_before_and_the_resumed_run_matches(
        tmp_path, tiny_model, uninterrupted, monkeypatch, capsys, sig, code):
    trigger = SignalInGeneration(monkeypatch, sig, at_call=3, at_forward=2)  # step 3, after its first new token
    with pytest.raises(RunStopped) as stopped:
        grpo(*overrides(tiny_model, tmp_path), "trainer.total_steps=4")
    assert stopped.value.code == code
    assert trigger.forwards == 2  # the generation stopped at the forward the signal came in: 6 tokens were due
    run_dir = tmp_path / "grpo" / "default"
    ckpt = run_dir / "checkpoints" / "global_step_2"
    assert find_latest_checkpoint(ckpt.parent) == (2, ckpt)
    assert not (ckpt.parent / "global_step_3").exists()
    loader = load_run_state(ckpt)["loader"]
    assert (loader["epoch"], loader["position"]) == (0, 2)  # where step 3's prompts start
    assert [r["step"] for r in read_jsonl_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    out = capsys.readouterr()
    assert f"{sig.name} received: abandoning the current step's generation" in out.err
    assert f"stopped by {sig.name} during step 3 (abandoned); checkpoint {ckpt} (step 2)" in out.out

    monkeypatch.undo()
    resumed = grpo(*overrides(tiny_model, tmp_path), "trainer.total_steps=4", "trainer.resume=auto")
    assert resumed.start_step == 2
    assert comparable(run_dir / "metrics.jsonl") == uninterrupted
    assert len({r["reward/score/mean"] for r in uninterrupted}) > 1  # sampled: steps differ, so equality means something
