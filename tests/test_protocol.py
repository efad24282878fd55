"""DataProto: the three parts stay in step under every operation; transport is zero-copy."""

import pickle

import numpy as np
import pytest
import torch

from rlcore.protocol import DataProto


def make(n=6):
    return DataProto.from_dict(
        {"ids": torch.arange(n * 2).view(n, 2), "lp": torch.arange(n, dtype=torch.float32).bfloat16()},
        {"uid": [f"u{i}" for i in range(n)], "obj": np.array([{"i": i} for i in range(n)], dtype=object)},
        {"temperature": 1.0},
    )


def test_from_dict_and_len():
    d = make()
    assert len(d) == 6
    assert d.non_tensor_batch["uid"].dtype == object
    assert d.meta_info == {"temperature": 1.0}


def test_length_mismatch_names_key_and_lengths():
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] has 2 rows but batch has 3"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"uid": ["x", "y"]})
    with pytest.raises(ValueError, match=r"tensor 'b' has 4 rows but 'a' has 3"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})


def test_from_single_dict_splits_by_type():
    d = DataProto.from_single_dict({"x": torch.ones(2, 3), "s": np.array(["a", "b"], dtype=object)})
    assert list(d.batch.keys()) == ["x"] and list(d.non_tensor_batch) == ["s"]


@pytest.mark.parametrize(
    "index, rows",
    [
        (slice(1, 4), [1, 2, 3]),
        (torch.tensor([5, 0]), [5, 0]),
        (np.array([True, False, True, False, False, True]), [0, 2, 5]),
        ([3, 3], [3, 3]),
    ],
)
def test_indexing_keeps_parts_aligned(index, rows):
    d = make()[index]
    assert d.batch["ids"][:, 0].tolist() == [2 * r for r in rows]
    assert d.non_tensor_batch["uid"].tolist() == [f"u{r}" for r in rows]
    assert [o["i"] for o in d.non_tensor_batch["obj"]] == rows


def test_int_index_gives_item():
    item = make()[2]
    assert item.batch["ids"].tolist() == [4, 5] and item.non_tensor_batch["uid"] == "u2"


def test_bad_mask_length():
    with pytest.raises(IndexError, match="boolean mask has 2 entries but the DataProto has 6 rows"):
        make()[np.array([True, False])]


def test_select_and_pop():
    d = make()
    s = d.select(batch_keys=["ids"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert list(s.batch.keys()) == ["ids"] and list(s.non_tensor_batch) == ["uid"] and s.meta_info == {}
    with pytest.raises(KeyError, match=r"batch has no key\(s\) \['nope'\]"):
        d.select(batch_keys=["nope"])
    popped = d.pop(batch_keys=["lp"], non_tensor_batch_keys=["obj"], meta_info_keys=["temperature"])
    assert list(popped.batch.keys()) == ["lp"] and "lp" not in d.batch.keys()
    assert "obj" not in d.non_tensor_batch and d.meta_info == {}


def test_union_merges_and_rejects_conflicts():
    a = make()
    b = DataProto.from_dict({"extra": torch.ones(6), "ids": a.batch["ids"].clone()}, {"more": list(range(6))}, {"k": 2})
    a.union(b)
    assert set(a.batch.keys()) == {"ids", "lp", "extra"} and a.meta_info["k"] == 2
    bad = DataProto.from_dict({"ids": torch.zeros(6, 2, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"union conflict: batch\['ids'\]"):
        make().union(bad)
    with pytest.raises(ValueError, match="cannot union DataProtos of 6 and 3 rows"):
        make().union(make(3))


def test_chunk_split_concat_roundtrip():
    d = make()
    parts = d.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    back = DataProto.concat(parts)
    assert torch.equal(back.batch["ids"], d.batch["ids"])
    assert back.non_tensor_batch["uid"].tolist() == d.non_tensor_batch["uid"].tolist()
    assert [len(p) for p in d.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="cannot chunk a DataProto of 6 rows into 4 equal parts"):
        d.chunk(4)


def test_repeat_interleave_and_tile():
    d = make(3)
    assert d.repeat(2, interleave=True).non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert d.repeat(2, interleave=False).batch["ids"][:, 0].tolist() == [0, 2, 4, 0, 2, 4]


def test_pad_and_unpad():
    d = make(5)
    padded, pad = d.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert padded.non_tensor_batch["uid"].tolist()[5:] == ["u0", "u1", "u2"]  # valid rows, not zeros
    assert torch.equal(padded.unpad(pad).batch["ids"], d.batch["ids"])
    same, zero = d.pad_to_divisor(5)
    assert zero == 0 and same is d


def test_make_iterator_covers_every_row_each_epoch():
    d = make(8)
    batches = list(d.make_iterator(mini_batch_size=4, epochs=2, seed=3))
    assert len(batches) == 4
    for epoch in (batches[:2], batches[2:]):
        seen = sorted(r for b in epoch for r in b.batch["ids"][:, 0].tolist())
        assert seen == [2 * i for i in range(8)]
    again = list(d.make_iterator(mini_batch_size=4, epochs=2, seed=3))
    assert all(torch.equal(a.batch["ids"], b.batch["ids"]) for a, b in zip(batches, again))
    with pytest.raises(ValueError, match="8 rows do not divide into mini-batches of 3"):
        next(d.make_iterator(3))


def test_pickle_roundtrip_keeps_dtypes_including_bfloat16():
    d = make()
    back = pickle.loads(pickle.dumps(d, protocol=5))
    assert back.batch["lp"].dtype == torch.bfloat16
    assert torch.equal(back.batch["lp"], d.batch["lp"]) and torch.equal(back.batch["ids"], d.batch["ids"])
    assert back.non_tensor_batch["obj"][4] == {"i": 4} and back.meta_info == d.meta_info


def test_pickle_is_out_of_band_and_chunk_ships_only_its_rows():
    """Tensors leave as pickle-5 buffers (what Ray's object store moves without copying), and a
    chunk (a view) ships its own rows, not the parent's whole storage."""
    d = DataProto.from_dict({"x": torch.zeros(1000, 100)})
    buffers = []
    pickle.dumps(d.chunk(4)[1], protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1
    assert buffers[0].raw().nbytes == 250 * 100 * 4


def test_save_and_load_from_disk(tmp_path):
    d = make()
    d.save_to_disk(tmp_path / "d.pkl")
    back = DataProto.load_from_disk(tmp_path / "d.pkl")
    assert torch.equal(back.batch["ids"], d.batch["ids"]) and back.non_tensor_batch["uid"][0] == "u0"


def test_repr_lists_keys():
    text = repr(make())
    assert "rows=6" in text and "batch['ids']: (6, 2) int64" in text and "non_tensor_batch['uid']" in text


def test_non_tensor_only():
    d = DataProto.from_dict(non_tensors={"s": ["a", "b", "c"]})
    assert len(d) == 3 and len(d.chunk(3)[0]) == 1
