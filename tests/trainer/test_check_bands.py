"""Bands that know the precision (rlcore.trainer.check_bands): a clean run of each dtype pair warns
nothing, and the planted faults are still named at step 1 at a real learning rate (1e-5), on a real
tiny model (actor and HF engine colocated in this process; recipe runs for sync and async recipes).
Calibration is checked against hand-computed numbers."""

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engines"))
from engine_fixtures import make_prompts  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import recipes.grpo  # noqa: E402
from rlcore.engines import dtype_choice  # noqa: E402
from rlcore.models.tiny import build_tiny_model  # noqa: E402
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls  # noqa: E402
from rlcore.trainer.check_bands import (  # noqa: E402
    CALIBRATE_FACTOR, FP32, Bands, expected_dtypes, pair_band)
from rlcore.trainer.choices import resolve_choices  # noqa: E402
from rlcore.trainer.consistency import ConsistencyCheck  # noqa: E402
from rlcore.workers.actor import ActorWorker  # noqa: E402
from rlcore.workers.mismatch import CheckConfig  # noqa: E402
from rlcore.workers.rollout import RolloutWorker  # noqa: E402

LR = 1e-5
BF16_PAIR = pair_band("bfloat16", "bfloat16")


def measures(abs_mean, signed, share=0.0, tokens=400.0, **extra):
    return {"check/tokens": tokens, "check/logprob_abs_diff_mean": abs_mean, "check/logprob_diff_mean": signed,
            "check/ratio_out_of_band": share, **extra}


# ---- the bands and their calibration, by hand -------------------------------------------------------------

def test_each_pair_has_its_band_and_the_config_overrides_it():
    assert pair_band("float32", "float32") is FP32 and FP32.limits() == (1e-4, 0.01)
    for pair in (("bfloat16", "float32"), ("float32", "bfloat16"), ("bf16", "torch.bfloat16"), ("float16", "float32")):
        assert pair_band(*pair).abs_diff_mean > 10 * FP32.abs_diff_mean  # bf16 noise is far above fp32's
    assert Bands(CheckConfig(), ("bfloat16", "bfloat16")).pair().limits() == BF16_PAIR.limits()
    given = Bands(CheckConfig(max_abs_diff_mean=0.5), ("bfloat16", "bfloat16")).pair()
    assert given.limits() == (0.5, BF16_PAIR.out_of_band) and given.source == "trainer.check"


def test_calibration_takes_the_symmetric_noise_of_a_verified_step():
    bands = Bands(CheckConfig(), ("bfloat16", "bfloat16"))
    assert bands.calibrate(1, measures(0.002, 1e-4), weights_ok=False) is None  # weights not verified identical
    metrics, line = bands.calibrate(2, measures(0.002, 1e-4, share=0.004), weights_ok=True)
    # 5 x 0.002 = 0.01 nats; 5 x 0.4% = 2%: above the fp32 floor (1e-4, 1%), below the pair's band
    assert CALIBRATE_FACTOR == 5.0 and bands.calibrated.limits() == pytest.approx((0.01, 0.02))
    assert metrics == pytest.approx({"check/band_abs_diff_mean": 0.01, "check/band_out_of_band": 0.02})
    assert "step 2: calibrated mean |d| <= 0.01 nats" in line and bands.trigger() is bands.calibrated
    assert bands.calibrate(3, measures(0.001, 0.0), weights_ok=True) is None  # once
    quiet = Bands(CheckConfig(), ("bfloat16", "bfloat16"))
    quiet.calibrate(1, measures(1e-7, 0.0), weights_ok=True)
    assert quiet.calibrated.limits() == FP32.limits()  # never below the fp32 band
    fp32 = Bands(CheckConfig(), ("float32", "float32"))
    fp32.calibrate(1, measures(2e-7, -3e-8), weights_ok=True)
    assert fp32.calibrated.limits() == FP32.limits()


@pytest.mark.parametrize("m", [
    measures(0.02, -0.019),  # one-sided: top-p/top-k log-probs processed on one side
    measures(0.002, 0.0, **{"check/logprob_abs_diff_mean/turn_first": 0.001,
                           "check/logprob_abs_diff_mean/turn_later": 0.05}),  # later turns only
    measures(0.002, 0.0, tokens=10.0),  # too few tokens
    measures(10 * BF16_PAIR.abs_diff_mean, 0.0),  # beyond the pair's band: warned, never absorbed
], ids=["one_sided", "later_turns", "few_tokens", "beyond_pair"])
def test_calibration_never_absorbs_a_fault(m):
    bands = Bands(CheckConfig(), ("bfloat16", "bfloat16"))
    assert bands.calibrate(1, m, weights_ok=True) is None and bands.calibrated is None


def test_expected_dtypes_and_why_come_from_the_config():
    cfg = OmegaConf.create({"model": {"mixed_precision": "bfloat16", "dtype": "float32"},
                            "rollout": {"backend": "vllm", "dtype": "float32"},
                            "resolved": {"rollout.dtype": {"value": "float32", "why": "null with vllm: no bf16"}}})
    pair, why = expected_dtypes(cfg)
    assert pair == ("float32", "bfloat16") and "rollout.dtype=float32 (null with vllm: no bf16)" in why
    hf = OmegaConf.create({"model": {"mixed_precision": None}, "rollout": {"backend": "hf", "dtype": None}})
    assert expected_dtypes(hf)[0] == ("float32", "float32")
    bands = Bands(CheckConfig(), pair, why)
    assert bands.dtype_fault("float32", "bfloat16") is None
    assert "engine bfloat16, trainer bfloat16; the config says engine float32" in bands.dtype_fault("bfloat16", "bfloat16")


@pytest.mark.parametrize("m,cause", [
    (measures(0.01, 0.0, **{"check/logprob_abs_diff_mean/turn_first": 0.002,
                           "check/logprob_abs_diff_mean/turn_later": 0.05}), "template"),
    (measures(0.01, -0.0095), "top_p_top_k"),
    (measures(10 * BF16_PAIR.abs_diff_mean, 0.0), "precision"),
], ids=["later_turns", "one_sided", "beyond_pair"])
def test_inside_a_bf16_band_the_structural_faults_are_still_named(m, cause):
    """A bf16 pair's band is wide, but a difference confined to later turns or of one sign is no noise."""
    assert m["check/logprob_abs_diff_mean"] < BF16_PAIR.abs_diff_mean or cause == "precision"
    out = io.StringIO()
    check = ConsistencyCheck(CheckConfig(), None, None, out=out, expected=("bfloat16", "bfloat16"), why="test")
    assert out.getvalue().startswith("consistency check: engine bfloat16, trainer bfloat16 (agree: test)")
    check.after_step(1, m)
    assert list(check.warned) == [cause] and "step 1:" in check.warned[cause]
    quiet = ConsistencyCheck(CheckConfig(), None, None, out=io.StringIO(), expected=("bfloat16", "bfloat16"))
    quiet.after_step(1, measures(0.01, 0.001))
    assert quiet.warned == {}


# ---- auto: matching dtypes, or a reason ------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("wide"), hidden_size=512, num_heads=8, num_kv_heads=4,
                            head_dim=64, num_layers=1)


def choices(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(Path(recipes.grpo.__file__).parent / "config"), version_base=None):
        cfg = compose("grpo", overrides=[f"trainer.output_dir={tmp_path}", "trainer.device=cpu", *overrides])
    return cfg, resolve_choices(cfg)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_auto_matches_the_engine_to_the_trainer(tmp_path, monkeypatch, wide_model, backend):
    monkeypatch.setattr(dtype_choice, "native_bf16", lambda device: (True, "AMX tiles"))
    cfg, record = choices(tmp_path, f"model.path={wide_model}", f"rollout.backend={backend}")
    assert cfg.model.mixed_precision == "bfloat16" and cfg.rollout.dtype == "bfloat16"
    assert "so both sides compute alike" in record["rollout.dtype"]["why"]
    assert expected_dtypes(cfg)[0] == ("bfloat16", "bfloat16")
    # an engine dtype the config names: auto trains in it, and says why
    cfg, record = choices(tmp_path, f"model.path={wide_model}", f"rollout.backend={backend}", "rollout.dtype=float32")
    assert cfg.model.mixed_precision is None and "matches rollout.dtype=float32" in record["model.mixed_precision"]["why"]


def test_vllm_without_native_bf16_keeps_fp32_and_says_why(tmp_path, monkeypatch, wide_model):
    monkeypatch.setattr(dtype_choice, "native_bf16", lambda device: (False, "CPU capability AVX2"))
    cfg, record = choices(tmp_path, f"model.path={wide_model}", "rollout.backend=vllm", "model.mixed_precision=bfloat16")
    assert cfg.rollout.dtype == "float32" and "the dtypes differ" in record["rollout.dtype"]["why"]


# ---- a real tiny model: clean pairs silent, faults named at step 1 at lr 1e-5 -------------------------------

class Run:
    """Actor and HF engine in this process, the check built as a recipe builds it: the dtypes the config
    says (``config``) and, unless ``engine`` says otherwise, the engine really in them."""

    def __init__(self, model_dir, trainer, engine, rollout=None, planted_engine=None):
        config = {"model": {"path": model_dir, "mixed_precision": trainer},
                  "rollout": {"backend": "hf", "dtype": engine, "max_new_tokens": 10, **(rollout or {})}}
        actor = ClassWithInitArgs(ActorWorker, {"model": config["model"], "actor": {"lr": LR}})
        built = {**config["rollout"], "dtype": planted_engine or engine}
        built.pop("backend")
        rollout_worker = ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir}, "rollout": built})
        self.wg = LocalWorkerGroup(create_colocated_worker_cls({"actor": actor, "rollout": rollout_worker}))
        self.wg.actor_init_model()
        self.wg.rollout_init_model()
        self.out = io.StringIO()
        expected, why = expected_dtypes(OmegaConf.create(config))
        self.check = ConsistencyCheck(CheckConfig(), SimpleNamespace(weight_checksums=self.wg.actor_weight_checksums),
                                      self.wg.rollout_weight_checksums, out=self.out, expected=expected, why=why)

    def step(self, tok, step, plant=None, **meta):
        batch = self.wg.rollout_generate_sequences(make_prompts(tok, meta_info={"n": 4, "seed": 3, **meta}))
        if plant is not None:
            plant(batch)
        sign = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(1)
        batch.batch["advantages"] = sign * batch.batch["response_mask"]
        metrics = self.wg.actor_update_policy(batch)
        metrics = metrics[0] if isinstance(metrics, list) else metrics
        self.wg.rollout_sync_weights()
        return {**metrics, **self.check.after_step(step, metrics)}


@pytest.mark.parametrize("trainer,engine", [(None, "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"),
                                            (None, "bfloat16")], ids=["fp32", "bf16_trainer", "bf16_both", "bf16_engine"])
def test_a_clean_run_of_each_pair_warns_nothing(model_dir, tok, trainer, engine):
    run = Run(model_dir, trainer, engine)
    first = run.step(tok, 1)
    second = run.step(tok, 2)
    assert first["check/weights_mismatch"] == 0 and "check/band_abs_diff_mean" in first
    assert run.check.warned == {} and "WARNING" not in run.out.getvalue()
    for m in (first, second):
        assert m["check/logprob_abs_diff_mean"] <= run.check.bands.pair().abs_diff_mean
    if (trainer, engine) == (None, "float32"):
        assert run.out.getvalue() == "" and first["check/logprob_abs_diff_mean"] < 1e-5
    else:  # said once at start: the dtypes, why, the band; bf16 noise is far above fp32's
        assert run.out.getvalue().count(f"consistency check: engine {engine}, trainer {trainer or 'float32'}") == 1
        assert first["check/logprob_abs_diff_mean"] > FP32.abs_diff_mean


def test_top_p_not_processed_is_named_at_step_1_in_bf16(model_dir, tok):
    def unfiltered(batch):  # the trainer is not told the sampler's top_p
        batch.meta_info.pop("top_p")

    run = Run(model_dir, "bfloat16", "bfloat16", rollout={"top_p": 0.7})
    run.step(tok, 1, plant=unfiltered)
    assert list(run.check.warned) == ["top_p_top_k"] and "step 1:" in run.check.warned["top_p_top_k"]
    assert run.check.bands.calibrated is None  # the one-sided difference was not taken as noise


@pytest.mark.parametrize("trainer,config_engine,planted", [(None, "float32", "bfloat16"),
                                                           ("bfloat16", "bfloat16", "float32")],
                         ids=["fp32_config_bf16_engine", "bf16_config_fp32_engine"])
def test_an_engine_not_in_the_configured_dtype_is_named_at_step_1(model_dir, tok, trainer, config_engine, planted):
    run = Run(model_dir, trainer, config_engine, planted_engine=planted)
    m = run.step(tok, 1)
    assert m["check/weights_mismatch"] == 0  # the weights are the trainer's, rounded to the engine's dtype
    assert list(run.check.warned) == ["dtype"]
    assert f"engine {planted}, trainer {trainer or 'float32'}; the config says engine {config_engine}" in \
        run.check.warned["dtype"]


# ---- recipes: sync and async, the bf16 pairs, default check (no warning) ---------------------------------

@pytest.fixture(scope="module")
def recipe_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("bands_recipe"), hidden_size=32, num_heads=2, num_kv_heads=1)


def run_recipe(name, tmp_path, model, *extra):
    import importlib

    from rlcore.trainer.tracking import read_jsonl_metrics
    module = importlib.import_module(f"recipes.{name}")
    overrides = [f"model.path={model}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=0", "trainer.save_freq=0",
                 "trainer.export_hf=false", "data.train_batch_size=4", "data.arithmetic.n_train=8",
                 "data.arithmetic.n_val=2", "rollout.n=4", "rollout.max_new_tokens=4", f"actor.lr={LR}",
                 "actor.ppo_micro_batch_size_per_gpu=8", *extra]
    with initialize_config_dir(config_dir=str(Path(module.__file__).parent / "config"), version_base=None):
        cfg = compose(name, overrides=overrides)
    run = module.train(cfg)
    return read_jsonl_metrics(run.dir / "metrics.jsonl"), OmegaConf.load(run.dir / "config.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("recipe,extra", [
    ("grpo", ["model.mixed_precision=bfloat16"]),  # the engine follows: bf16 on both sides
    ("grpo", ["model.mixed_precision=bfloat16", "rollout.dtype=float32"]),  # a pair that differs, configured
    ("ppo", ["model.mixed_precision=bfloat16", "critic.ppo_micro_batch_size_per_gpu=8", "actor.ppo_mini_batch_size=4",
             "critic.ppo_mini_batch_size=4"]),
    ("async_grpo", ["model.mixed_precision=bfloat16"]),
], ids=["grpo_bf16", "grpo_bf16_trainer_fp32_engine", "ppo_bf16", "async_grpo_bf16"])
def test_clean_bf16_recipe_runs_warn_nothing(tmp_path, recipe_model, capfd, recipe, extra):
    rows, saved = run_recipe(recipe, tmp_path, recipe_model, *extra)
    err = capfd.readouterr().err
    assert len(rows) == 2 and all(r["check/tokens"] > 0 for r in rows)
    assert "WARNING consistency check" not in err
    engine = "float32" if "rollout.dtype=float32" in extra else "bfloat16"
    assert f"consistency check: engine {engine}, trainer bfloat16" in err  # said once, at start
    if "rollout.dtype=float32" not in extra:
        assert saved.rollout.dtype == "bfloat16" and "compute alike" in saved.resolved["rollout.dtype"]["why"]
