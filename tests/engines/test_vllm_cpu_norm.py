"""vLLM's fused CPU RMSNorm kernels (rlcore.engines.vllm_cpu_norm): the same numbers as vLLM's native
math, refused where they cannot run, and first in an engine's priority on CPU only."""

import pytest
import torch

pytest.importorskip("vllm")

from rlcore.engines import vllm_cpu_norm  # noqa: E402


@pytest.fixture(scope="module")
def ir():
    if not vllm_cpu_norm.register():
        pytest.skip("this vLLM build has no CPU RMSNorm kernels")
    from vllm import ir

    return ir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_match_the_native_math(ir, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    ours, native = ir.ops.rms_norm.impls[vllm_cpu_norm.PROVIDER], ir.ops.rms_norm.impls["native"]
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(ours.impl_fn(x, weight, 1e-5), native.impl_fn(x, weight, 1e-5), **tol)
    out, summed = ir.ops.fused_add_rms_norm.impls[vllm_cpu_norm.PROVIDER].impl_fn(x.clone(), residual.clone(), weight, 1e-5)
    ref_out, ref_sum = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, ref_sum, **tol)
    torch.testing.assert_close(out, ref_out, **tol)


def test_what_the_kernels_cannot_take_goes_native(ir):
    x, weight = torch.randn(4, 64), torch.ones(64)
    fits = ir.ops.rms_norm.impls[vllm_cpu_norm.PROVIDER].supports_args
    assert fits(x, weight, 1e-5)
    assert not fits(x[:, :32], weight[:32], 1e-5)  # a strided view (e.g. q/k norms of a fused projection)
    assert not fits(x, None, 1e-5)  # a weightless norm
    assert not fits(x, weight.double(), 1e-5)  # a weight of another dtype
    assert not fits(x, weight, 1e-5, 32)  # a variance size override


def test_an_engine_on_cpu_asks_for_them_first():
    assert vllm_cpu_norm.cpu_kernel_config("cpu") == {"kernel_config": {"ir_op_priority": {
        "rms_norm": [vllm_cpu_norm.PROVIDER], "fused_add_rms_norm": [vllm_cpu_norm.PROVIDER]}}}
    assert vllm_cpu_norm.cpu_kernel_config("cuda") == {}
