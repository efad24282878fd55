"""Recording which experts an engine routed each token to, for router replay in training
(``rlcore.models.moe``), laid out as ``routed_experts`` (B, T_p + max_new_tokens, L, k) over the
columns of the trajectory layout (left-padded prompt, then the response).

HF engine: ``RoutingRecorder`` hooks see one router call per ``generate`` forward: the prefill over
the whole (B, T_p) prompt, then one (B, 1) call per decoding step; decoding step j (1-based) runs
response token j-1. The last response token of the longest rows is never run (nothing is sampled
after it), so its column stays -1 (a row that stopped sooner has its last token run by the next step);
it influences no log-prob of the response.

vLLM engine: vLLM's own ``enable_return_routed_experts`` needs Triton, which its CPU build lacks,
so we capture in the worker with hooks installed through ``collective_rpc``: a forward pre-hook on
the model records each step's flattened batch layout (request ids in batch order,
``query_start_loc``, absolute positions), and a forward hook on every MoE layer's ``gate`` takes the
top-k of its router logits (what the fused-MoE kernel selects: top-k of the softmax, equal to
top-k of the logits). Continuous batching mixes requests and prefill/decode in one step; the
positions and query offsets map every flattened token to (request, position), and the request id
(vLLM's internal ``<our id>-<suffix>``) maps it to its row. Prompt positions served from the prefix
cache are not recomputed, so they stay -1 (the trainer routes them itself).

The vLLM functions run inside vLLM's worker and must only use what they get as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlcore.models.moe import NO_EXPERT, ROUTED_DTYPE, empty_routing

_STATE = "_rlcore_routing"


def assemble_hf_routing(calls: Sequence[Sequence[torch.Tensor]], bsz: int, prompt_len: int,
                        width: int) -> torch.Tensor:
    """(B, T_p + width, L, k) from a ``RoutingRecorder``'s calls of one ``generate``."""
    if not calls:
        raise RuntimeError("no router calls were recorded during generate")
    layers, top_k = len(calls[0]), calls[0][0].shape[-1]
    out = empty_routing(bsz, prompt_len + width, layers, top_k)
    out[:, :prompt_len] = torch.stack([c.reshape(bsz, prompt_len, top_k) for c in calls[0]], dim=2)
    for step, call in enumerate(calls[1:], start=1):
        col = prompt_len + step - 1
        out[:, col] = torch.stack([c.reshape(bsz, top_k) for c in call], dim=1)
    return out


# ----------------------------------------------------------------------------- inside vLLM's worker
def _gate_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router linear of each MoE layer (Qwen3-MoE ``mlp.gate``, Mixtral ``block_sparse_moe.gate``)."""
    return [m for name, m in model.named_modules() if name.endswith((".mlp.gate", ".block_sparse_moe.gate"))]


def install_capture(worker, top_k: int) -> int:
    """Install the capture hooks once (idempotent); returns the number of MoE layers. Inactive until
    ``start_capture``."""
    runner = worker.model_runner
    model = runner.model
    state = getattr(worker, _STATE, None)
    if state is not None:
        return state["layers"]
    gates = _gate_modules(model)
    state = {"active": False, "steps": [], "layers": len(gates), "top_k": top_k}
    setattr(worker, _STATE, state)

    def before_step(module, args, kwargs):
        if not state["active"]:
            return
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        num_reqs = runner.input_batch.num_reqs
        state["steps"].append({
            "req_ids": list(runner.input_batch.req_ids[:num_reqs]),
            "query_start_loc": runner.query_start_loc.cpu[: num_reqs + 1].clone(),
            "positions": positions.detach().to("cpu", torch.int64).clone(),
            "experts": [],
        })

    def after_gate(module, args, output):
        if not state["active"] or not state["steps"]:
            return
        logits = output[0] if isinstance(output, tuple) else output
        experts = torch.softmax(logits.float(), dim=-1).topk(state["top_k"], dim=-1).indices
        state["steps"][-1]["experts"].append(experts.to("cpu", torch.int16))

    model.register_forward_pre_hook(before_step, with_kwargs=True)
    for gate in gates:
        gate.register_forward_hook(after_gate)
    return len(gates)


def start_capture(worker) -> None:
    state = getattr(worker, _STATE)
    state["steps"] = []
    state["active"] = True


def stop_capture(worker) -> list[dict]:
    state = getattr(worker, _STATE)
    state["active"] = False
    steps, state["steps"] = state["steps"], []
    return steps


# ----------------------------------------------------------------------------- back in the engine
def assemble_vllm_routing(steps: Sequence[dict], row_of_request: dict[str, int], prompt_lens: Sequence[int],
                          prompt_width: int, width: int, layers: int, top_k: int) -> torch.Tensor:
    """(B, T_p + width, L, k) from the captured steps of one ``LLM.generate``.

    ``row_of_request``: our request id (vLLM's ``RequestOutput.request_id``) -> row; vLLM's internal
    ids are ``<that id>-<suffix>``. A token at absolute position p of row r (prompt length P_r) lands
    in column ``prompt_width - P_r + p``; positions past the response width are dropped.
    """
    out = empty_routing(len(prompt_lens), prompt_width + width, layers, top_k)
    for step in steps:
        if len(step["experts"]) != layers:
            raise RuntimeError(f"a vLLM step recorded {len(step['experts'])} MoE layers, expected {layers}")
        experts = torch.stack(step["experts"], dim=1)  # (N, L, k)
        qsl = step["query_start_loc"].tolist()
        for i, req_id in enumerate(step["req_ids"]):
            row = row_of_request.get(req_id.rsplit("-", 1)[0], row_of_request.get(req_id))
            if row is None:
                raise RuntimeError(f"vLLM ran request {req_id!r}, which is not one of this call's")
            lo, hi = qsl[i], qsl[i + 1]
            cols = prompt_width - prompt_lens[row] + step["positions"][lo:hi]
            keep = cols < prompt_width + width
            out[row, cols[keep]] = experts[lo:hi][keep].to(ROUTED_DTYPE)
    return out


__all__ = ["NO_EXPERT", "assemble_hf_routing", "assemble_vllm_routing", "install_capture", "start_capture",
           "stop_capture"]
