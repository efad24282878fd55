"""Mixture-of-experts pieces every layer above shares: finding the routers of a HF MoE model, the
router's auxiliary losses, recording which experts a forward chose, and forcing a forward to
choose recorded ones (router replay).

Why router replay: an MoE policy's log-probability of a token depends on which experts it was
routed to, and that choice is a discontinuous function of the weights and of numerics. The
sampler (vLLM in bf16, or the HF engine) and the trainer's forward can route the same token
differently, and one optimizer step can flip a token's top-k; either makes the PPO ratio of that
token measure a routing flip rather than a policy change, which is what destabilises RL on MoE
models. Replaying the experts recorded at sampling in every training forward ("rollout routing
replay", R3) keeps the sampled and trained computations the same network; the routing *weights*
still come from the current router logits over the recorded experts, so the router keeps learning.

The HF routers of transformers 5 (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``) are modules whose
forward maps the flattened hidden states (B*T, H) to ``(router_logits (B*T, E), top-k weights
(B*T, k), top-k expert ids (B*T, k))``; everything here works on that contract, found by class
name, so Qwen3-MoE and Mixtral are served by the same code.

Recorded routing is one tensor ``routed_experts`` (B, T, L, k) (int16) aligned with a batch's
``input_ids`` columns: the k expert ids of each of the L MoE layers at each position; -1 where
nothing was recorded (padding, a position the sampler never ran, such as the last response token
or a prompt prefix served from vLLM's prefix cache). A replayed forward routes -1 positions with
the current router, as an ordinary forward would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

ROUTER_CLASS_SUFFIX = "TopKRouter"
NO_EXPERT = -1  # routed_experts value: nothing recorded at this position
ROUTED_DTYPE = torch.int16  # expert ids < 32768; (B, T, L, k) int64 would be 4x the memory


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith(ROUTER_CLASS_SUFFIX)]


def is_moe(model: nn.Module) -> bool:
    return bool(router_modules(model))


def router_top_k(model: nn.Module) -> int:
    routers = router_modules(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router modules")
    return int(routers[0].top_k)


# ----------------------------------------------------------------------------- auxiliary losses
def _valid_rows(mask: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(rows, device=device, dtype=torch.float32)
    flat = mask.reshape(-1).to(device=device, dtype=torch.float32)
    if flat.numel() != rows:
        raise ValueError(f"mask has {flat.numel()} positions, the router logits {rows} rows")
    return flat


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, ``E * sum_e f_e * P_e``, over all layers' valid tokens.

    ``f_e``: the fraction of (token, layer) rows whose top-k includes expert e (summed over the k
    slots, so sum_e f_e = k); ``P_e``: the mean router probability of e. Perfectly even routing
    gives k; routing all tokens to the same k experts gives up to E. Only ``P`` carries gradient (the
    top-k choice is not differentiable), which pushes probability away from overloaded experts.
    ``router_logits``: one (B*T, E) tensor per layer; ``mask`` (B, T): the tokens that count.
    The counts are pooled over layers before the product, as HF's ``load_balancing_loss_func``.
    """
    if not router_logits:
        raise ValueError("no router logits: not an MoE forward (output_router_logits=True?)")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, device=device, dtype=torch.float32)
    prob_sum = torch.zeros(num_experts, device=device, dtype=torch.float32)
    rows = torch.zeros((), device=device, dtype=torch.float32)
    for logits in router_logits:
        valid = _valid_rows(mask, logits.shape[0], device)
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), valid.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * valid.unsqueeze(-1)).sum(0)
        rows = rows + valid.sum()
    rows = rows.clamp(min=1.0)
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(router_logits: Sequence[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over valid (token, layer) rows of ``logsumexp(logits)^2``.

    It keeps router logits small, where softmax and top-k are numerically stable (bf16 logits of
    large magnitude round to ties and flip the top-k), without changing which expert is preferred.
    """
    if not router_logits:
        raise ValueError("no router logits: not an MoE forward (output_router_logits=True?)")
    device = router_logits[0].device
    total = torch.zeros((), device=device, dtype=torch.float32)
    rows = torch.zeros((), device=device, dtype=torch.float32)
    for logits in router_logits:
        valid = _valid_rows(mask, logits.shape[0], device)
        z = torch.logsumexp(logits.float(), dim=-1)
        total = total + (z.square() * valid).sum()
        rows = rows + valid.sum()
    return total / rows.clamp(min=1.0)


# ----------------------------------------------------------------------------- replay
def replayed_routing(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor,
                     recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, expert ids) of one router call with the recorded experts forced in.

    ``recorded`` (N, k): expert ids per row, -1 rows keep the router's own ``indices``. Weights are
    the current softmax probabilities of the chosen experts, renormalised to sum to 1 when the
    router does that (``norm_topk_prob``; Mixtral always does), so the router still gets gradient.
    """
    recorded = recorded.to(device=indices.device, dtype=indices.dtype)
    use = (recorded >= 0).all(dim=-1, keepdim=True)
    chosen = torch.where(use, recorded, indices)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), chosen


class RouterReplay:
    """Forward hooks on a model's routers that force the experts of ``set(routed_experts)``.

    Installed once and kept: a forward replays whatever was last ``set`` (None: route normally).
    Keeping the state until the next ``set`` is deliberate: activation checkpointing re-runs the
    routers during backward, after the forward has returned, and must route the same way.
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = router_modules(model)
        if not self.routers:
            raise ValueError(f"router replay needs an MoE model; {type(model).__name__} has no routers")
        self.routed: torch.Tensor | None = None
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def set(self, routed_experts: torch.Tensor | None) -> None:
        """Replay ``routed_experts`` (B, T, L, k) in the following forwards; None: stop replaying."""
        if routed_experts is not None:
            if routed_experts.ndim != 4 or routed_experts.shape[2] != len(self.routers):
                raise ValueError(f"routed_experts must be (B, T, {len(self.routers)} layers, k), "
                                 f"got {tuple(routed_experts.shape)}")
        self.routed = routed_experts

    def _hook(self, layer: int):
        def hook(router: nn.Module, args, output):
            if self.routed is None:
                return output
            logits, _, indices = output
            recorded = self.routed[:, :, layer].reshape(-1, self.routed.shape[-1])
            if recorded.shape != indices.shape:
                raise ValueError(f"layer {layer}: recorded routing {tuple(recorded.shape)} does not match "
                                 f"this forward's {tuple(indices.shape)} (B*T, k)")
            weights, chosen = replayed_routing(router, logits, indices, recorded)
            return logits, weights, chosen
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class RoutingRecorder:
    """Forward hooks recording each router call's expert ids (HF models), for the HF engine.

    Each forward of the model appends one entry per layer: ``calls[i][layer]`` (N_i, k), the rows in
    the order the router saw them (the flattened (B, T_i) of that forward).
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = router_modules(model)
        self.calls: list[list[torch.Tensor]] = []
        self.handles = []
        for i, r in enumerate(self.routers):
            self.handles.append(r.register_forward_hook(self._hook(i)))

    def _hook(self, layer: int):
        def hook(router, args, output):
            if layer == 0:
                self.calls.append([])
            self.calls[-1].append(output[2].detach().to("cpu", ROUTED_DTYPE))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def empty_routing(batch: int, width: int, layers: int, top_k: int) -> torch.Tensor:
    return torch.full((batch, width, layers, top_k), NO_EXPERT, dtype=ROUTED_DTYPE)


def mask_routing(routed_experts: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``routed_experts`` with -1 wherever ``attention_mask`` is 0 (padding routes as it likes)."""
    keep = attention_mask.bool()[:, :, None, None]
    return torch.where(keep, routed_experts, torch.full_like(routed_experts, NO_EXPERT))

