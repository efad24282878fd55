"""A stop signal during a step's generation gives the step up (rlcore.trainer.stop_signal): the engine stops
mid-generation, the step before is checkpointed as it was when the abandoned step began, the process exits
with 128 + the signal's number, and the resumed run logs exactly the metrics of an uninterrupted one.

The signal is sent from inside the generation itself (a forward hook on the engine's model, at a chosen
forward of a chosen step's generate), so where it lands never depends on the machine's speed."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from hooked_runs import run_hooked
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.run_checkpoint import find_latest_checkpoint, load_run_state
from rlcore.trainer.stop_signal import RunStopped
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.jsonl_rows import without_machine_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
LENGTH_REWARD = Path(__file__).resolve().parents[1] / "recipes" / "length_reward.py"  # random-model samples score apart


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
    return without_machine_metrics(read_jsonl_metrics(path))


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
    assert len({r["reward/score/mean"] for r in uninterrupted}) > 1  # sampled steps differ: equality means something


def test_a_signal_during_validation_saves_the_step_it_follows_without_its_val_metrics(tmp_path, tiny_model, monkeypatch,
                                                                                      capsys):
    trigger = SignalInGeneration(monkeypatch, signal.SIGTERM, at_call=3, at_forward=2)  # steps 1, 2, then val
    with pytest.raises(RunStopped) as stopped:
        grpo(*overrides(tiny_model, tmp_path), "trainer.total_steps=4", "trainer.val_freq=2",
             "trainer.val_before_train=false")
    assert stopped.value.code == 143 and trigger.forwards == 2
    run_dir = tmp_path / "grpo" / "default"
    assert find_latest_checkpoint(run_dir / "checkpoints")[0] == 2
    logged = read_jsonl_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2] and not any(k.startswith("val/") for k in logged[1])
    assert "validation after step 2 abandoned" in capsys.readouterr().out

VLLM_RAY = ["trainer.backend=ray", "trainer.cpus_per_proc=1", "rollout.backend=vllm", "rollout.dtype=float32",
            "rollout.cpu_weight_layout=plain",  # "auto" times the matmuls: which weights read back would vary
            "rollout.kv_cache_memory_bytes=268435456", "rollout.max_model_len=128", "rollout.ignore_eos=true"]
HOOK_DIR = Path(__file__).with_name("stop_hook")  # its sitecustomize.py signals from inside vLLM's engine loop


def run_grpo(preloaded_python, tmp_path: Path, out: Path, model: str, *args: str,
             stop_at: str | None = None) -> subprocess.CompletedProcess:
    """The Ray + vLLM run, its driver a child of the preloaded interpreter (tests/preloaded_python.py), with
    the hook (armed by ``stop_at``) in its Ray workers."""
    return run_hooked(preloaded_python, "grpo", HOOK_DIR, "RLCORE_TEST_STOP_AT", tmp_path,
                      [*overrides(model, out), *VLLM_RAY, *args], stop_at)


@pytest.mark.vllm
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143)])
def test_ray_and_vllm_a_signal_mid_generation_aborts_the_engine_and_saves_the_step_before(tmp_path, tiny_model, sig,
                                                                                          code, preloaded_python):
    """Two steps (the in-process tests above stop at step 3 of 4): step 2's generation is abandoned after a
    step that trained and synced the engine's weights, and the resumed run's step 2 starts from the checkpoint
    of step 1."""
    pytest.importorskip("vllm")
    whole = run_grpo(preloaded_python, tmp_path, tmp_path / "whole", tiny_model, "trainer.total_steps=2")
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = run_grpo(preloaded_python, tmp_path, tmp_path / "split", tiny_model, "trainer.total_steps=2",
                       stop_at=f"{int(sig)},2,2")  # step 2's generate, at its second engine step
    assert stopped.returncode == code, stopped.stderr[-3000:]
    hook = json.loads((tmp_path / "driver.pid.json").read_text())
    # the worker's engine stopped inside the engine step that signalled (none after it) and vLLM's
    # unfinished requests (all 8 rows) were aborted
    assert hook["engine_steps"] == 2 and "never_abandoned" not in hook, hook
    assert hook["unfinished_before_abort"] == 8 and hook["unfinished_after_abort"] == 0, hook
    run_dir = tmp_path / "split" / "grpo" / "default"
    ckpt = run_dir / "checkpoints" / "global_step_1"
    assert find_latest_checkpoint(ckpt.parent) == (1, ckpt)
    assert not (ckpt.parent / "global_step_2").exists()
    assert f"stopped by {sig.name} during step 2 (abandoned); checkpoint {ckpt} (step 1)" in stopped.stdout
    resumed = run_grpo(preloaded_python, tmp_path, tmp_path / "split", tiny_model, "trainer.total_steps=2",
                       "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = comparable(tmp_path / "whole" / "grpo" / "default" / "metrics.jsonl")
    got = comparable(run_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2]
    for want, have in zip(expected, got):  # vLLM's CPU kernels: engine log-probs to 1e-6 (as tests/recipes/ does)
        engine_numerics = {k for k in want if k.startswith("check/logprob")}
        assert {k: have.get(k) for k in want if k not in engine_numerics} == {
            k: v for k, v in want.items() if k not in engine_numerics}
        for k in engine_numerics:
            assert have.get(k) == pytest.approx(want[k], abs=1e-6), k
