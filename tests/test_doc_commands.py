"""Every command the README and docs/ show in a ```bash block stays honest: each ``python -m
recipes.X ...`` composes with Hydra (every key exists, every preset is there) and loads with the
recipe's typed config (every value has its type), or, where its comment says it is an error, fails;
each other ``python -m module`` names a module that exists and flags that it parses. No command runs."""

import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlcore.typed_config import ConfigError
from rlcore.trainer.config import load_config
from rlcore.trainer.verl_compat import translate_overrides

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
CONFIG_DIR = REPO / "recipes" / "config"


def doc_commands() -> list[tuple[str, str, str]]:
    """(page, command, its comment) for every ``python -m`` command in a bash block."""
    found = []
    for page in PAGES:
        for block in BASH.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                code, _, comment = line.partition(" # ")
                for part in code.split("&&"):
                    words = shlex.split(part.strip(), comments=True) if part.strip() else []
                    if len(words) >= 3 and words[0].endswith("python") and words[1] == "-m" and words[2] != "pytest":
                        found.append((page.name, " ".join(words[2:]), comment.strip()))
    return found


COMMANDS = doc_commands()


def test_the_pages_show_commands():
    assert any(cmd.startswith("recipes.ppo") for _, cmd, _ in COMMANDS)  # the README's main job, at least


def load_recipe_config(module_name: str, args: list[str]):
    name = module_name.split(".")[1]
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    module = importlib.import_module(module_name)  # registers the recipe's schema, which its YAML names
    overrides = translate_overrides(overrides, module.SECTIONS)[0]  # verl's keys, as the recipe's __main__ does
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(name, overrides=overrides)
    model_path = OmegaConf.select(cfg, "model.path")
    with open_dict(cfg):  # paths of the user's machine are not this one's: their types are still checked
        if model_path is not None and not Path(str(model_path)).is_dir():
            cfg.model.path = None
        if OmegaConf.select(cfg, "reward.model.path") is not None:
            cfg.reward.model.path = None
    return load_config(cfg, module.SECTIONS)


@pytest.mark.parametrize("page, command, comment", [c for c in COMMANDS if c[1].startswith("recipes.")
                                                    and not c[1].startswith("recipes.data")],
                         ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_recipe_commands_compose_and_load(page, command, comment):
    module, *args = command.split()
    if "error" in comment.lower():
        with pytest.raises((ConfigError, HydraException, OmegaConfBaseException, ValueError)):
            load_recipe_config(module, args)
    else:
        load_recipe_config(module, args)


@pytest.mark.parametrize("page, command, comment", [c for c in COMMANDS if not c[1].startswith("recipes.")
                                                    or c[1].startswith("recipes.data")],
                         ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_other_commands_name_real_modules_and_flags(page, command, comment):
    module, *args = command.split()
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{page}: python -m {module}: no such module"
    source = Path(spec.origin).read_text()
    if spec.submodule_search_locations:  # a package: its __main__ and what it imports hold the flags
        source = "".join(p.read_text() for p in Path(spec.origin).parent.rglob("*.py"))
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"{page}: python -m {command}: {module} has no {flag}"
