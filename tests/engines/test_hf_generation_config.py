"""The HF engine's per-call GenerationConfig is one transformers accepts as it is: a greedy call names no
sampling flag (transformers warns "generation flags are not valid ... ['top_k']" at every start-up
otherwise), a sampling call leaves every warper to rlcore's own (top_k 0, not HF's default 50)."""

import pytest
from transformers import GenerationConfig

from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import generation_config


def test_a_greedy_config_sets_no_sampling_flag_and_validates_strictly():
    greedy = SamplingSettings.resolve(RolloutConfig(do_sample=False, top_k=5, max_new_tokens=7), {})
    config = generation_config(greedy, [2], 0)
    config.validate(strict=True)  # raises on any flag that greedy decoding would ignore
    assert (config.do_sample, config.max_new_tokens, config.eos_token_id, config.pad_token_id) == (False, 7, [2], 0)
    with pytest.raises(ValueError, match="top_k"):  # what the engine passed before: the warning's cause
        GenerationConfig(do_sample=False, temperature=1.0, top_k=0, top_p=1.0).validate(strict=True)


def test_a_sampling_config_leaves_the_warpers_to_rlcore():
    sampled = SamplingSettings.resolve(RolloutConfig(do_sample=True, temperature=0.7, top_k=5, max_new_tokens=7), {})
    config = generation_config(sampled, [], 0)
    config.validate(strict=True)
    assert (config.do_sample, config.temperature, config.top_k, config.top_p) == (True, 1.0, 0, 1.0)
    assert config.eos_token_id is None
