"""The vLLM sampling dtype when ``rollout.dtype`` is null: bf16 only where the hardware has it
natively (rlcore.engines.dtype_choice), decided from torch's view of the CPU / GPU."""

import platform

import pytest
import torch

from rlcore.engines import dtype_choice


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be an x86 CPU with the given AMX / AVX512-BF16 flags."""
    def set_flags(amx: bool, avx512_bf16: bool, capability: str = "AVX2"):
        monkeypatch.setattr(dtype_choice.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    return set_flags


@pytest.mark.parametrize("amx, avx512_bf16, expected, reason", [
    (False, False, "float32", "CPU capability AVX2 (no AVX512-BF16, no AMX)"),
    (False, True, "bfloat16", "AVX512-BF16"),
    (True, True, "bfloat16", "AMX tiles"),
])
def test_x86_cpu_flags(cpu, amx, avx512_bf16, expected, reason):
    cpu(amx, avx512_bf16)
    assert dtype_choice.default_vllm_dtype("cpu") == expected
    assert dtype_choice.native_bf16("cpu") == (expected == "bfloat16", reason)


def test_cuda_asks_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert dtype_choice.default_vllm_dtype("cuda") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert dtype_choice.default_vllm_dtype("cuda:0") == "bfloat16"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
def test_this_machine_matches_its_flags():
    """On the real CPU the choice follows torch's own capability checks (fp32 on an AVX2-only CPU)."""
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert dtype_choice.default_vllm_dtype() == ("bfloat16" if native else "float32")
