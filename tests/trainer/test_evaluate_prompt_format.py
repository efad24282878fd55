"""``evaluate`` renders plain-string prompts as the run that trained the model did: the export records
``data.apply_chat_template`` as the run resolved it (``rlcore.trainer.prompt_format``), evaluate reads it
and says which it used; a flag or ``--run-config`` decide instead; a model no run exported gets auto."""

import json
import shutil

import pytest
from omegaconf import OmegaConf

import rlcore.trainer.evaluate as evaluate
from rlcore.trainer import prompt_format


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "data_source": "arithmetic"})
                            + "\n" for a, b in ((1, 2), (3, 4))))
    return str(path)


def exported(model_dir, tmp_path, setting):
    """A run folder with the tiny model as its ``hf`` export, recorded as a run of ``setting`` would."""
    run = tmp_path / f"run_{setting}"
    shutil.copytree(model_dir, run / "hf")
    prompt_format.record(OmegaConf.create({"data": {"apply_chat_template": setting}}), run / "hf")
    return run / "hf"


def test_the_record_holds_the_setting_and_what_it_resolved_to(model_dir, tmp_path, tok):
    assert tok.chat_template  # so auto resolves to the template
    for setting, applied in ((False, False), ("auto", True), (True, True), (None, True)):
        hf = exported(model_dir, tmp_path, setting)
        assert json.loads((hf / prompt_format.RECORD).read_text()) == {"data.apply_chat_template": setting,
                                                                        "applied": applied}
        assert prompt_format.recorded(hf)[0] is applied


def test_an_export_without_a_record_reads_its_run_config(model_dir, tmp_path):
    run = tmp_path / "old_run"
    for hf in (run / "hf", run / "checkpoints" / "global_step_3" / "hf"):
        shutil.copytree(model_dir, hf)
    (run / "config.yaml").write_text("data:\n  apply_chat_template: auto\n")
    for hf in (run / "hf", run / "checkpoints" / "global_step_3" / "hf"):
        value, how = prompt_format.recorded(hf)
        assert (value, how) == ("auto", f"data.apply_chat_template=auto of the run's {run / 'config.yaml'}")
    assert prompt_format.recorded(model_dir) is None  # a model no run exported


def test_evaluate_renders_prompts_as_the_run_did_and_says_so(model_dir, tmp_path, data, capsys):
    plain = exported(model_dir, tmp_path, False)
    args = ["--data", data, "--backend", "hf", "--max-new-tokens", "2", "--show", "0"]
    evaluate.main([str(plain), *args])
    out = capsys.readouterr().out
    assert ("evaluating on 2 prompts (2 plain-string prompts as plain text, no chat template); "
            f"data.apply_chat_template=false of the run, recorded in {plain / prompt_format.RECORD}") in out
    evaluate.main([str(plain), *args, "--apply-chat-template", "auto"])  # the flag wins
    assert ("(2 plain-string prompts through the tokenizer's chat template); --apply-chat-template auto"
            in capsys.readouterr().out)
    evaluate.main([model_dir, *args])  # no run exported it: auto, and said so
    assert ("through the tokenizer's chat template); no run recorded how it rendered prompts"
            in capsys.readouterr().out)
