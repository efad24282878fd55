"""The sections an engine is built from, ``rollout`` (RolloutConfig) and ``model`` (ModelConfig), read
with ``read_section``: every mistake is a ConfigError naming the section and the key."""

import numpy as np
import pytest
from omegaconf import OmegaConf

from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.models.config import ModelConfig
from rlcore.typed_config import ConfigError, read_section


def rollout(**section) -> RolloutConfig:
    return read_section({"model": {"path": "/m"}, "rollout": section}, "rollout", RolloutConfig)


def model(**section) -> ModelConfig:
    return read_section({"model": section, "rollout": {}}, "model", ModelConfig)


def test_sections_are_read_typed_and_other_sections_left_alone():
    config = OmegaConf.create({"model": {"path": "/m", "dtype": "bfloat16"},
                               "rollout": {"n": "4", "stop": ["\n"], "do_sample": "no"}, "actor": {"lrr": 1.0}})
    m, r = read_section(config, "model", ModelConfig), read_section(config, "rollout", RolloutConfig)
    assert (m.path, m.dtype, r.n, r.stop, r.do_sample, r.temperature) == ("/m", "bfloat16", 4, ["\n"], False, 1.0)
    assert isinstance(r.n, int) and r.stop_token_ids == []
    assert read_section({}, "rollout", RolloutConfig) == RolloutConfig()  # a missing section: all defaults
    assert model(path="/m").require_path() == "/m"


@pytest.mark.parametrize("section, expected", [
    ({"temprature": 1.0}, r"rollout\.temprature: Key 'temprature' not in 'RolloutConfig'"),
    ({"n": "abc"}, r"rollout\.n: Value 'abc' .* \(expected int\)"),
    ({"do_sample": "maybe"}, r"rollout\.do_sample: .*'maybe'.*\(expected bool\)"),
    ({"backend": "sglang"}, r"section 'rollout': rollout\.backend must be one of \('hf', 'vllm'\), got 'sglang'"),
    ({"top_p": 0.0}, r"section 'rollout': top_p must be in \(0, 1\], got 0\.0"),
    ({"temperature": -1}, r"section 'rollout': temperature must be >= 0"),
    ({"n": 0}, r"section 'rollout': n must be positive, got 0"),
    ({"max_new_tokens": 0}, r"section 'rollout': max_new_tokens must be positive"),
    ({"dtype": "float8"}, r"section 'rollout': rollout\.dtype must be one of .*got 'float8'"),
    ({"gpu_memory_utilization": 0}, r"rollout\.gpu_memory_utilization must be in \(0, 1\]"),
    ({"stop": [""]}, r"rollout\.stop must be a string or a list of non-empty strings"),
    ({"max_num_seqs": 0}, r"rollout\.max_num_seqs must be >= 1 \(or null: the engine's default\), got 0"),
    ({"prefix_cache_bytes": -1}, r"rollout\.prefix_cache_bytes must be >= 0 \(0: off\), got -1"),
    ({"cpu_weight_layout": "flat"}, r"rollout\.cpu_weight_layout must be one of \('auto', 'packed', 'plain'\), got 'flat'"),
])
def test_rollout_errors_name_the_key(section, expected):
    with pytest.raises(ConfigError, match=expected):
        rollout(**section)


@pytest.mark.parametrize("section, expected", [
    ({"path": "/m", "dtype": "float8"}, r"section 'model': model\.dtype must be one of .*got 'float8'"),
    ({"path": "/m", "device": "cpu"}, r"model\.device: Key 'device' not in 'ModelConfig'"),  # trainer.device now
    ({"path": "/m", "mixed_precision": "float16"}, r"model\.mixed_precision must be null, 'bfloat16' or 'auto'"),
    ({"path": "/m", "dtype": "bfloat16", "mixed_precision": "bfloat16"}, r"set model\.dtype=float32"),
    ({"path": "/m", "gradient_checkpointing": "maybe"}, r"model\.gradient_checkpointing: .*'maybe'"),
])
def test_model_errors_name_the_key(section, expected):
    with pytest.raises(ConfigError, match=expected):
        model(**section)


def test_missing_sections_and_path():
    with pytest.raises(ConfigError, match="no 'rollout' section; it has \\['model', 'rolout'\\]"):
        read_section({"model": {"path": "/m"}, "rolout": {}}, "rollout", RolloutConfig, required=True)
    with pytest.raises(ConfigError, match="section 'rollout' must be a mapping"):
        read_section({"rollout": 3}, "rollout", RolloutConfig)
    with pytest.raises(ValueError, match="model.path is required"):
        model().require_path()


def test_per_call_overrides_are_checked_too():
    cfg = rollout(temperature=0.7, stop=["\n"])
    s = SamplingSettings.resolve(cfg, {"top_k": -1, "stop": "ab", "stop_token_ids": [5], "other": "ignored"})
    assert (s.temperature, s.top_k, s.stop, s.stop_token_ids) == (0.7, 0, ("ab",), (5,))
    assert SamplingSettings.resolve(cfg, {"validate": True}).greedy
    with pytest.raises(ValueError, match="n must be positive"):
        SamplingSettings.resolve(cfg, {"n": 0})
    with pytest.raises(ValueError, match="top_k must be >= 1, or 0 / -1"):
        SamplingSettings.resolve(cfg, {"top_k": -2})


@pytest.mark.parametrize("key, value, expected", [
    ("do_sample", "no", "meta_info['do_sample'] must be a bool, got str 'no'"),
    ("ignore_eos", 2, "meta_info['ignore_eos'] must be a bool, got int 2"),
    ("n", "2", "meta_info['n'] must be a int, got str '2'"),
    ("max_new_tokens", 4.0, "meta_info['max_new_tokens'] must be a int, got float 4.0"),
    ("top_k", True, "meta_info['top_k'] must be a int, got bool True"),
    ("temperature", "0.5", "meta_info['temperature'] must be a float, got str '0.5'"),
])
def test_per_call_overrides_are_typed_never_truthy_strings(key, value, expected):
    """meta_info is a hand-filled dict: do_sample="no" used to sample (a truthy string)."""
    with pytest.raises(TypeError) as err:
        SamplingSettings.resolve(rollout(), {key: value})
    assert str(err.value) == expected


def test_per_call_overrides_accept_numbers_of_any_kind():
    s = SamplingSettings.resolve(rollout(), {"do_sample": 0, "n": np.int64(3), "temperature": 1, "top_p": np.float32(0.5)})
    assert (s.do_sample, s.n, s.temperature, s.top_p) == (False, 3, 1.0, 0.5)
    assert type(s.n) is int and type(s.temperature) is float
