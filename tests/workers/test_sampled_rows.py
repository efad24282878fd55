"""The actor's copy of the trainer's log-probs of the trajectory sample's rows (rlcore.workers.sampled_rows)
and the driver's pick among them (rlcore.trainer.trajectories.sample_rows), on hand-built batches: rows
met in any order and in cropped micro-batches, stand-ins ignored, nothing kept where the batch has
old_log_probs, and a rank's rows matched back to the driver's batch by uid and response tokens."""

import numpy as np
import torch

from rlcore.protocol import DataProto
from rlcore.trainer.trajectories import kept_log_probs, sample_rows
from rlcore.workers.mismatch import STAND_IN
from rlcore.workers.sampled_rows import ROW_KEY, SampledRows


def batch(uids, lengths, width=4, prompt=2) -> DataProto:
    n = len(uids)
    responses = torch.arange(n * width).reshape(n, width) + 100
    attention = torch.ones(n, prompt + width, dtype=torch.long)
    for i, length in enumerate(lengths):
        attention[i, prompt + length:] = 0
    return DataProto.from_dict({"responses": responses, "attention_mask": attention,
                                "rollout_log_probs": torch.zeros(n, width)}, {"uid": np.array(uids, dtype=object)})


def test_keeps_the_picked_groups_rows_from_micro_batches_in_any_order():
    data = batch(["a", "a", "b", "b", "c", "c"], [4, 2, 3, 2, 1, 2])
    kept = SampledRows(groups=2)
    kept.start(data)
    assert data.batch[ROW_KEY].tolist() == [0, 1, -1, -1, 2, 3]  # groups a and c: the first and the last
    log_prob = -torch.arange(24, dtype=torch.float32).reshape(6, 4) / 10
    for ix in ([5, 2], [0, 4], [3, 1]):  # shuffled micro-batches, each cropped to its longest row (crop_padding)
        width = max(int(data.batch["attention_mask"][i, 2:].sum()) for i in ix)
        micro = DataProto.from_dict({ROW_KEY: data.batch[ROW_KEY][ix]}, meta_info={STAND_IN: False})
        kept.add(log_prob[ix][:, :width], micro)
    stand_in = DataProto.from_dict({ROW_KEY: data.batch[ROW_KEY][[1]]}, meta_info={STAND_IN: True})
    kept.add(torch.full((1, 4), 9.0), stand_in)  # a pass for the collectives only: not the row's numbers
    kept.stop()
    kept.add(torch.full((6, 4), 9.0), data)  # after the first pass: nothing more
    rows = kept.take()
    assert [(r["uid"], r["ids"]) for r in rows] == [("a", [100, 101, 102, 103]), ("a", [104, 105]), ("c", [116]),
                                                     ("c", [120, 121])]
    assert [r["log_probs"] for r in rows] == [log_prob[0].tolist(), log_prob[1, :2].tolist(), log_prob[4, :1].tolist(),
                                              log_prob[5, :2].tolist()]
    assert kept.take() == []  # handed over once


def test_nothing_kept_with_old_log_probs_or_the_sample_off():
    data = batch(["a", "b"], [2, 2])
    data.batch["old_log_probs"] = torch.zeros(2, 4)
    for kept, d in ((SampledRows(2), data), (SampledRows(0), batch(["a", "b"], [2, 2]))):
        kept.start(d)
        assert ROW_KEY not in d.batch.keys() and not kept.active
        kept.add(torch.zeros(2, 4), d)
        assert kept.take() == []


def test_the_driver_picks_among_the_kept_rows_and_matches_them_by_uid_and_tokens():
    uids = ["0", "0", "1", "1", "2", "2", "3", "3"]
    ranks = [[{"uid": "1", "ids": [5, 6], "log_probs": [-0.5, -0.25]}], [{"uid": "3", "ids": [7], "log_probs": [-1.0]}]]
    kept = kept_log_probs([row for rank in ranks for row in rank])
    assert sample_rows(uids, 2, kept) == [2, 3, 6, 7]  # the groups with the trainer's log-probs
    assert sample_rows(uids, 1, kept) == [2, 3]
    assert sample_rows(uids, 3, kept) == [0, 1, 2, 3, 6, 7]  # then others (rows the update skipped), in batch order
    assert sample_rows(uids, 9, kept) == list(range(8))
    assert sample_rows(uids, 2, {}) == [0, 1, 6, 7]  # none kept: the first and the last group, as before
    assert kept[("1", (5, 6))] == [-0.5, -0.25] and ("1", (5, 7)) not in kept
