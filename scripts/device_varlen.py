"""The shared-prompt varlen attention probe of the throughput benchmark (scripts/device_throughput.py).

Why: the throughput part reports which attention kernel its packs ran (``shared_varlen.KERNEL_CALLS``);
this says whether that kernel computes what the rows path computes, on the device itself, at the
benchmark's head shape. A GRPO-like pack (8 prompts of 32-96 tokens, 4 responses each of 16-128, each
prompt held once) with random queries, keys and values: the output and the gradients of q, k, v from
(a) the varlen call (``shared_varlen_attention``: torch's ``varlen_attn`` on CUDA where the dispatch
picks it; on CPU, or where it does not, ``reference_varlen_attn`` stands in, and ``kernel`` says so),
(b) today's rows of SDPA (``packing._rows``), both in the part's dtype, each against (c) the
reference in fp32. ``ok``: the varlen error within twice the rows path's plus 1e-3. On CUDA also the
milliseconds of forward + backward of (a) and (b).
"""

from __future__ import annotations

import time

import torch

from rlcore.workers import packing, shared_varlen


def probe_pack(seed: int = 0, groups: int = 8, n: int = 4, vocab: int = 1000) -> packing.Packed:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(32, 97, (groups,), generator=g).repeat_interleave(n)
    response_lens = torch.randint(16, 129, (groups * n,), generator=g)
    width, r_width = int(prompt_lens.max()), int(response_lens.max())
    p_mask = torch.arange(width).flip(0)[None] < prompt_lens[:, None]
    r_mask = torch.arange(r_width)[None] < response_lens[:, None]
    prompts = torch.randint(4, vocab, (groups, width), generator=g).repeat_interleave(n, 0)
    ids = torch.cat([prompts * p_mask, torch.randint(4, vocab, (groups * n, r_width), generator=g) * r_mask], 1)
    mask = torch.cat([p_mask, r_mask], 1).long()
    return packing.pack(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), prompt_width=width)


def probe_shared_varlen(device: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """The varlen call against the rows path on ``device`` at this head shape (see the module's doc)."""
    packed = probe_pack()
    kernel, why = shared_varlen.planned_kernel(dtype, packing.VARLEN_REFUSED)
    on_device = device == "cuda" and kernel == shared_varlen.SHARED_VARLEN
    varlen_kernel = None if on_device else shared_varlen.reference_varlen_attn
    g = torch.Generator(device=device).manual_seed(0)
    n = packed.num_tokens
    shapes = [(1, heads, n, head_dim), (1, kv_heads, n, head_dim), (1, kv_heads, n, head_dim)]
    base = [torch.randn(s, generator=g, device=device) for s in shapes]
    weight = torch.randn(1, n, heads, head_dim, generator=g, device=device)
    layout = packing.RowLayout(packed.layout.source.to(device), packed.layout.take.to(device),
                               packed.layout.rows, packed.layout.max_len)
    attend = shared_varlen.shared_varlen_attention
    inner = packing._sdpa if device == "cuda" else packing._sdpa_fp32

    runs = {
        "varlen": (lambda q, k, v: attend(q, k, v, layout.varlen, None, kernel=varlen_kernel), dtype),
        "rows": (lambda q, k, v: packing._rows(q, k, v, layout, None, 0.0, inner), dtype),
        "reference_fp32": (lambda q, k, v: attend(q, k, v, layout.varlen, None, kernel=shared_varlen.reference_varlen_attn),
                           torch.float32),
    }
    results, ms = {}, {}
    for name, (fn, run_dtype) in runs.items():
        try:
            inputs = [t.to(run_dtype).requires_grad_() for t in base]
            out = fn(*inputs)
            grads = torch.autograd.grad((out.float() * weight).sum(), inputs)
            results[name] = [out.detach().float(), *(x.float() for x in grads)]
            if device == "cuda" and name != "reference_fp32":
                ms[name] = _time_ms(lambda: torch.autograd.grad((fn(*inputs).float() * weight).sum(), inputs))
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            return {"kernel": kernel, "why": why, "ok": False, "error": f"{name}: {type(exc).__name__}: {exc}"[:500]}
    truth = results["reference_fp32"]
    err = {name: [round(float((a - b).abs().max()), 6) for a, b in zip(results[name], truth)] for name in ("varlen", "rows")}
    out = {"kernel": kernel if on_device else f"{shared_varlen.reference_varlen_attn.__name__} (stand-in: {why})",
           "dtype": str(dtype).removeprefix("torch."), "pack_tokens": n, "keys_gathered": int(layout.varlen.cu_k[-1]),
           "max_abs_err_out_dq_dk_dv": err,
           "ok": all(e <= 2 * r + 1e-3 for e, r in zip(err["varlen"], err["rows"]))}
    if ms:
        out["fwd_bwd_ms"] = ms
    return out


def _time_ms(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / iters * 1e3, 3)
