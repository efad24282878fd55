"""Dynamic micro-batching on 2 DP ranks (gloo, Ray actors): the ranks pack different rows into
different counts of micro-batches, and must still run the same number (each forward is a round of
FSDP collectives)."""

import torch

from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, Dispatch, RayResourcePool, RayWorkerGroup, Worker, register
from rlcore.workers.fsdp_utils import micro_batch_indices

# Token counts per row, budget 10: rank 0's four short rows fit one micro-batch, rank 1's need four.
LENGTHS = {0: [2, 2, 2, 2], 1: [9, 8, 7, 6]}


class Packer(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def pack(self) -> list[list[int]]:
        self.init_distributed(backend="gloo", timeout_s=60)
        lengths = torch.tensor(LENGTHS[self.rank])
        mask = (torch.arange(10) < lengths[:, None]).long()
        indices = micro_batch_indices(DataProto.from_dict({"attention_mask": mask}), 1, True, 10, torch.device("cpu"))
        return [ix.tolist() for ix in indices]


def test_dp_ranks_agree_on_the_number_of_dynamic_micro_batches(ray_cluster):
    pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="packer")
    group = RayWorkerGroup(pool, ClassWithInitArgs(Packer), default_timeout=120)
    try:
        rank0, rank1 = group.pack()
    finally:
        group.shutdown()
        pool.shutdown()
    assert len(rank0) == len(rank1) == 4
    assert sorted(i for ix in rank0 for i in ix) == [0, 1, 2, 3]  # split down to one row each: still all rows
