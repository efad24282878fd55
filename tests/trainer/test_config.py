"""Recipe configs: defaults filled from the section dataclasses (rlcore.trainer.config.SECTIONS), and
every unknown section, key, ill-typed or out-of-range value refused by name, through load_config and
through Hydra composition over a registered schema (also the real recipes/config/grpo.yaml)."""

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError

import recipes.grpo  # registers grpo_schema
from rlcore.engines.base import RolloutConfig
from rlcore.models.config import ModelConfig
from rlcore.trainer.config import SECTIONS as ALL_SECTIONS
from rlcore.trainer.config import ConfigError, load_config, register_schema, to_plain
from rlcore.typed_config import read_section
from rlcore.workers.config import ActorConfig

RECIPE_CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "config"

SECTIONS = ("model", "actor", "rollout", "reward", "data", "trainer", "algorithm")


def test_defaults_fill_every_section_and_given_values_win():
    cfg = load_config({"actor": {"lr": 3e-4}, "data": {"arithmetic": {"max_operand": 9}}}, SECTIONS)
    assert cfg.actor.lr == 3e-4
    assert cfg.actor.clip_ratio_low == ActorConfig().clip_ratio_low == 0.2  # the section dataclass's default
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
        assert load_config(cfg, SECTIONS).actor.clip_ratio_high == ActorConfig().clip_ratio_high
        with pytest.raises(ConfigCompositionException, match="foo.bar"):
            compose("app", overrides=["foo.bar=1"])
        with pytest.raises(ConfigCompositionException, match="actor.lrr"):
            compose("app", overrides=["actor.lrr=1"])


def test_an_ill_typed_value_names_the_key_and_the_expected_type():
    with pytest.raises(ConfigError, match=r"config key actor\.lr: .*'abc'.*\(expected float\)"):
        load_config({"actor": {"lr": "abc"}}, SECTIONS)


@pytest.mark.parametrize("text", ["no", "off", "false", "No"])
def test_boolean_words_load_as_false(text):
    assert load_config({"rollout": {"do_sample": text}}, SECTIONS).rollout.do_sample is False
    assert read_section({"rollout": {"do_sample": text}}, "rollout", RolloutConfig).do_sample is False


def test_a_word_that_is_not_a_boolean_is_refused():
    assert load_config({"rollout": {"do_sample": "yes"}}, SECTIONS).rollout.do_sample is True
    with pytest.raises(ConfigError, match=r"rollout\.do_sample.*maybe.*\(expected bool\)"):
        load_config({"rollout": {"do_sample": "maybe"}}, SECTIONS)
    with pytest.raises(ConfigError, match=r"rollout\.do_sample"):
        read_section({"rollout": {"do_sample": "maybe"}}, "rollout", RolloutConfig)


@pytest.mark.parametrize("given, section, reason", [
    ({"actor": {"loss_agg_mode": "bogus"}}, "actor", "loss_agg_mode 'bogus'"),
    ({"actor": {"clip_ratio_high": -0.1}}, "actor", "clip ratios must be >= 0"),
    ({"actor": {"kl_loss_type": "k4"}}, "actor", "kl_loss_type 'k4'"),
    ({"rollout": {"top_p": 0}}, "rollout", r"top_p must be in \(0, 1\]"),
    ({"trainer": {"backend": "slurm"}}, "trainer", "trainer.backend must be one of"),
])
def test_a_range_or_choice_check_is_a_config_error_naming_the_section(given, section, reason):
    with pytest.raises(ConfigError, match=rf"config section '{section}': .*{reason}"):
        load_config(given, SECTIONS)


def test_read_section_gives_the_frozen_dataclass_and_leaves_other_sections_alone():
    whole = {"rollout": {"n": 4, "stop": ["\\n"]}, "not_a_section": {"anything": 1}}
    rollout = read_section(whole, "rollout", RolloutConfig)
    assert isinstance(rollout, RolloutConfig) and rollout.n == 4 and rollout.stop == ["\\n"]
    assert rollout.stop_token_ids == [] and rollout.top_p == RolloutConfig().top_p
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollout.n = 5
    assert read_section({}, "actor", ActorConfig) == ActorConfig()  # a missing section: all defaults
    with pytest.raises(ConfigError, match="no 'actor' section"):
        read_section({}, "actor", ActorConfig, required=True)


def test_the_grpo_recipe_yaml_composes_every_key_of_its_sections():
    with initialize_config_dir(config_dir=str(RECIPE_CONFIGS), version_base=None):
        cfg = compose("grpo")
    assert set(cfg) == set(recipes.grpo.SECTIONS)
    for name in recipes.grpo.SECTIONS:
        assert set(cfg[name]) == {f.name for f in dataclasses.fields(ALL_SECTIONS[name])}, name
    assert cfg.actor.use_kl_loss is True and cfg.trainer.total_steps == 300  # grpo.yaml
    assert cfg.actor.lr == 2.0e-4 and cfg.rollout.n == 8 and cfg.trainer.cpus_per_proc == 2  # base.yaml
    assert cfg.actor.clip_ratio_low == ActorConfig().clip_ratio_low  # the schema's default
    assert cfg.model.path is None
    loaded = load_config(cfg, recipes.grpo.SECTIONS)
    assert loaded.algorithm.adv_estimator == "grpo" and loaded.actor.use_kl_loss is True


def test_the_grpo_recipe_yaml_refuses_bad_overrides_by_name():
    with initialize_config_dir(config_dir=str(RECIPE_CONFIGS), version_base=None):
        assert compose("grpo", overrides=["actor.lr=0.5"]).actor.lr == 0.5
        with pytest.raises(ConfigCompositionException, match=r"actor\.lrr"):
            compose("grpo", overrides=["actor.lrr=1"])
        with pytest.raises(ConfigCompositionException, match=r"actor\.lr"):
            compose("grpo", overrides=["actor.lr=abc"])


def test_boolean_words_on_the_command_line_reach_the_workers_as_false():
    """rollout.do_sample=no and actor.use_kl_loss=off: false in the loaded config, in what the workers get,
    and in a section a script built as a dataclass by hand (which keeps any value until read)."""
    with initialize_config_dir(config_dir=str(RECIPE_CONFIGS), version_base=None):
        cfg = compose("grpo", overrides=["rollout.do_sample=no", "actor.use_kl_loss=off"])
        with pytest.raises(ConfigCompositionException, match=r"rollout\.do_sample"):
            compose("grpo", overrides=["rollout.do_sample=maybe"])
    loaded = load_config(cfg, recipes.grpo.SECTIONS)
    assert loaded.rollout.do_sample is False and loaded.actor.use_kl_loss is False
    plain = to_plain(loaded)
    assert read_section(plain, "rollout", RolloutConfig).do_sample is False
    assert read_section(plain, "actor", ActorConfig).use_kl_loss is False
    by_hand = {"rollout": RolloutConfig(do_sample="no"), "actor": ActorConfig(use_kl_loss="off")}
    assert read_section(by_hand, "rollout", RolloutConfig).do_sample is False
    assert read_section(by_hand, "actor", ActorConfig).use_kl_loss is False
    with pytest.raises(ConfigError, match=r"config key actor\.use_kl_loss: .*'maybe'"):
        read_section({"actor": ActorConfig(use_kl_loss="maybe")}, "actor", ActorConfig)


def test_a_model_path_that_is_not_a_local_model_directory_fails_at_load_time(tmp_path, monkeypatch):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ConfigError, match=rf"model.path: not a local HF model directory: {missing} \(no config.json\)"):
        load_config({"model": {"path": str(missing)}}, SECTIONS)
    with pytest.raises(FileNotFoundError, match="not a local HF model directory"):  # what the workers check
        ModelConfig(path=str(tmp_path)).require_local_dir()
    (tmp_path / "config.json").write_text("{}")
    assert load_config({"model": {"path": str(tmp_path)}}, SECTIONS).model.path == str(tmp_path)
    monkeypatch.setattr(recipes.grpo, "AutoTokenizer", None)  # any tokenizer (or Hub) lookup would fail otherwise
    with initialize_config_dir(config_dir=str(RECIPE_CONFIGS), version_base=None):
        cfg = compose("grpo", overrides=[f"model.path={missing}"])
    with pytest.raises(ConfigError, match="not a local HF model directory"):
        recipes.grpo.train(cfg)


@pytest.mark.parametrize("given, named", [
    ({"trainer": {"procs_per_node": 4}, "data": {"train_batch_size": 6}},
     r"data.train_batch_size=6 prompts do not split evenly over 4 ranks \(trainer.nnodes=1 x trainer.procs_per_node=4"),
    ({"trainer": {"nnodes": 2, "procs_per_node": 2}, "data": {"train_batch_size": 8}, "actor": {"ppo_mini_batch_size": 2}},
     r"actor.ppo_mini_batch_size=2 prompts \(2 rows, 1 per prompt\) do not split evenly over 4 ranks \(trainer.nnodes=2"),
    ({"data": {"train_batch_size": 8}, "rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 3}},
     r"actor.ppo_mini_batch_size=3 does not divide data.train_batch_size=8: both count prompts"),
    ({"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 100}, "rollout": {"max_new_tokens": 64}},
     r"actor.ppo_max_token_len_per_gpu=100 is below the longest possible sequence \(128 tokens"),
])
def test_batch_sizes_that_cannot_split_over_the_ranks_fail_at_load_time(given, named):
    with pytest.raises(ConfigError, match=named):
        load_config(given, SECTIONS)


def test_a_batch_that_does_not_split_fails_before_the_workers_are_built(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("reached a warm start or built workers")

    monkeypatch.setattr(recipes.grpo, "warm_start", never)
    monkeypatch.setattr(recipes.grpo, "build_workers", never)
    with initialize_config_dir(config_dir=str(RECIPE_CONFIGS), version_base=None):
        cfg = compose("grpo", overrides=["trainer.procs_per_node=3"])  # 64 prompts over 3 ranks
    with pytest.raises(ConfigError, match=r"data.train_batch_size=64 .* trainer.procs_per_node=3"):
        recipes.grpo.train(cfg)


def test_a_nested_frozen_section_composes_and_is_checked_like_a_top_level_one():
    """actor.lora is a frozen dataclass inside a frozen dataclass: Hydra overrides reach it (the schema
    is writable at every depth), an unknown or ill-typed nested key is refused by its full name, and
    the error says the type expected."""
    with initialize_config_dir(config_dir=str(RECIPE_CONFIGS), version_base=None):
        cfg = compose("grpo", overrides=["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]"])
        assert compose("grpo", overrides=["actor.lora.target_modules=all-linear"]).actor.lora.target_modules == \
            "all-linear"
        with pytest.raises(ConfigCompositionException, match=r"actor\.lora\.rnk"):
            compose("grpo", overrides=["actor.lora.rnk=8"])
    loaded = load_config(cfg, recipes.grpo.SECTIONS)
    assert loaded.actor.lora.rank == 8 and list(loaded.actor.lora.target_modules) == ["q_proj", "v_proj"]
    lora = read_section(to_plain(loaded), "actor", ActorConfig).lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 16.0, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match=r"config key actor\.lora\.alpha: .*'big'.*\(expected float\)"):
        load_config({"actor": {"lora": {"alpha": "big"}}}, SECTIONS)
