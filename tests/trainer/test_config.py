"""Recipe configs: defaults filled from the recipe dataclasses and the workers' own tables, and
every unknown section, key or ill-typed value refused by name, through load_config and through
Hydra composition over a registered schema."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError

from rlcore.trainer.config import ConfigError, load_config, register_schema
from rlcore.workers.actor import ACTOR_DEFAULTS

SECTIONS = ("model", "actor", "rollout", "reward", "data", "trainer", "algorithm")


def test_defaults_fill_every_section_and_given_values_win():
    cfg = load_config({"actor": {"lr": 3e-4}, "data": {"arithmetic": {"max_operand": 9}}}, SECTIONS)
    assert cfg.actor.lr == 3e-4
    assert cfg.actor.clip_ratio_low == ACTOR_DEFAULTS["clip_ratio_low"]  # the worker's own table
    assert cfg.data.arithmetic.max_operand == 9 and cfg.data.arithmetic.ops == "+"
    assert cfg.rollout.stop == [] and cfg.rollout.backend == "hf"
    assert cfg.algorithm.kl_ctrl.type == "fixed"
    assert cfg.trainer.backend == "ray" and cfg.trainer.loggers == ["console", "jsonl", "tensorboard"]


@pytest.mark.parametrize("given, named", [
    ({"actor": {"lrr": 1}}, "actor.lrr"),
    ({"trainer": {"totl_steps": 1}}, "trainer.totl_steps"),
    ({"data": {"arithmetic": {"max_op": 1}}}, "data.arithmetic.max_op"),
    ({"algorithm": {"kl_ctrl": {"coef": 1}}}, "algorithm.kl_ctrl.coef"),
    ({"trainer": {"total_steps": "many"}}, "trainer.total_steps"),
])
def test_unknown_or_ill_typed_key_is_an_error_naming_it(given, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(given, SECTIONS)


def test_unknown_section_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"\['foo'\]"):
        load_config({"foo": {"bar": 1}}, SECTIONS)
    with pytest.raises(ConfigError, match="critic"):  # a real section this recipe does not read
        load_config({"critic": {"lr": 1.0}}, ("actor",))


def test_free_form_mappings_take_any_key_and_the_result_is_struct():
    cfg = load_config({"reward": {"reward_kwargs": {"format_score": 0.1}}}, SECTIONS)
    assert cfg.reward.reward_kwargs == {"format_score": 0.1}
    with pytest.raises(ConfigAttributeError):
        cfg.trainer.totl_steps  # a typo in code fails too


def test_hydra_yaml_keys_and_interpolations_are_dropped_before_checking():
    raw = OmegaConf.create({"defaults": ["x", "_self_"], "hydra": {"run": {"dir": "${trainer.output_dir}/x"}},
                            "trainer": {"total_steps": 3}})
    assert load_config(raw, SECTIONS).trainer.total_steps == 3


def test_hydra_composition_over_the_schema(tmp_path):
    register_schema("test_schema", SECTIONS)
    (tmp_path / "app.yaml").write_text("defaults:\n  - test_schema\n  - _self_\ntrainer:\n  total_steps: 7\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose("app", overrides=["actor.lr=0.5", "trainer.cpus_per_proc=2"])  # keys only the schema has
        assert cfg.trainer.total_steps == 7 and cfg.actor.lr == 0.5 and cfg.trainer.cpus_per_proc == 2
        assert load_config(cfg, SECTIONS).actor.clip_ratio_high == ACTOR_DEFAULTS["clip_ratio_high"]
        with pytest.raises(ConfigCompositionException, match="foo.bar"):
            compose("app", overrides=["foo.bar=1"])
        with pytest.raises(ConfigCompositionException, match="actor.lrr"):
            compose("app", overrides=["actor.lrr=1"])
