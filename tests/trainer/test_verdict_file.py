"""The consistency check's verdicts kept in ``<run>/check.jsonl`` (rlcore.trainer.verdicts), and the
trainer's log-probs of the trajectory sample from a single-step update's own forward
(rlcore.workers.sampled_rows).

Real GRPO runs on a tiny model (HF engine, in-process workers): a clean run writes one "ok" verdict
per step with the numbers metrics.jsonl logged; a bf16 engine beside an fp32 trainer (a planted
fault of tests/trainer/test_consistency_faults.py) writes the warning and a "dtype" verdict at step 1;
a run resumed from an earlier checkpoint keeps the rows up to it and writes the steps it redoes
once. The trajectory sample of a default (one optimizer step) run carries the trainer's log-probs,
checked against a plain HF forward of the starting model; the async recipe's likewise."""

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

import recipes.async_grpo
import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.consistency import ConsistencyCheck, ConsistencyError, WeightReport
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.tracking import truncate_jsonl_after
from rlcore.trainer.verdicts import CHECK_FILE, VerdictLog
from rlcore.workers.mismatch import CheckConfig

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
DIGIT_REWARD = f"{Path(__file__).parent.parent / 'inspect' / 'digit_reward.py'}:digit_share"  # rewards that differ
RUN = ["trainer.loggers=[jsonl]", "trainer.val_freq=0", "trainer.backend=local", "trainer.trajectory_groups=2",
       "data.train_batch_size=4", "data.arithmetic.n_train=16", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=3",
       "rollout.max_new_tokens=6", "trainer.export_hf=false"]


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / CHECK_FILE).read_text().splitlines()]


# ------------------------------------------------------------------ the file itself
def test_rows_are_whole_lines_and_resume_drops_later_steps(tmp_path):
    log = VerdictLog(tmp_path)
    log.begin(1, {"check/tokens": 10.0, "check/logprob_abs_diff_mean": float("nan"), "actor/loss": 3.0})
    log.warning(1, "dtype", "engine bf16", ["a.weight"])
    log.verdict(1, {"check/tokens": 10.0, "actor/loss": 3.0, "check/weights_checked": 21.0})
    log.info(2, "weights_unreadable", "packed", ["b.weight"])
    log.verdict(2, {"check/tokens": 9.0})
    got = rows(tmp_path)
    assert got[0] == {"step": 1, "kind": "warning", "cause": "dtype", "message": "engine bf16",
                      "numbers": {"check/tokens": 10.0, "check/logprob_abs_diff_mean": None}, "tensors": ["a.weight"]}
    assert (got[1]["kind"], got[1]["cause"], got[1]["message"]) == ("verdict", "dtype", "engine bf16")
    assert got[1]["numbers"] == {"check/tokens": 10.0, "check/weights_checked": 21.0}  # check/* only
    assert [(r["step"], r["kind"], r["cause"]) for r in got[2:]] == [(2, "info", "weights_unreadable"), (2, "verdict", "ok")]
    with pytest.raises(ValueError, match="kind must be one of"):
        log.write(3, "note", "x")
    # a run killed mid-write: the last line cut short is dropped with the steps after the checkpoint
    with open(tmp_path / CHECK_FILE, "a") as f:
        f.write('{"step": 3, "kind": "verd')
    assert truncate_jsonl_after(tmp_path / CHECK_FILE, 1, partial_last_line=True) == 3
    assert [r["step"] for r in rows(tmp_path)] == [1, 1]
    VerdictLog(tmp_path, start_step=0)  # a fresh run starts the file anew
    assert (tmp_path / CHECK_FILE).read_text() == ""


def test_the_check_keeps_every_warning_names_tensors_and_strict_writes_first(tmp_path):
    """Said once on stderr, kept every time; a weight cause names its tensors; a strict run's row is
    written before it stops."""
    out, log = io.StringIO(), VerdictLog(tmp_path)
    check = ConsistencyCheck(CheckConfig(), out=out, record=log)
    bad = {"check/tokens": 50.0, "check/logprob_abs_diff_mean": 0.2, "check/logprob_diff_mean": 0.01,
           "check/ratio_out_of_band": 0.3}
    for step in (1, 2):
        log.begin(step, bad)
        check.after_step(step, bad)
        log.verdict(step, bad)
    assert out.getvalue().count("WARNING") == 1
    got = rows(tmp_path)
    assert [(r["step"], r["kind"], r["cause"]) for r in got] == [(1, "warning", "unexplained"), (1, "verdict", "unexplained"),
                                                                 (2, "warning", "unexplained"), (2, "verdict", "unexplained")]
    assert got[0]["numbers"]["check/logprob_abs_diff_mean"] == 0.2 and "0.2 > 0.0001" in got[0]["message"]
    check.last_weights = WeightReport(3, 4, ["model.layers.1.mlp.up_proj.weight"], [], {}, "float32", "float32")
    check.report(3, "weights_partial", "a bucket")
    assert rows(tmp_path)[-1]["tensors"] == ["model.layers.1.mlp.up_proj.weight"]
    # a note said once: an engine that reports no checksums turns the weight comparison off, kept as info
    blind = ConsistencyCheck(CheckConfig(), actor=object(), engines=lambda: [None], out=out, record=log)
    ok = {"check/tokens": 50.0, "check/logprob_abs_diff_mean": 1e-7, "check/ratio_out_of_band": 0.0}
    for step in (1, 10):
        blind.after_step(step, ok)
    notes = [r for r in rows(tmp_path) if r["kind"] == "info"]
    assert [(r["step"], r["cause"]) for r in notes] == [(1, "weights_unsupported")]
    assert out.getvalue().count("weight checksums off") == 1
    strict = ConsistencyCheck(CheckConfig(strict=True), out=out, record=log)
    with pytest.raises(ConsistencyError):
        strict.after_step(4, bad)
    last = rows(tmp_path)[-1]
    assert (last["step"], last["kind"], last["cause"]) == (4, "warning", "unexplained")


# ------------------------------------------------------------------ real runs
def tiny_model(folder: Path) -> Path:
    """The runs' model, built by the first run that needs it."""
    model = folder / "model"
    if not model.is_dir():
        build_tiny_model(model, hidden_size=64, num_heads=2, num_kv_heads=1)
    return model


def train(tmp: Path, *overrides: str):
    model = tiny_model(tmp.parent)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("grpo", overrides=[f"trainer.output_dir={tmp}", f"model.path={model}", *RUN, *overrides])
    return recipes.grpo.train(cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verdicts")


@pytest.fixture(scope="module")
def clean_run(runs) -> Path:
    return train(runs / "clean", "trainer.total_steps=2", "trainer.save_freq=1", f"reward.reward_fn={DIGIT_REWARD}").dir


@pytest.mark.slow  # a recipe run
def test_clean_run_writes_an_ok_verdict_per_step_with_its_numbers(clean_run):
    got = rows(clean_run)
    assert [(r["step"], r["kind"], r["cause"]) for r in got] == [(1, "verdict", "ok"), (2, "verdict", "ok")]
    logged = {r["step"]: r for r in read_jsonl_metrics(clean_run / "metrics.jsonl")}
    for r in got:
        want = {k: v for k, v in logged[r["step"]].items() if k.startswith("check/")}
        assert r["numbers"] == pytest.approx(want) and r["numbers"]["check/tokens"] > 0
    assert "check/weights_checked" in got[0]["numbers"]  # step 1 compared the weights, step 2 not (every 10)
    assert "check/weights_checked" not in got[1]["numbers"]


@pytest.mark.slow  # a recipe run
def test_resumed_run_keeps_earlier_rows_and_redoes_later_steps_once(clean_run, runs):
    folder = runs / "resumed"
    shutil.copytree(clean_run.parent.parent, folder)
    run_dir = folder / clean_run.relative_to(clean_run.parent.parent)
    first = (run_dir / CHECK_FILE).read_text().splitlines()[0]
    with open(run_dir / CHECK_FILE, "a") as f:  # a row an interrupted run wrote after its last checkpoint
        f.write(json.dumps({"step": 3, "kind": "verdict", "cause": "stale", "message": "", "numbers": {}, "tensors": []}) + "\n")
    resumed = train(folder, "trainer.total_steps=3", f"trainer.resume={run_dir / 'checkpoints' / 'global_step_1'}").dir
    assert resumed == run_dir
    got = rows(run_dir)
    assert [(r["step"], r["cause"]) for r in got] == [(1, "ok"), (2, "ok"), (3, "ok")]
    assert (run_dir / CHECK_FILE).read_text().splitlines()[0] == first  # kept as it was


@pytest.mark.slow  # a recipe run
def test_bf16_engine_is_kept_as_a_warning_and_a_dtype_verdict(runs, monkeypatch):
    """A planted fault (test_consistency_faults' (b)): a bf16 engine beside an fp32 trainer where the
    check was told both sides are fp32 (a configured bf16 engine is no fault: test_check_bands)."""
    import rlcore.trainer.loop

    monkeypatch.setattr(rlcore.trainer.loop, "expected_dtypes", lambda cfg: (("float32", "float32"), "planted"))
    run = train(runs / "bf16", "trainer.total_steps=1", "rollout.dtype=bfloat16", "model.mixed_precision=null")
    got = rows(run.dir)
    assert [(r["step"], r["kind"], r["cause"]) for r in got] == [(1, "warning", "dtype"), (1, "verdict", "dtype")]
    assert "engine bfloat16, trainer float32" in got[0]["message"]
    assert got[0]["numbers"]["check/logprob_abs_diff_mean"] > 1e-4  # the fp32 pair's band
    assert got[0]["numbers"]["check/logprob_abs_diff_mean"] == got[1]["numbers"]["check/logprob_abs_diff_mean"]


@pytest.mark.slow  # a recipe run
def test_single_step_run_samples_the_trainers_log_probs_of_its_first_forward(clean_run):
    """Default GRPO (one optimizer step, no old_log_probs in the batch): every sampled response has the
    trainer's log-probs, and at step 1 they are the starting model's, as a plain HF forward scores them."""
    model = AutoModelForCausalLM.from_pretrained(clean_run.parents[2] / "model").eval()

    def starting_model(r: dict) -> list[float]:
        ids = torch.tensor([r["prompt_ids"] + r["ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r["prompt_ids"]) - 1:-1].double()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(r["ids"])[:, None])[:, 0].tolist()

    sample = {}
    for step in (1, 2):
        sample[step] = [json.loads(line) for line in
                        (clean_run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(sample[step]) == 6 and len({r["group"] for r in sample[step]}) == 2  # 2 groups x rollout.n 3
        assert all(r["trainer_logprob"] is not None and len(r["trainer_logprob"]) == r["length"] for r in sample[step])
    for r in sample[1]:  # scored before the optimizer moved
        assert r["trainer_logprob"] == pytest.approx(starting_model(r), abs=2e-5)
    # step 2's were scored by the policy after step 1's update, which the starting model is not: the
    # comparison above tells the forward before the optimizer step from one after it
    moved = max(abs(a - b) for r in sample[2] for a, b in zip(r["trainer_logprob"], starting_model(r)))
    assert moved > 1e-3


@pytest.mark.slow  # a recipe run
def test_async_grpo_keeps_verdicts_and_samples_the_trainers_log_probs(runs):
    """The async recipe (rows sampled by older policies, one optimizer step per batch) writes a verdict
    per step, and its sample has the trainer's log-probs too."""
    model = tiny_model(runs)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("async_grpo", overrides=[
            f"trainer.output_dir={runs / 'async'}", f"model.path={model}", "trainer.backend=local", "trainer.loggers=[jsonl]",
            "model.mixed_precision=null", "trainer.total_steps=2", "trainer.val_freq=0", "trainer.export_hf=false",
            "data.train_batch_size=2", "data.arithmetic.n_train=8", "rollout.n=2", "rollout.max_new_tokens=3",
            "actor.ppo_micro_batch_size_per_gpu=4", "trainer.trajectory_groups=1"])
    run = recipes.async_grpo.train(cfg).dir
    assert [(r["step"], r["kind"]) for r in rows(run)] == [(1, "verdict"), (2, "verdict")]
    for step in (1, 2):
        records = [json.loads(line) for line in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert records and all(r["trainer_logprob"] is not None and len(r["trainer_logprob"]) == r["length"]
                               for r in records)
