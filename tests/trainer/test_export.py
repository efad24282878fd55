"""Every run leaves HF models behind (``trainer.export_hf``, ``TrainingRun``): ``<ckpt>/hf`` at each
checkpoint and ``<run>/hf`` after the last step; ``python -m rlcore.trainer.export`` rebuilds the
same directory from a sharded checkpoint.

When and where TrainingRun exports is checked first with a stub group (no model, fast). One real
GRPO run (2 steps, a checkpoint after each) feeds the layout, CLI and vLLM tests. A
LoRA actor and a Qwen3-MoE actor with frozen routers (their checkpoints lack base weights, which
the CLI must take from the starting model) run 2 steps of a hand loop through ``TrainingRun``,
so that the live actor's log-probs can be set against the exported model's. A one-step
reward-model run exports its sequence-classification model, and the command rebuilds that too.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import recipes.grpo
import recipes.reward_model
from rlcore.data import collate_prompts
from rlcore.engines import RolloutConfig, SamplingSettings, build_engine
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer import export
from rlcore.trainer.builder import Workers, build_data, build_workers
from rlcore.trainer.config import load_config
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.run_checkpoint import STATE_FILE

from run_stubs import EmptyLoader

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
LENGTH_REWARD = Path(__file__).parent.parent / "recipes" / "length_reward.py"  # a random model's samples score apart
HF_FILES = ("config.json", "tokenizer.json", "model.safetensors")
SHAPE = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1}


def grpo_config(out: Path, model: str, *overrides: str):
    base = [f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", "trainer.val_freq=0", f"model.path={model}",
            "trainer.backend=local", "trainer.total_steps=2", "trainer.save_freq=1", "data.train_batch_size=4",
            "data.arithmetic.n_train=16", "data.arithmetic.n_val=6", "actor.ppo_micro_batch_size_per_gpu=8",
            "rollout.n=2", "rollout.max_new_tokens=4", f"reward.reward_fn={LENGTH_REWARD}:reward_by_length",
            "actor.lr=1e-2"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("grpo", overrides=[*base, *overrides])


def weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(hf_dir / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    unequal = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not unequal, f"{a} and {b} differ in {unequal[:5]}"


class StubActor:
    """A trained role that records its exports: each writes config.json holding the call's number."""

    last_balance = None  # no balanced calls

    def __init__(self, fail: bool = False) -> None:
        self.exports, self.fail = [], fail

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True)

    def export_hf(self, path: str) -> None:
        self.exports.append(Path(path))
        if self.fail:
            raise OSError(28, "No space left on device")
        Path(path).mkdir(parents=True)
        (Path(path) / "config.json").write_text(json.dumps({"export": len(self.exports)}))

    def shutdown(self) -> None:
        pass


def stub_run(tmp_path: Path, actor: StubActor, **trainer) -> TrainingRun:
    cfg = load_config({"trainer": {"output_dir": str(tmp_path), "loggers": ["jsonl"], "val_freq": 0, **trainer}},
                      ["trainer"])
    with TrainingRun(cfg, Workers(group=actor, actor=actor), EmptyLoader(), validate=dict) as run:
        for step in run.steps():
            run.end_step(step, {})
    return run


@pytest.mark.parametrize("save_freq, exported_steps, final_copied", [(2, [2, 4], True), (3, [3], False)])
def test_exports_at_each_checkpoint_and_after_the_last_step(tmp_path, save_freq, exported_steps, final_copied):
    actor = StubActor()
    run = stub_run(tmp_path, actor, total_steps=4, save_freq=save_freq)
    in_checkpoints = [run.ckpt_dir / f"global_step_{s}" / "hf" for s in exported_steps]
    assert actor.exports == in_checkpoints + ([] if final_copied else [run.dir / "hf"])
    final = json.loads((run.dir / "hf" / "config.json").read_text())
    assert final == {"export": len(exported_steps) if final_copied else len(exported_steps) + 1}


def test_export_hf_false_exports_nothing(tmp_path):
    actor = StubActor()
    run = stub_run(tmp_path, actor, total_steps=2, save_freq=1, export_hf=False)
    assert actor.exports == [] and not list(run.dir.rglob("hf"))
    assert (run.ckpt_dir / "global_step_2" / STATE_FILE).is_file()


def test_a_failed_export_names_its_folder_and_leaves_the_checkpoint_incomplete(tmp_path):
    target = tmp_path / "rlcore" / "default" / "checkpoints" / "global_step_1" / "hf"
    with pytest.raises(OSError, match=rf"writing checkpoint {target} failed \(the actor as a HF model\): OSError: "
                                      r"\[Errno 28\] No space left on device"):
        stub_run(tmp_path, StubActor(fail=True), total_steps=2, save_freq=1)
    assert not (target.parent / STATE_FILE).exists()  # never resumed from


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("export_model"), **SHAPE)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_model) -> TrainingRun:
    return recipes.grpo.train(grpo_config(tmp_path_factory.mktemp("export_grpo"), tiny_model))


@pytest.mark.slow
def test_a_grpo_run_leaves_a_hf_model_in_each_checkpoint_and_in_the_run_folder(grpo_run, tiny_model):
    run_hf, first, last = (grpo_run.dir / "hf", grpo_run.ckpt_dir / "global_step_1" / "hf",
                           grpo_run.ckpt_dir / "global_step_2" / "hf")
    for hf_dir in (run_hf, first, last):
        assert all((hf_dir / name).is_file() for name in HF_FILES), sorted(p.name for p in hf_dir.iterdir())
        _, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert weights(run_hf).keys() == load_file(Path(tiny_model) / "model.safetensors").keys()  # the base's names
    assert_same_weights(run_hf, last)  # the run's final model is its last checkpoint's
    moved = [k for k, v in weights(first).items() if not torch.equal(v, weights(last)[k])]
    assert moved, "step 2 changed no weight: the two checkpoints' exports cannot tell steps apart"
    recorded = OmegaConf.load(grpo_run.dir / "config.yaml")
    assert recorded.model.path == str(Path(tiny_model).resolve()) and recorded.trainer.export_hf is True


@pytest.mark.slow
def test_the_export_command_rebuilds_a_checkpoints_hf_model_bitwise(grpo_run, tmp_path, capsys):
    step_1 = grpo_run.ckpt_dir / "global_step_1"
    assert export.main([str(step_1), "--out", str(tmp_path / "cli")]) == 0
    assert_same_weights(tmp_path / "cli", step_1 / "hf")
    assert all((tmp_path / "cli" / name).is_file() for name in HF_FILES)
    assert (tmp_path / "cli" / "config.json").read_text() == (step_1 / "hf" / "config.json").read_text()

    # A run from before config.yaml was recorded: Hydra's config, model.path null (given on the command line)
    old_run = tmp_path / "old_run"
    shutil.copytree(step_1, old_run / "checkpoints" / "global_step_1", ignore=shutil.ignore_patterns("hf"))
    (old_run / "hydra").mkdir()
    old_cfg = OmegaConf.load(grpo_run.dir / "config.yaml")
    old_cfg.model.path = None
    OmegaConf.save(old_cfg, old_run / "hydra" / "config.yaml")
    out = export.export_checkpoint(old_run, model_path=str(grpo_run.cfg.model.path))  # the run folder: its newest
    assert out == old_run / "checkpoints" / "global_step_1" / "hf"
    assert_same_weights(out, step_1 / "hf")


@pytest.mark.slow
def test_the_export_command_names_a_folder_that_is_not_a_checkpoint(grpo_run, tmp_path, capsys):
    assert export.main([str(grpo_run.dir / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{grpo_run.dir / 'hf'} is not a checkpoint" in err and "trainer_state.pt" in err
    with pytest.raises(export.NotACheckpointError, match=rf"{tmp_path / 'nowhere'} is not a checkpoint: it does not exist"):
        export.export_checkpoint(tmp_path / "nowhere")
    bare = tmp_path / "bare" / "checkpoints" / "global_step_1"
    shutil.copytree(grpo_run.ckpt_dir / "global_step_1", bare)
    with pytest.raises(export.NotACheckpointError, match=rf"no run config for checkpoint {bare}: looked for .*--config"):
        export.export_checkpoint(bare)


ADAPTED = {  # a LoRA actor's checkpoint holds adapters only; a frozen-router MoE actor's lacks the routers
    "lora": ({"arch": "llama"}, ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.target_modules=all-linear"]),
    "moe": ({"arch": "qwen3_moe"}, ["actor.freeze_router=true"]),
}


def exported_log_probs(hf_dir: Path, batch) -> torch.Tensor:
    """Log-probs of the batch's responses under the exported model, by hand from its logits."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    b = batch.batch
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    width = b["responses"].shape[1]
    scores = torch.log_softmax(logits[:, -width - 1:-1].float(), -1)
    return scores.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(ADAPTED))
def test_the_export_computes_what_the_live_actor_does_and_the_command_rebuilds_it(kind, tmp_path):
    shape, overrides = ADAPTED[kind]
    model = build_tiny_model(tmp_path / "model", **SHAPE, **shape)
    cfg = load_config(grpo_config(tmp_path, model, "actor.use_kl_loss=false", *overrides), recipes.grpo.SECTIONS)
    loader, _ = build_data(cfg, AutoTokenizer.from_pretrained(model))
    workers = build_workers(cfg, ["actor", "rollout"])
    noise = torch.Generator().manual_seed(0)
    with TrainingRun(cfg, workers, loader, validate=dict) as run:
        for step in run.steps():  # after the last one, TrainingRun writes <run>/hf
            batch = workers.rollout.generate_sequences(run.next_prompts())
            mask = batch.batch["response_mask"]
            batch.batch["advantages"] = torch.randn(mask.shape, generator=noise) * mask  # any signal that moves weights
            workers.actor.update_policy(batch)
            workers.rollout.sync_weights()
            run.end_step(step, {}, batch)
        live = workers.actor.compute_log_prob(batch).batch["old_log_probs"]
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(exported_log_probs(run.dir / "hf", batch)[mask], live[mask], atol=1e-5, rtol=0)
    exported, base = weights(run.dir / "hf"), load_file(Path(model) / "model.safetensors")
    assert exported.keys() == base.keys()  # the base architecture's names: no lora_A / lora_B, no peft prefixes
    moved = [k for k in base if not torch.equal(exported[k], base[k])]
    if kind == "lora":
        assert moved and all(k.endswith("weight") and "norm" not in k for k in moved)  # the adapted linears, merged
    else:
        routers = [k for k in base if k.endswith("mlp.gate.weight")]
        assert routers and not set(routers) & set(moved) and moved  # frozen routers as they were; experts trained
    out = export.export_checkpoint(run.ckpt_dir / "global_step_2", tmp_path / "cli")
    assert_same_weights(out, run.ckpt_dir / "global_step_2" / "hf")
    assert_same_weights(out, run.dir / "hf")


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_the_export_and_decodes_greedily_like_the_hf_model(grpo_run):
    pytest.importorskip("vllm")
    hf_dir = str(grpo_run.dir / "hf")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts = [{"input_ids": torch.tensor(tok.encode(text))} for text in ("12+3=", "7*8=", "100-99=", "4+4=")]
    tensors, _ = collate_prompts(prompts, tok.pad_token_id)
    greedy = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, n=1, do_sample=False,
                              ignore_eos=True)
    vllm_cfg = RolloutConfig(backend="vllm", dtype="float32", max_new_tokens=12, kv_cache_memory_bytes=1 << 28,
                             max_model_len=128)
    outputs, log_probs = {}, {}
    for name, engine in (("hf", HFEngine(ModelConfig(path=hf_dir), RolloutConfig(max_new_tokens=12))),
                         ("vllm", build_engine(ModelConfig(path=hf_dir), vllm_cfg))):
        gen = engine.generate(tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"], greedy)
        outputs[name] = [row[:n].tolist() for row, n in zip(gen.responses, gen.lengths)]
        log_probs[name] = gen.log_probs
    assert all(len(r) == 12 for r in outputs["hf"])
    assert outputs["vllm"] == outputs["hf"]
    torch.testing.assert_close(log_probs["vllm"], log_probs["hf"], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_reward_model_run_exports_its_reward_model_and_the_command_rebuilds_it(tiny_model, tmp_path):
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.val_freq=0", "trainer.total_steps=1",
                 "trainer.save_freq=1", f"model.path={tiny_model}", "trainer.backend=local", "data.train_batch_size=4",
                 "data.arithmetic.n_train=16", "data.arithmetic.n_val=6", "reward_model.lr=1e-2"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        run = recipes.reward_model.train(compose("reward_model", overrides=overrides))
    step_1 = run.ckpt_dir / "global_step_1"
    assert json.loads((step_1 / "hf" / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert_same_weights(run.dir / "hf", step_1 / "hf")
    assert_same_weights(export.export_checkpoint(step_1, tmp_path / "cli"), step_1 / "hf")
