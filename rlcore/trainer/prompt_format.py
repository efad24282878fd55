"""Whether a run put plain-string prompts through the chat template: recorded beside every HF export,
read back by ``python -m rlcore.trainer.evaluate``.

Why: ``data.apply_chat_template`` (false by default, ``auto`` in the SmolLM2 preset) decides how a run
renders a plain-string prompt; a model trained on raw ``"12+7="`` and scored on the templated prompt (or
the reverse) is judged on text it never saw. The export is what leaves the run, so it carries the choice:
``<export>/rlcore_prompts.json`` holds the setting and what it resolved to with the export's tokenizer.
For an export without one (written before the record existed) the run folder's ``config.yaml`` beside
it says the setting (``<run>/hf``, ``<run>/checkpoints/global_step_N/hf``). Chat-list prompts always
go through the template; the record is about plain strings only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlcore.data.dataset import use_chat_template

RECORD = "rlcore_prompts.json"
RUN_CONFIG = "config.yaml"  # rlcore.trainer.export's: the run's resolved config in the run folder


def configured(cfg: DictConfig | Mapping) -> Any:
    """The run's ``data.apply_chat_template`` (the data section's default, false, when it has none)."""
    data = cfg.get("data") or {}
    return data.get("apply_chat_template", False)


def record(cfg: DictConfig | Mapping, export_dir: str | Path) -> dict[str, Any]:
    """Write the run's choice into ``export_dir`` (a HF directory with its tokenizer); returns it."""
    setting = configured(cfg)
    if isinstance(setting, DictConfig):
        setting = OmegaConf.to_container(setting)
    tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    out = {"data.apply_chat_template": setting, "applied": use_chat_template(setting, tokenizer)}
    (Path(export_dir) / RECORD).write_text(json.dumps(out) + "\n")
    return out


def recorded(model_dir: str | Path) -> tuple[Any, str] | None:
    """(the ``data.apply_chat_template`` to evaluate ``model_dir`` with, where it was read), or None when
    neither the export nor its run folder says. The record's resolved value wins: a run's ``auto``
    decided against the tokenizer it had."""
    model_dir = Path(model_dir)
    if (model_dir / RECORD).is_file():
        rec = json.loads((model_dir / RECORD).read_text())
        return rec["applied"], (f"data.apply_chat_template={_show(rec['data.apply_chat_template'])} of the run, "
                                f"recorded in {model_dir / RECORD}")
    for run in (model_dir.parent, *model_dir.parents[2:3]):  # <run>/hf, <run>/checkpoints/global_step_N/hf
        config = run / RUN_CONFIG
        if config.is_file():
            setting = configured(OmegaConf.to_container(OmegaConf.load(config), resolve=False))
            return setting, f"data.apply_chat_template={_show(setting)} of the run's {config}"
    return None


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
