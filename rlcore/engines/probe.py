"""The engine side of the consistency check's end-to-end probe: the log-probs of a fixed token
sequence, computed by the engine as it samples (``rlcore.trainer.probe_check`` judges them
against the trainer's).

Why: the weight read-back (``rlcore.engines.vllm_checksums``) cannot see every tensor (vLLM's packed
CPU matmul kernels, MoE experts, tensor-parallel shards). Scoring a sequence runs every layer, so a
weight that differs anywhere on the path shows up in the log-probs, whatever form the engine keeps
it in. Each engine answers ``{"log_probs": [log p(ids[i] | ids[:i]) for i >= 1], "dtype": name}``.

- HF engines: one forward of the engine's own model.
- vLLM (offline and ``AsyncLLM``): one request with ``prompt_logprobs=0`` and a single greedy token:
  the prompt's log-probs come from the engine's own kernels (vLLM computes them from the raw
  logits, before any sampling processor, which is what the trainer scores with temperature 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

ProbeReply = dict[str, Any]  # {"log_probs": list[float] (len(ids) - 1), "dtype": str}


@torch.no_grad()
def hf_probe_log_probs(model: torch.nn.Module, ids: Sequence[int], device: torch.device | str) -> ProbeReply:
    """``ids`` scored by a HF causal LM, one forward."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0]
    return {"log_probs": picked.cpu().tolist(), "dtype": str(model.dtype).removeprefix("torch.")}


def vllm_probe_params():
    """One greedy token, and the prompt's own log-probs (``prompt_logprobs=0``: the prompt token's only)."""
    from vllm import SamplingParams  # optional dependency

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)


def vllm_probe_reply(output: Any, ids: Sequence[int], dtype: str) -> ProbeReply:
    """A vLLM ``RequestOutput`` of ``vllm_probe_params`` as a probe reply (its first entry is None:
    the first token has no context)."""
    steps = output.prompt_logprobs
    if steps is None or len(steps) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if steps is None else len(steps)} prompt log-probs for a probe of "
                           f"{len(ids)} tokens")
    return {"log_probs": [float(step[tok].logprob) for step, tok in zip(steps[1:], ids[1:])], "dtype": dtype}
