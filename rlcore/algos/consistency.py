"""Does the trainer score what the sampler sampled? Pure tensor math for the consistency check.

Two measures, both cheap:

- ``mismatch_sums``: statistics of the per-token log-ratio ``d = trainer - sampler`` of the sampled
  tokens (the trainer's log-probs are the ones the update computes anyway; the sampler's came with
  the rollout). They are *sums* (token counts, sums of |d|, of d, out-of-band counts) and one max,
  so micro-batches and ranks combine exactly (``merge_mismatch_sums``; ranks: sum, max) before
  ``mismatch_metrics`` turns them into means. Broken down by policy-version lag (where tokens carry
  versions) and by turn (first policy segment of a row vs later ones), because the cause of a
  mismatch shows in *where* it is: stale tokens differ by the policy's own change, later turns alone
  by a context the trainer re-rendered.
- ``tensor_fingerprint``: per tensor a 64-bit hash of its exact bytes as the engine holds them
  (the trainer's cast to the engine's dtype first: the bytes a sync sends), keyed by position. Both
  sides call this one function, so a tensor compares equal only when every bit is; a stale,
  skipped or corrupted tensor shows, by name, in ``compare_fingerprints``, however small the
  update that made it stale (float sums of values, used before, missed an fp32 step at lr 1e-6).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from rlcore.algos.stats import check_same_shape

Tensor = torch.Tensor

MAX_LAG = 4  # version lags 0..3 each, and 4 or more together ("lag_4")
SUM_KEYS = ("tokens", "abs_sum", "signed_sum", "out_of_band", "first_tokens", "first_abs_sum", "later_tokens",
            "later_abs_sum")
Fingerprint = tuple[str, int, int]  # (dtype name, elements, 64-bit hash of the bytes): tensor_fingerprint


@torch.no_grad()
def turn_index(response_mask: Tensor) -> Tensor:
    """(B, T) the turn of each response position: 0 in a row's first run of policy tokens (mask 1),
    1 in the second run and so on (env tokens between runs are mask 0). Positions before the first
    policy token are -1."""
    valid = response_mask.bool()
    prev = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    starts = valid & ~prev
    return starts.long().cumsum(-1) - 1


@torch.no_grad()
def mismatch_sums(trainer_log_probs: Tensor, sampler_log_probs: Tensor, response_mask: Tensor,
                  band: tuple[float, float] = (0.9, 1.1), lags: Tensor | None = None) -> dict[str, Tensor]:
    """Additive statistics of ``d = trainer - sampler`` over the valid tokens (``response_mask``).

    ``band``: a token is out of band when its ratio ``exp(d)`` is outside ``[band[0], band[1]]``.
    ``lags`` (B, T): the policy-version lag of each token (trainer's version - the token's); with it,
    ``lag_<k>/{tokens,abs_sum,out_of_band}`` per lag k in 0..MAX_LAG (MAX_LAG: that many or more),
    and the version-independent totals still cover every token. Keys: see ``SUM_KEYS`` and
    ``abs_max``; every value a float64 scalar tensor.
    """
    check_same_shape("trainer_log_probs", trainer_log_probs, "sampler_log_probs", sampler_log_probs)
    check_same_shape("trainer_log_probs", trainer_log_probs, "response_mask", response_mask)
    lo, hi = band
    if not 0 < lo < 1 < hi:
        raise ValueError(f"the ratio band must satisfy 0 < low < 1 < high, got {band}")
    valid = response_mask.bool()
    d = (trainer_log_probs.double() - sampler_log_probs.double()).where(valid, 0.0)
    out = (d < math.log(lo)) | (d > math.log(hi))
    turn = turn_index(response_mask)
    first, later = valid & (turn == 0), valid & (turn > 0)

    def total(x: Tensor) -> Tensor:
        return x.double().sum()

    sums = {
        "tokens": total(valid), "abs_sum": total(d.abs()), "signed_sum": total(d), "out_of_band": total(out & valid),
        "first_tokens": total(first), "first_abs_sum": total(d.abs() * first),
        "later_tokens": total(later), "later_abs_sum": total(d.abs() * later),
        "abs_max": d.abs().max().double() if d.numel() else torch.zeros((), dtype=torch.float64),
    }
    if lags is not None:
        check_same_shape("lags", lags, "response_mask", response_mask)
        bucket = lags.clamp(0, MAX_LAG)
        for k in range(MAX_LAG + 1):
            at = valid & (bucket == k)
            sums[f"lag_{k}/tokens"] = total(at)
            sums[f"lag_{k}/abs_sum"] = total(d.abs() * at)
            sums[f"lag_{k}/out_of_band"] = total(out & at)
    return sums


def merge_mismatch_sums(parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Several ``mismatch_sums`` (micro-batches) as one: every entry summed, ``abs_max`` maxed."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key not in merged:
                merged[key] = value.clone()
            elif key == "abs_max":
                merged[key] = torch.maximum(merged[key], value)
            else:
                merged[key] = merged[key] + value
    return merged


def mismatch_metrics(sums: Mapping[str, Tensor], prefix: str = "check/") -> dict[str, float]:
    """Means of ``mismatch_sums`` (merged over micro-batches and ranks) as metrics:
    ``logprob_abs_diff_mean``, ``logprob_abs_diff_max``, ``logprob_diff_mean`` (signed: trainer -
    sampler), ``ratio_out_of_band`` (share of tokens), ``tokens``; ``logprob_abs_diff_mean/turn_first``
    and ``/turn_later`` when rows have several turns; per lag ``.../lag_<k>`` (with ``tokens/lag_<k>``)
    for the lags that have tokens. Nothing when there are no valid tokens."""
    n = float(sums["tokens"])
    if n == 0:
        return {}
    out = {
        "logprob_abs_diff_mean": float(sums["abs_sum"]) / n,
        "logprob_abs_diff_max": float(sums["abs_max"]),
        "logprob_diff_mean": float(sums["signed_sum"]) / n,
        "ratio_out_of_band": float(sums["out_of_band"]) / n,
        "tokens": n,
    }
    if float(sums["later_tokens"]) > 0:
        out["logprob_abs_diff_mean/turn_first"] = float(sums["first_abs_sum"]) / max(float(sums["first_tokens"]), 1.0)
        out["logprob_abs_diff_mean/turn_later"] = float(sums["later_abs_sum"]) / float(sums["later_tokens"])
    for k in range(MAX_LAG + 1):
        count = float(sums.get(f"lag_{k}/tokens", 0.0))
        if count:
            out[f"tokens/lag_{k}"] = count
            out[f"logprob_abs_diff_mean/lag_{k}"] = float(sums[f"lag_{k}/abs_sum"]) / count
            out[f"ratio_out_of_band/lag_{k}"] = float(sums[f"lag_{k}/out_of_band"]) / count
    return {prefix + k: v for k, v in out.items()}


# ------------------------------------------------------------------ weights
_WORDS = 1 << 18  # 64-bit words hashed per chunk: 2 MiB, so a chunk's temporaries stay in cache
_LOW32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_keys: dict[torch.device, Tensor] = {}


def splitmix64(x: int) -> int:
    """The SplitMix64 output for state ``x`` (Steele et al.), on Python ints: the keys' generator."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def _word_keys(device: torch.device) -> Tensor:
    """The odd 64-bit key of each word position in a chunk: ``splitmix64(j) | 1``, computed in torch
    with wrapping int64 arithmetic (logical shifts masked), once per device."""
    if device not in _keys:
        z = torch.arange(_WORDS, dtype=torch.int64, device=device) + _signed(0x9E3779B97F4A7C15)
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))) * _signed(mult)
        _keys[device] = (z ^ ((z >> 31) & ((1 << 33) - 1))) | 1
    return _keys[device]


def _words(chunk: Tensor) -> Tensor:
    """A contiguous 1-D tensor's bytes as little-endian int64 words, zero-padded to a whole word."""
    raw = chunk.view(torch.uint8)
    if raw.numel() % 8 or raw.storage_offset() % 8:
        padded = torch.zeros(-(-raw.numel() // 8) * 8, dtype=torch.uint8, device=raw.device)
        padded[: raw.numel()] = raw
        raw = padded
    return raw.view(torch.int64)


@torch.no_grad()
def tensor_fingerprint(tensor: Tensor, dtype: torch.dtype | None = None) -> Fingerprint:
    """``(dtype name, elements, hash)`` of the exact bytes of ``tensor`` cast to ``dtype`` (the
    engine's; the cast is the one a sync does, so the bytes are those the engine was sent).

    The bytes are read as 64-bit words ``w``; word ``j`` of chunk ``c`` adds
    ``M_c * mix(w, K_j)`` to the hash, mod 2^64, where ``mix(w, K) = ((z ^ (z >>> 32)) * K)`` for
    ``z = w * K``, ``K_j = splitmix64(j) | 1`` and ``M_c = splitmix64(2^63 + c) | 1``. Every step of
    ``mix`` is a bijection of ``w`` (odd multipliers, a xor-shift), so a change confined to one word
    (any single bit, any single element) always changes the hash; several changed words cancel only
    by chance, about one in 2^33 at worst (two top bits flipped), 2^-64 typically. The xor-shift is
    what makes high bits count: without it flipping bit 63 of any two words would cancel exactly.
    Vectorised over chunks of 2^18 words (each chunk cast on its own: no copy of a whole tensor);
    the chunks' sums come back in one transfer, so it runs as well on an accelerator.
    """
    flat = tensor.detach().reshape(-1)
    dtype = dtype or flat.dtype
    per = _WORDS * 8 // dtype.itemsize  # elements per chunk: a whole number of words
    keys = _word_keys(flat.device) if flat.numel() else None
    sums = []
    for start in range(0, flat.numel(), per):
        part = flat[start: start + per]
        w = _words(part.to(dtype) if part.dtype != dtype else part)
        k = keys[: w.numel()]
        z = w * k
        z ^= (z >> 32).bitwise_and_(_LOW32)
        z *= k
        sums.append(z.sum())
    total = 0
    for c, s in enumerate(torch.stack(sums).tolist() if sums else []):
        total += (s & _MASK64) * (splitmix64((1 << 63) + c) | 1)
    return str(dtype).removeprefix("torch."), flat.numel(), total & _MASK64


def weight_fingerprints(named: Iterable[tuple[str, Tensor]], dtypes: Mapping[str, str] | None = None
                        ) -> dict[str, Fingerprint]:
    """``tensor_fingerprint`` of each named tensor, cast to ``dtypes[name]`` (a torch dtype's name) when given."""
    return {name: tensor_fingerprint(t, None if dtypes is None or name not in dtypes else getattr(torch, dtypes[name]))
            for name, t in named}


def compare_fingerprints(trainer: Mapping[str, Fingerprint], engine: Mapping[str, Fingerprint]) -> dict[str, list[str]]:
    """Names, sorted, of the tensors that ``differ`` (in any byte, or in dtype or size), that the
    engine lacks (``missing``) or that only the engine has (``unexpected``)."""
    return {
        "differ": sorted(n for n in trainer.keys() & engine.keys() if tuple(trainer[n]) != tuple(engine[n])),
        "missing": sorted(trainer.keys() - engine.keys()),
        "unexpected": sorted(engine.keys() - trainer.keys()),
    }
