"""The trajectory layout every rollout hands the trainer, built and reshaped in one place.

Rows are ``prompts`` (left-padded, width T_p) followed by ``responses`` (right-padded, width T_r);
``input_ids``/``attention_mask``/``position_ids`` cover both (T_p + T_r), ``response_mask`` and
``rollout_log_probs`` the responses. Both engines, the multi-turn runner and the replay buffer
produce or reshape exactly this layout (documented key by key in ``rlcore.protocol``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcore.engines.base import Generation
from rlcore.models.moe import mask_routing
from rlcore.protocol import DataProto

# meta_info key of a batch whose token_versions count from the generating call's weights (0 = those
# weights: turn-lockstep multi-turn rollouts), not the run's policy versions (rlcore.agentic.multi_turn)
PER_CALL_VERSIONS = "token_versions_per_call"


def check_left_padded(attention_mask: torch.Tensor) -> None:
    """Both backends read a prompt as the tokens under its mask, ending at the last column."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be (B, T_p), got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[1] == 0 or not bool(attention_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded with at least one token each: attention_mask[:, -1] must be all 1")
    ones_after_first = attention_mask.cumsum(dim=1) > 0
    if not bool((attention_mask.bool() == ones_after_first).all()):
        raise ValueError("prompts must be left-padded: attention_mask has a 0 between two 1s")


def build_output(prompts: DataProto, gen: Generation, pad_token_id: int, gen_time_s: float) -> DataProto:
    """The trainer-facing DataProto (layout documented in ``rlcore.protocol``) from one ``Generation``."""
    prompt_ids = prompts.batch["input_ids"]
    prompt_mask = prompts.batch["attention_mask"]
    prompt_pos = prompts.batch["position_ids"]
    bsz, t_r = gen.responses.shape
    if bsz != len(prompts):
        raise RuntimeError(f"backend returned {bsz} responses for {len(prompts)} prompts")

    steps = torch.arange(t_r).unsqueeze(0)
    response_mask = (steps < gen.lengths.unsqueeze(1)).to(prompt_mask.dtype)
    responses = torch.where(response_mask.bool(), gen.responses.to(prompt_ids.dtype), pad_token_id)
    log_probs = torch.where(response_mask.bool(), gen.log_probs.float(), 0.0)
    # Positions continue from the prompt's last position, padding included (it is masked anyway).
    response_pos = prompt_pos[:, -1:] + 1 + steps.to(prompt_pos.dtype)

    out = DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
            "rollout_log_probs": log_probs,
        },
        non_tensors=dict(prompts.non_tensor_batch),
        meta_info=dict(prompts.meta_info),
    )
    if gen.routed_experts is not None:  # MoE router replay: the experts of every valid position
        out.batch["routed_experts"] = mask_routing(gen.routed_experts, out.batch["attention_mask"])
    n_tokens = int(response_mask.sum())
    out.meta_info.update({
        "rollout/gen_time_s": gen_time_s,
        "rollout/tokens_per_s": n_tokens / gen_time_s if gen_time_s > 0 else float("nan"),
        "rollout/num_generated_tokens": n_tokens,
    })
    return out


_FULL_KEYS = ("input_ids", "attention_mask", "position_ids")  # prompt ++ response
_TOKEN_KEYS = ("prompts", "responses", "input_ids")  # padded with the pad token, the rest with 0


def widths(data: DataProto) -> tuple[int, int]:
    t_r = data.batch["responses"].shape[1]
    return data.batch["input_ids"].shape[1] - t_r, t_r


def pad_rollout(data: DataProto, t_p: int, t_r: int, pad_token_id: int) -> DataProto:
    """``data`` with prompt width ``t_p`` and response width ``t_r`` (smaller values crop padding)."""
    p0, r0 = widths(data)
    dp, dr = t_p - p0, t_r - r0
    if dp == dr == 0:
        return data
    tensors = {}
    for key, value in data.batch.items():
        fill = pad_token_id if key in _TOKEN_KEYS else 0
        if value.ndim == 1:
            tensors[key] = value
        elif value.ndim != 2:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; the buffer pads only (B,) or (B, T)")
        elif key == "prompts":
            tensors[key] = F.pad(value, (dp, 0), value=fill)
        elif key in _FULL_KEYS:
            tensors[key] = F.pad(value, (dp, dr), value=fill)
        elif value.shape[1] == r0:
            tensors[key] = F.pad(value, (0, dr), value=fill)
        else:
            raise ValueError(f"batch[{key!r}] has width {value.shape[1]}: neither the response width {r0} "
                             f"nor a prompt/full-sequence key {('prompts', *_FULL_KEYS)}")
    return DataProto.from_dict(tensors, data.non_tensor_batch, data.meta_info)


def trim_padding(data: DataProto, pad_token_id: int) -> DataProto:
    """Drop prompt columns that are padding in every row, and response columns likewise."""
    t_p, _ = widths(data)
    mask = data.batch["attention_mask"].bool()
    prompt_used = mask[:, :t_p].any(0).nonzero()
    response_used = mask[:, t_p:].any(0).nonzero()
    new_p = t_p - int(prompt_used[0]) if len(prompt_used) else 0
    new_r = int(response_used[-1]) + 1 if len(response_used) else 1
    return pad_rollout(data, new_p, new_r, pad_token_id)


def crop_padding(data: DataProto) -> tuple[DataProto, int, int]:
    """``(cropped, left, right)``: ``data`` without the leading columns that are padding in every row
    and the trailing ones likewise, and how many of each were dropped.

    Why: a batch is padded to its longest prompt and longest response, so a micro-batch of short rows
    would otherwise cost as much as one of long rows. Dropping columns whose ``attention_mask`` is 0
    in every row changes nothing the model computes at a valid position: position ids are absolute
    per row, and a masked key adds nothing to any query's attention.

    The position axis is the last axis of ``input_ids``: dim 1 of the rollout layout (B, T), dim 2 of
    pair rows (B, 2, T). On that axis a tensor as wide as ``input_ids`` (``attention_mask``,
    ``position_ids``, ``routed_experts`` (B, T, L, k), pair rows' ``response_mask``) loses ``left``
    columns in front and ``right`` behind; one as wide as ``responses`` (``response_mask``,
    ``old_log_probs``, ``advantages``, ...) loses ``right`` behind, so it stays aligned with the tail
    of ``input_ids``. Anything else (per-row values) is kept whole. At least one prompt column and
    one response column stay, so the logit that predicts the first response token still exists.
    Slices are made contiguous: the forward reads them many times.
    """
    b = data.batch
    ids = b["input_ids"]
    axis, width = ids.ndim - 1, ids.shape[-1]
    response_width = b["responses"].shape[-1] if "responses" in b.keys() else 0
    used = b["attention_mask"].bool().flatten(0, -2).any(0).nonzero().squeeze(-1)
    if len(used) == 0:  # only padding rows: nothing to gain, nothing to anchor on
        return data, 0, 0
    left = min(int(used[0]), width - response_width - 1)
    right = width - 1 - int(used[-1])
    if response_width:
        right = min(right, response_width - 1)
    if left == right == 0:
        return data, 0, 0
    tensors = {}
    for key, value in b.items():
        size = value.shape[axis] if value.ndim > axis else None
        if size == width:
            value = value.narrow(axis, left, width - left - right).contiguous()
        elif response_width and size == response_width:
            value = value.narrow(axis, 0, response_width - right).contiguous()
        tensors[key] = value
    return DataProto.from_dict(tensors, data.non_tensor_batch, data.meta_info), left, right


def pad_back(outputs: dict[str, torch.Tensor], width: int, right: int) -> dict[str, torch.Tensor]:
    """A cropped micro-batch's outputs in the uncropped shapes: those per response token (dim 1 is
    ``width``, the cropped response width) get ``right`` zero columns behind, where the dropped
    padding was (no caller reads there); per-row ones, (B,), stay as they are."""
    if right == 0:
        return outputs
    return {k: torch.cat([v, v.new_zeros((v.shape[0], right, *v.shape[2:]))], 1)
            if v.ndim >= 2 and v.shape[1] == width else v for k, v in outputs.items()}
