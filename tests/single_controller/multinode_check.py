"""Run by test_multinode.py in a fresh process: one worker group across a 2-node Ray cluster.

``ray.cluster_utils.Cluster`` starts two raylets ("nodes") on this machine. Each node offers one
CPU, so a pool of process_on_nodes=[1, 1] must put its ranks on different nodes. The cluster's
address file lands in the RAY_TMPDIR the test gives it, not /tmp/ray, where other tests' ray.init()
would find it.
"""

import json
import sys

import ray
import torch
from ray.cluster_utils import Cluster

from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, Dispatch, RayResourcePool, RayWorkerGroup, Worker, register


class NodeReporter(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def where(self):
        import torch.distributed as dist

        self.init_distributed()  # gloo rendezvous across the two nodes
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "sum": float(t)}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def plus_rank(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] + 100 * self.rank})


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        pool = RayResourcePool([1, 1], num_cpus_per_process=1)
        wg = RayWorkerGroup(pool, ClassWithInitArgs(NodeReporter), init_timeout=120)
        where = wg.where.options(timeout=120)()
        out = wg.plus_rank(DataProto.from_dict({"x": torch.arange(4)}))
        result = {"where": where, "x": out.batch["x"].tolist(), "nodes": len(ray.nodes())}
        print("RESULT " + json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
