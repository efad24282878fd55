"""What the actor does differently for a mixture-of-experts policy (``rlcore.models.moe``):

- fp32 routers under bf16 mixed precision (``router_mp_policy``): each router is its own FSDP2
  unit computing in float32, inputs cast up. Why: the top-k choice is a hard decision on logits
  that are often close together; bf16 rounding (8 bits of mantissa) turns near-ties into flips
  between forwards of the same weights, so the training forward would route differently from the
  one that scored ``old_log_probs``. The routers are tiny (E x H), so fp32 costs nothing.
- ``actor.freeze_router``: the routers' weights get no gradient and no optimizer state, so the
  expert assignment of the pre-trained model is kept while the experts and the rest learn.
- ``actor.moe_aux_loss_coef`` / ``actor.moe_z_loss_coef``: load-balancing and z-loss terms on the
  policy loss, over the micro-batch's valid (attention-mask) tokens.
- ``actor.router_replay``: every forward of the worker (old log-probs, reference, update) routes each
  position to the experts the rollout engine recorded (``routed_experts``), with routing weights
  from the current router logits (``RouterReplay``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from rlcore.algos.losses import LossScale
from rlcore.models.moe import RouterReplay, load_balancing_loss, router_modules, router_top_k, router_z_loss
from rlcore.protocol import DataProto
from rlcore.workers.packing import Packed

ROUTED_KEY = "routed_experts"


def router_mp_policy(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The routers' FSDP2 policy: float32 compute and reduction whatever the layers compute in;
    ``cast_forward_inputs`` brings the bf16 hidden states up to float32 on the way in."""
    if policy.param_dtype in (None, torch.float32):
        return policy
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)


def freeze_routers(model: nn.Module) -> int:
    """Routers' parameters stop requiring grad (so an optimizer over trainable parameters leaves them
    out); returns how many parameters were frozen."""
    params = [p for r in router_modules(model) for p in r.parameters()]
    for p in params:
        p.requires_grad_(False)
    return len(params)


def micro_share(micro: DataProto, scale: LossScale) -> float | torch.Tensor:
    """This micro-batch's weight in the mini-batch: its share of the valid response tokens, times the
    DP size that FSDP's gradient average divides by. Summed over micro-batches and ranks the MoE terms
    are then a token-weighted mean of the micro-batches' values, whatever the split; with one
    micro-batch on one rank, exactly the value."""
    if scale.global_tokens is None:
        return 1.0
    return micro.batch["response_mask"].sum().to(torch.float64) / scale.global_tokens * scale.dp_size


@dataclass
class MoEActor:
    """The MoE state of one actor or reference worker (None for dense models)."""

    num_experts: int
    top_k: int
    replay: RouterReplay | None

    @classmethod
    def build(cls, model: nn.Module, freeze_router: bool, router_replay: bool) -> "MoEActor | None":
        routers = router_modules(model)
        if not routers:
            if freeze_router or router_replay:
                raise ValueError(f"actor.freeze_router / actor.router_replay need an MoE model; "
                                 f"{type(model).__name__} has no routers")
            return None
        if freeze_router:
            freeze_routers(model)
        return cls(num_experts=int(routers[0].num_experts), top_k=router_top_k(model),
                   replay=RouterReplay(model) if router_replay else None)

    def batch_keys(self, data: DataProto) -> list[str]:
        """The batch keys the forwards read besides the tokens: ``routed_experts`` when replaying."""
        if self.replay is None:
            return []
        if ROUTED_KEY not in data.batch.keys():
            raise KeyError(f"actor.router_replay needs batch key {ROUTED_KEY!r}: sample with "
                           "rollout.record_routing=true (an MoE model on the HF or vLLM engine)")
        return [ROUTED_KEY]

    def before_forward(self, micro: DataProto, packed: Packed | None = None) -> None:
        """Point the replay hooks at this micro-batch's recorded routing (packed like its tokens when ``packed``)."""
        if self.replay is not None:
            routed = micro.batch[ROUTED_KEY]
            self.replay.set(routed if packed is None else packed.gather(routed))

    def loss_terms(self, router_logits, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss) of one forward's router logits over its valid tokens (None: all
        of them, a packed forward's)."""
        return (load_balancing_loss(router_logits, self.num_experts, self.top_k, attention_mask),
                router_z_loss(router_logits, attention_mask))
