"""Shared-prompt packs as one varlen call (rlcore.workers.shared_varlen), checked on CPU: the index by
hand; the index through ``reference_varlen_attn`` (``varlen_attn``'s contract in plain math) against
today's rows path and against causal SDPA on each whole row, forward and gradients, on random packs;
the kernel choice with CUDA availability monkeypatched; and a tiny model whose shared-prompt packs go
through the varlen dispatch (the reference standing in for the CUDA kernel) with the rows path's logits."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rlcore.workers import packing, shared_varlen
from rlcore.workers.packing import ROWS_KEYWORD, pack, packed_attention
from rlcore.workers.shared_varlen import (ROWS_EAGER, ROWS_SDPA, SHARED_VARLEN, SPLIT_ROWS, choose_kernel, planned_kernel,
                                          reference_varlen_attn, shared_varlen_attention, stored_tails, varlen_index)
from row_layouts import shared_layout


class _Attn(torch.nn.Module):
    sliding_window = None
    training = False


def grouped_pack(seed: int, groups: int = 3, vocab: int = 64):
    """A rollout-layout pack of several prompt groups with different prompt and response lengths
    (1-3 rows a group, responses 0-7 tokens: an empty one included), rows of a group interleaved with
    the others', each prompt held once. Returns (packed, input_ids, attention_mask, position_ids)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, 9, (groups,), generator=g)
    sizes = torch.randint(1, 4, (groups,), generator=g)
    group_of = torch.repeat_interleave(torch.arange(groups), sizes)
    group_of = group_of[torch.randperm(len(group_of), generator=g)]
    rows, width, r_width = len(group_of), int(prompt_lens.max()), 7
    response_lens = torch.randint(0, r_width + 1, (rows,), generator=g)
    response_lens[0] = 0 if rows > 1 else 1  # an empty response (its row stores nothing when it borrows)
    prompts = torch.randint(4, vocab, (groups, width), generator=g)
    p_mask = torch.arange(width).flip(0)[None] < prompt_lens[group_of][:, None]
    r_mask = torch.arange(r_width)[None] < response_lens[:, None]
    ids = torch.cat([prompts[group_of] * p_mask, torch.randint(4, vocab, (rows, r_width), generator=g) * r_mask], 1)
    mask = torch.cat([p_mask, r_mask], 1).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return pack(ids, mask, positions, prompt_width=width), ids, mask, positions


def test_the_varlen_index_by_hand():
    """A prompt of 3 tokens (pack 0-2) held by a row with a response of 2 (3, 4), borrowed by a row
    with a response of 4 (5-8), then a row of 2 alone (9, 10): queries are the pack's tokens cut per
    row as stored, keys each row's whole sequence, the borrowed prompt read from its one copy."""
    layout, _ = shared_layout()  # row_layouts.py: that layout written out by hand
    index = varlen_index(layout.source, layout.take, rows=layout.rows, max_len=layout.max_len)
    assert index.kv_source.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert index.cu_q.tolist() == [0, 5, 9, 11] and index.cu_k.tolist() == [0, 5, 12, 14]
    assert (index.max_q, index.max_k) == (5, 7) and index.cu_q.dtype == torch.int32
    bad = layout.take.clone()
    bad[5] = 7 + 2  # row 1's first stored token placed over its prompt: not the tail of its sequence
    with pytest.raises(ValueError, match="not the tail"):
        varlen_index(layout.source, bad, rows=3, max_len=7)
    assert stored_tails(layout.source, layout.take, 3, 7) and not stored_tails(layout.source, bad, 3, 7)
    swapped = layout.take.clone()
    swapped[[3, 4]] = swapped[[4, 3]]  # row 0's two response tokens stored in the wrong order
    assert not stored_tails(layout.source, swapped, 3, 7)
    assert stored_tails(layout.source[:0], layout.take[:0], 0, 7)  # an empty pack


def whole_rows(q, k, v, packed):
    """Causal SDPA over each row's whole sequence (prompt + response), the row's own stored tokens'
    outputs put back in pack order: what the pack must equal."""
    out = torch.zeros(1, q.shape[2], q.shape[1], q.shape[3])
    owner = packed.index // packed.shape[1]  # the row that stores each pack token
    for b in range(packed.shape[0]):
        ix = packed.slot[b][packed.slot[b] >= 0]  # the row's whole sequence, a borrowed prompt included
        if not len(ix):
            continue
        row = F.scaled_dot_product_attention(q[:, :, ix], k[:, :, ix], v[:, :, ix], is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)[0]
        mine = owner[ix] == b
        out[0, ix[mine]] = row[mine]
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_varlen_over_a_shared_pack_equals_the_rows_path_and_whole_rows(seed, kv_heads):
    packed, *_ = grouped_pack(seed)
    assert packed.shared
    n = packed.num_tokens
    g = torch.Generator().manual_seed(100 + seed)
    q = torch.randn(1, 4, n, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, 8, generator=g, requires_grad=True) for _ in range(2))
    weight = torch.randn(1, n, 4, 8, generator=g)
    index = packed.layout.varlen
    assert index.cu_q[-1] == n and index.cu_k[-1] == len(index.kv_source) > n  # prompts read more than once
    runs = {
        "varlen": shared_varlen_attention(q, k, v, index, None, kernel=reference_varlen_attn),
        "rows": packed_attention(_Attn(), q, k, v, None, **{ROWS_KEYWORD: packed.layout})[0],
        "whole rows": whole_rows(q, k, v, packed),
    }
    grads = {name: torch.autograd.grad((out * weight).sum(), (q, k, v)) for name, out in runs.items()}
    for name in ("rows", "whole rows"):
        torch.testing.assert_close(runs["varlen"], runs[name], rtol=1e-5, atol=1e-6, msg=name)
        for got, want, what in zip(grads["varlen"], grads[name], "qkv"):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"d{what} vs {name}")
    # the planted fault: causality aligned top-left (query i sees keys 0..i) loses a borrowing row's prompt
    top_left = shared_varlen_attention(q, k, v, index, None, kernel=_top_left)
    assert not torch.allclose(top_left, runs["varlen"], atol=1e-3)


def _top_left(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    outs = []
    for i in range(len(cu_q) - 1):
        q, k, v = (t[int(c[i]):int(c[i + 1])].transpose(0, 1) for t, c in ((query, cu_q), (key, cu_k), (value, cu_k)))
        k, v = k[:, :q.shape[1]], v[:, :q.shape[1]]
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outs)


def test_the_kernel_choice_and_the_reason_when_not_varlen(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shared_varlen, "VARLEN_ATTN", reference_varlen_attn)  # a torch that has it
    assert planned_kernel(torch.bfloat16) == (SHARED_VARLEN, "CUDA, bf16/fp16, torch.nn.attention.varlen.varlen_attn present")
    assert planned_kernel(torch.float16)[0] == SHARED_VARLEN
    assert planned_kernel(torch.float32) == (ROWS_SDPA, "dtype torch.float32: the flash kernel takes bf16/fp16")
    assert planned_kernel(torch.bfloat16, ["RuntimeError: no kernel image"]) == (
        ROWS_SDPA, "varlen_attn refused earlier in this process: RuntimeError: no kernel image")
    assert choose_kernel("cuda", torch.bfloat16, 0.1, [])[1] == "attention dropout 0.1: varlen_attn takes none"
    assert choose_kernel("cuda", torch.bfloat16, 0.0, [], eager=True) == (ROWS_EAGER, "model.attn_implementation=eager")
    monkeypatch.setattr(shared_varlen, "VARLEN_ATTN", None)  # an older torch
    kernel, why = planned_kernel(torch.bfloat16)
    assert kernel == ROWS_SDPA and why.endswith("has no torch.nn.attention.varlen.varlen_attn")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(shared_varlen, "VARLEN_ATTN", reference_varlen_attn)
    assert planned_kernel(torch.bfloat16) == (
        SPLIT_ROWS, "device cpu: varlen_attn is CUDA-only; two flash calls, each prompt's queries once")
    assert choose_kernel("cpu", torch.float32, 0.1, []) == (ROWS_SDPA, "device cpu: varlen_attn is CUDA-only")
    assert choose_kernel("cpu", torch.float32, 0.0, [], cpu_flash=False) == (
        ROWS_SDPA, "device cpu: SDPA's flash kernel does not take these heads, so no split rows either")


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """The dispatch told it is on CUDA with a varlen kernel: the reference, recording its calls."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append((args[3].tolist(), args[4].tolist()))
        return reference_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(shared_varlen, "VARLEN_ATTN", kernel)
    monkeypatch.setattr(packing, "VARLEN_REFUSED", [])
    return calls


def test_a_model_over_a_shared_pack_through_the_varlen_dispatch_equals_the_rows_path(tiny_model_dir, monkeypatch,
                                                                                     varlen_on_cpu):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=packing.PACKED_ATTENTION,
                                                 dtype=torch.float32).eval()
    packed, *_ = grouped_pack(3, vocab=int(model.config.vocab_size))
    before = shared_varlen.KERNEL_CALLS[SPLIT_ROWS]
    expected = model(**packed.model_kwargs()).logits  # today's path: the dispatch on CPU picks the split rows
    assert shared_varlen.KERNEL_CALLS[SPLIT_ROWS] - before == model.config.num_hidden_layers and not varlen_on_cpu
    monkeypatch.setattr(shared_varlen, "choose_kernel", lambda *a, **k: (SHARED_VARLEN, "forced"))
    before = shared_varlen.KERNEL_CALLS[SHARED_VARLEN]
    got = model(**packed.model_kwargs()).logits
    assert len(varlen_on_cpu) == model.config.num_hidden_layers  # every layer took the varlen call
    assert shared_varlen.KERNEL_CALLS[SHARED_VARLEN] - before == model.config.num_hidden_layers
    assert varlen_on_cpu[0] == (packed.layout.varlen.cu_q.tolist(), packed.layout.varlen.cu_k.tolist())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_refusing_varlen_kernel_falls_back_to_rows_and_says_why(monkeypatch, varlen_on_cpu):
    def refuse(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(shared_varlen, "VARLEN_ATTN", refuse)
    monkeypatch.setattr(shared_varlen, "choose_kernel", lambda *a, **k: (SHARED_VARLEN, "forced"))
    packed, *_ = grouped_pack(0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, packed.num_tokens, 8, generator=g) for _ in range(3))
    with pytest.warns(UserWarning, match="packed attention runs as rows of SDPA"):
        out, _ = packed_attention(_Attn(), q, k, v, None, **{ROWS_KEYWORD: packed.layout})
    assert packing.VARLEN_REFUSED == ["RuntimeError: FlashAttention only supports Ampere GPUs or newer."]
    torch.testing.assert_close(out, whole_rows(q, k, v, packed), rtol=1e-5, atol=1e-6)
