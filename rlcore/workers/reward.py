"""RewardWorker: ``RuleRewardManager`` as an SPMD worker, for scoring heavy enough to spread over a
group; each rank scores its chunk, and the metrics are computed over the whole batch when collected."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlcore.protocol import DataProto
from rlcore.rewards.manager import RuleRewardManager, reward_metrics
from rlcore.single_controller import Dispatch, DispatchMode, Worker, register
from rlcore.single_controller.decorator import collect_dp_proto, resolve_dispatch_mode


def _collect_with_metrics(ctx, outputs: list[DataProto]) -> DataProto:
    """Concatenate the ranks' chunks, drop the padding, then compute metrics over the real rows only."""
    out = collect_dp_proto(ctx, outputs)
    sources = out.non_tensor_batch.pop("data_source", None)
    out.meta_info.update(reward_metrics(out.batch["reward_scores"], sources, out.batch["reward_full_score"],
                                        out.non_tensor_batch["reward_components"]))
    return out


_collect_with_metrics.concatenates_chunks = True  # a future of it can feed another group rank by rank
DP_COMPUTE_REWARD = DispatchMode(
    resolve_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).dispatch_fn, _collect_with_metrics, "dp_compute_reward"
)


class RewardWorker(Worker):
    def __init__(self, config: Mapping | Any) -> None:
        self.manager = RuleRewardManager.from_config(config)

    @register(dispatch_mode=DP_COMPUTE_REWARD)
    def compute_reward(self, data: DataProto) -> DataProto:
        """DP_COMPUTE_PROTO, with metrics computed over the whole (unpadded) batch when collected."""
        out = self.manager.score(data, index_offset=self.rank * len(data))
        if "data_source" in data.non_tensor_batch:  # for the collect's per-source metrics; popped there
            out.non_tensor_batch["data_source"] = data.non_tensor_batch["data_source"]
        return out
