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


# ----------------------------------------------------------------------------- verl's public behaviours
# Each value below is worked out by hand from the rows; the alias run of verl's own tests is in docs/verl.md.
from tensordict import TensorDict  # noqa: E402

from rlcore.protocol import (  # noqa: E402
    DataProtoConfig,
    DataProtoError,
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
    union_numpy_dict,
    union_tensor_dict,
)


def abc(n=3):
    return DataProto.from_dict({"x": torch.arange(n * 2).view(n, 2)}, {"u": list("abcdef"[:n])}, {"t": 1})


def test_refusals_are_value_errors_that_verl_code_catches_as_assertion_errors():
    assert issubclass(DataProtoError, ValueError) and issubclass(DataProtoError, AssertionError)
    with pytest.raises(AssertionError, match="cannot chunk a DataProto of 3 rows into 2"):
        abc().chunk(2)
    with pytest.raises(AssertionError, match="length mismatch"):
        DataProto.from_dict({"x": torch.zeros(2)}, {"u": [1, 2, 3]})


def test_one_batch_dimension_is_refused_by_name():
    with pytest.raises(DataProtoError, match=r"from_dict\(num_batch_dims=2\): a DataProto has exactly one batch dimension"):
        DataProto.from_dict({"x": torch.zeros(4, 3)}, num_batch_dims=2)
    assert len(DataProto.from_dict({"x": torch.zeros(4, 3)}, num_batch_dims=1)) == 4


def test_none_parts_are_empty():
    d = DataProto(batch=None, non_tensor_batch=None, meta_info=None)
    assert len(d) == 0 and d.non_tensor_batch == {} and d.meta_info == {}


def test_constructors_and_row_operations_keep_a_subclass():
    class Mine(DataProto):
        pass

    d = Mine.from_single_dict({"x": torch.arange(4), "u": np.array(list("abcd"), dtype=object)})
    assert type(d) is Mine
    assert all(type(p) is Mine for p in (d[1:3], d[[0, 2]], d.select(batch_keys=["x"]), Mine.concat(d.chunk(2)),
                                          d.repeat(), d.unfold_column_chunks(2)))


def test_union_tensor_dict_adds_keys_in_place_and_refuses_a_different_tensor():
    obs = torch.arange(6.0).view(3, 2)
    td1 = TensorDict({"obs": obs}, batch_size=[3])
    td2 = TensorDict({"obs": obs.clone(), "rew": torch.tensor([1.0, float("nan"), 3.0])}, batch_size=[3])
    assert union_tensor_dict(td1, td2) is td1 and set(td1.keys()) == {"obs", "rew"}
    union_tensor_dict(td1, TensorDict({"rew": torch.tensor([1.0, float("nan"), 3.0])}, batch_size=[3]))  # NaN == NaN
    with pytest.raises(AssertionError, match="union_tensor_dict: obs in tensor_dict1 and tensor_dict2"):
        union_tensor_dict(td1, TensorDict({"obs": obs + 1}, batch_size=[3]))
    with pytest.raises(DataProtoError, match=r"batch sizes \(3,\) and \(2,\) differ"):
        union_tensor_dict(td1, TensorDict({}, batch_size=[2]))


def test_union_numpy_dict_compares_values_nan_objects_and_cycles():
    d1 = {"score": np.array([1.0, np.nan]), "obj": np.array([[np.array([1, 2]), "t"], [None, {"k": [1]}]], dtype=object)}
    same = {"score": np.array([1.0, np.nan]),
            "obj": np.array([[np.array([1, 2]), "t"], [None, {"k": [1]}]], dtype=object), "new": np.arange(2)}
    assert union_numpy_dict(d1, same) is d1 and sorted(d1) == ["new", "obj", "score"]
    with pytest.raises(AssertionError, match="`score` in tensor_dict1 and tensor_dict2 are not the same object"):
        union_numpy_dict(d1, {"score": np.array([np.nan, 1.0])})  # NaN in another place
    with pytest.raises(DataProtoError, match="`obj`"):
        union_numpy_dict(d1, {"obj": np.array([[np.array([1, 3]), "t"], [None, {"k": [1]}]], dtype=object)})
    loop1, loop2 = np.empty(1, dtype=object), np.empty(1, dtype=object)
    loop1[0], loop2[0] = loop1, loop2
    union_numpy_dict({"c": loop1}, {"c": loop2})  # two self-containing arrays of one shape: equal, no recursion error
    with pytest.raises(DataProtoError):
        union_numpy_dict({"c": loop1}, {"c": np.array([None], dtype=object)})
    with pytest.raises(DataProtoError, match="must be a numpy array in both"):
        union_numpy_dict({"a": np.zeros(2)}, {"a": [0.0, 0.0]})


def test_dataproto_union_sees_nan_scores_as_equal():
    a = DataProto.from_dict({"v": torch.tensor([0.5, float("nan")])}, {"s": np.array([float("nan"), 2.0], dtype=object)})
    b = DataProto.from_dict({"v": torch.tensor([0.5, float("nan")])}, {"s": np.array([float("nan"), 2.0], dtype=object)},
                            {"k": 1})
    assert a.union(b).meta_info == {"k": 1}


def test_concat_refuses_conflicting_meta_info_unless_asked_to_keep_the_first():
    parts = [DataProto.from_dict({"x": torch.tensor([1])}, meta_info={"config": "A", "shared": 1, "only0": 0}),
             DataProto.from_dict({"x": torch.tensor([2])}, meta_info={"config": "B", "shared": 1, "only1": 1})]
    with pytest.raises(AssertionError, match=r"Conflicting values for meta_info key 'config'.*'A' \(part 0\) vs 'B' \(part 1\)"):
        DataProto.concat(parts)
    kept = DataProto.concat(parts, meta_conflicts="first")
    assert kept.meta_info == {"config": "A", "shared": 1, "only0": 0, "only1": 1} and kept.batch["x"].tolist() == [1, 2]
    agree = [DataProto(meta_info={"w": np.array([1.0, np.nan])}), DataProto(meta_info={"w": np.array([1.0, np.nan])})]
    assert DataProto.concat(agree).meta_info["w"].shape == (2,)  # equal arrays are no conflict
    with pytest.raises(ValueError, match="'raise' or 'first'"):
        DataProto.concat(parts, meta_conflicts="last")


def test_unfold_column_chunks_splits_named_keys_and_repeats_the_rest():
    d = DataProto.from_dict({"a": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "b": torch.tensor([[10], [20]])},
                            {"pair": [["p0", "q0"], ["p1", "q1"]], "u": ["r0", "r1"],
                             "grid": np.array([[1, 2], [3, 4]], dtype=object)}, {"t": 1})
    out = d.unfold_column_chunks(2, split_keys=["a", "pair", "grid"])
    assert out.batch["a"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["b"].tolist() == [[10], [10], [20], [20]]
    assert out.non_tensor_batch["pair"].tolist() == [["p0"], ["q0"], ["p1"], ["q1"]]  # split as the (2, 2) array
    assert out.non_tensor_batch["grid"].tolist() == [[1], [2], [3], [4]]
    assert out.non_tensor_batch["u"].tolist() == ["r0", "r0", "r1", "r1"] and out.meta_info == {"t": 1}
    cube = DataProto.from_dict({"c": torch.arange(8).view(1, 4, 2)}).unfold_column_chunks(2, ["c"])
    assert cube.batch["c"].tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert d.unfold_column_chunks(2).batch["a"].shape == (4, 4)  # no split keys: every key repeated
    with pytest.raises(DataProtoError, match=r"batch\['a'\] of shape \(2, 4\) has no second dimension divisible by 3"):
        d.unfold_column_chunks(3, ["a"])
    with pytest.raises(KeyError, match=r"no key\(s\) \['nope'\]"):
        d.unfold_column_chunks(2, ["nope"])
    with pytest.raises(DataProtoError, match=r"one length per row.*lengths \[1, 2\]"):
        DataProto.from_dict(non_tensors={"r": [[1], [1, 2]]}).unfold_column_chunks(2, ["r"])


def test_to_and_from_tensordict_keep_rows_lists_dicts_and_meta():
    d = DataProto.from_dict({"obs": torch.tensor([1, 2, 3])},
                            {"turns": [[], [0.5, 0.8], [0.9]], "info": [{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}],
                             "u": ["a", "b", "c"]}, {"step": 42})
    td = d.to_tensordict()
    assert td.batch_size == torch.Size([3]) and td["obs"].tolist() == [1, 2, 3]
    assert list(td["turns"][1]) == [0.5, 0.8] and dict(td["info"][1]) == {"acc": 0.0} and td["u"] == ["a", "b", "c"]
    assert td["step"] == 42
    back = DataProto.from_tensordict(td)
    assert back.batch["obs"].tolist() == [1, 2, 3] and back.meta_info == {"step": 42}
    assert back.non_tensor_batch["turns"].tolist() == [[], [0.5, 0.8], [0.9]]  # one list per row, a 1-d column
    assert back.non_tensor_batch["info"][2] == {"acc": 1.0} and back.non_tensor_batch["u"].tolist() == ["a", "b", "c"]
    with pytest.raises(DataProtoError, match=r"meta_info keys \['u'\] are also keys of another part"):
        DataProto.from_dict(non_tensors={"u": [1]}, meta_info={"u": 2}).to_tensordict()
    with pytest.raises(DataProtoError, match="num_batch_dims=2"):
        DataProto.from_tensordict(td, num_batch_dims=2)


def test_serialized_tensors_come_back_with_dtype_shape_and_memory_of_their_own():
    for t in (torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16), torch.tensor([True, False]), torch.zeros(0, 3),
              torch.arange(12).view(3, 4).t()):  # the last one is not contiguous
        dtype, shape, data = serialize_single_tensor(t)
        assert dtype == str(t.dtype).removeprefix("torch.") and shape == tuple(t.shape) and data.dtype == np.uint8
        back = deserialize_single_tensor((dtype, shape, data))
        assert back.dtype == t.dtype and torch.equal(back, t)
    src = torch.tensor([1.0, 2.0])
    back = deserialize_single_tensor(serialize_single_tensor(src))
    back[0] = 9.0
    assert src.tolist() == [1.0, 2.0]
    assert deserialize_single_tensor(("int16", (2,), bytes([1, 0, 255, 255]))).tolist() == [1, -1]  # little-endian
    with pytest.raises(DataProtoError, match="'nope' is not a torch dtype"):
        deserialize_single_tensor(("nope", (1,), b"\0"))


def test_serialized_tensordict_keeps_batch_size_device_and_nested_tensors():
    td = TensorDict({"a": torch.arange(6).view(2, 3), "n": torch.nested.as_nested_tensor(
        [torch.ones(1, 2), torch.zeros(3, 2)], layout=torch.jagged)}, batch_size=[2], device="cpu")
    size, device, items = serialize_tensordict(td)
    assert size == (2,) and device == "cpu" and items["n"][0] == "jagged" and len(items["n"][1]) == 2
    back = deserialize_tensordict((size, device, items))
    assert back.batch_size == torch.Size([2]) and str(back.device) == "cpu" and torch.equal(back["a"], td["a"])
    assert [p.tolist() for p in back["n"].unbind()] == [[[1.0, 1.0]], [[0.0, 0.0]] * 3]
    grid = TensorDict({"g": torch.arange(6).view(2, 3)}, batch_size=[2, 3])
    assert deserialize_tensordict(serialize_tensordict(grid)).batch_size == torch.Size([2, 3])
    with pytest.raises(DataProtoError, match="encoded as 4 fields"):
        deserialize_tensordict(((1,), None, {"x": (1, 2, 3, 4)}))


def test_padding_appends_copies_of_the_last_or_first_row_in_place():
    d = abc()
    assert d.padding(2) is None and d.batch["x"][:, 0].tolist() == [0, 2, 4, 4, 4]
    assert d.non_tensor_batch["u"].tolist() == ["a", "b", "c", "c", "c"] and d.meta_info == {"t": 1}
    first = abc()
    first.padding(1, padding_candidate="first")
    assert first.non_tensor_batch["u"].tolist() == ["a", "b", "c", "a"]
    first.padding(0)
    assert len(first) == 4


def test_auto_padding_flags(monkeypatch):
    assert not abc().is_padding_enabled()
    flagged = DataProto.from_dict({"x": torch.zeros(1)}, auto_padding=True)
    assert flagged.is_padding_enabled() and flagged.meta_info == {DataProtoConfig.auto_padding_key: True}
    assert DataProto.from_single_dict({"x": torch.zeros(1)}, auto_padding=True).is_padding_enabled()
    monkeypatch.setattr(DataProtoConfig, "_auto_padding", False)
    DataProtoConfig.auto_padding = True
    assert DataProtoConfig.auto_padding and abc().is_padding_enabled()
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "true")
    assert abc().is_padding_enabled()
    with pytest.raises(TypeError, match="must be a bool"):
        DataProtoConfig.auto_padding = 1


def test_make_iterator_goes_in_row_order_unless_asked_to_shuffle():
    d = DataProto.from_dict({"x": torch.arange(6)})
    order = [b.batch["x"].tolist() for b in d.make_iterator(mini_batch_size=2, epochs=2)]
    assert order == [[0, 1], [2, 3], [4, 5]] * 2  # verl's DataLoader default: no shuffle
    shuffled = [b.batch["x"].tolist() for b in d.make_iterator(2, 1, seed=0, dataloader_kwargs={"shuffle": True})]
    assert sorted(sum(shuffled, [])) == list(range(6)) and shuffled != order[:3]
    with pytest.raises(TypeError, match=r"dataloader_kwargs \['num_workers'\] are not supported"):
        d.make_iterator(2, 1, dataloader_kwargs={"num_workers": 2})


def test_pop_rename_select_idxs_slice_and_repeat_defaults():
    d = abc()
    popped = d.pop(batch_keys=["x"])  # the other key lists default to None, as in verl
    assert popped.batch["x"].shape == (3, 2) and d.batch.keys() == set() and d.non_tensor_batch["u"].shape == (3,)
    r = DataProto.from_dict({"a": torch.zeros(2), "b": torch.ones(2)})
    assert r.rename("a", "c") is r and sorted(r.batch.keys()) == ["b", "c"]
    r.rename(["b", "c"], ["c", "b"])  # a swap in one call
    assert r.batch["c"].tolist() == [1.0, 1.0] and r.batch["b"].tolist() == [0.0, 0.0]
    with pytest.raises(DataProtoError, match="2 old keys but 1 new keys"):
        r.rename(["b", "c"], ["x"])
    assert abc().select_idxs([2, 0]).non_tensor_batch["u"].tolist() == ["c", "a"]
    assert abc().select_idxs(torch.tensor([False, True, True])).batch["x"][:, 0].tolist() == [2, 4]
    assert abc().slice(0, 3, 2).non_tensor_batch["u"].tolist() == ["a", "c"]
    assert abc(2).repeat().non_tensor_batch["u"].tolist() == ["a", "a", "b", "b"]


def test_verl_names_rlcore_has_not_are_refused_by_name():
    with pytest.raises(ImportError, match="DataProtoFuture .*GroupFuture"):
        from rlcore.protocol import DataProtoFuture  # noqa: F401
    with pytest.raises(ImportError, match="all_gather_data_proto .*all_gather_object"):
        from rlcore.protocol import all_gather_data_proto  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import rlcore.protocol as protocol

        protocol.nope
