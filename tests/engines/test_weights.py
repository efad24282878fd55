"""Weight buckets: packing round trips (dtypes, pickling as Ray does), the size bound, whole layers."""

import pickle

import pytest
import torch

from rlcore.engines.weights import WeightBucket, layer_of, pack_buckets

BUCKET = 4096


def mixed_state() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes (odd sizes, so the 8-byte alignment matters), in state-dict order."""
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=g),  # fp32, 140 bytes
        "model.layers.0.self_attn.q_proj.weight": torch.randn(3, 3, generator=g).to(torch.bfloat16),  # 18 bytes
        "model.layers.0.input_layernorm.weight": torch.randn(5, generator=g),
        "model.layers.0.counter": torch.tensor([1, -2, 2**40], dtype=torch.int64),
        "model.layers.0.scalar": torch.tensor(3.5),  # 0-d
        "model.layers.1.mlp.up_proj.weight": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        "model.layers.1.mask": torch.tensor([True, False, True]),
        "model.norm.weight": torch.randn(5, generator=g),
        "lm_head.weight": torch.randn(5, 7, generator=g),
        "step": torch.arange(3, dtype=torch.int64),
    }


def unpack(buckets) -> dict[str, torch.Tensor]:
    out = {}
    for bucket in buckets:
        for name, tensor in bucket.tensors():
            assert name not in out, f"{name} packed twice"
            out[name] = tensor
    return out


def assert_same(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)  # every tensor, in packing order
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name  # each keeps its own dtype
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("bucket_bytes", [1, 64, BUCKET, 1 << 30])
def test_round_trip_keeps_values_dtypes_and_shapes(bucket_bytes):
    state = mixed_state()
    buckets = list(pack_buckets(state.items(), bucket_bytes))
    assert_same(unpack(buckets), state)
    if bucket_bytes == 1 << 30:
        assert len(buckets) == 1
    for bucket in buckets:
        assert bucket.buffer.dtype == torch.uint8 and bucket.buffer.dim() == 1
        assert all(offset % 8 == 0 for *_, offset in bucket.entries)


def test_round_trip_through_pickle_as_ray_ships_it():
    state = mixed_state()
    buckets = list(pack_buckets(state.items(), 64))
    shipped = [pickle.loads(pickle.dumps(b)) for b in buckets]
    for before, after in zip(buckets, shipped):
        assert isinstance(after, WeightBucket)
        assert after.names() == before.names() and after.nbytes == before.nbytes
        assert [e[1] for e in after.entries] == [e[1] for e in before.entries]  # torch dtypes again
    assert_same(unpack(shipped), state)


@pytest.mark.slow
def test_round_trip_through_ray_object_store(ray_cluster):
    state = mixed_state()
    [bucket] = pack_buckets(state.items(), 1 << 20)
    assert_same(unpack([ray_cluster.get(ray_cluster.put(bucket))]), state)


def test_packing_copies_so_later_writes_to_the_source_do_not_leak():
    state = mixed_state()
    expected = {k: v.clone() for k, v in state.items()}
    buckets = list(pack_buckets(state.items(), BUCKET))
    for tensor in state.values():
        tensor.zero_()
    assert_same(unpack(buckets), expected)


def layered_state(num_layers=4, dim=16) -> dict[str, torch.Tensor]:
    """A Llama-like state dict: each layer 4 fp32 matrices + a norm = 4 * 1024 + 64 bytes."""
    state = {"model.embed_tokens.weight": torch.randn(10, dim)}
    for i in range(num_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"model.layers.{i}.self_attn.{proj}.weight"] = torch.randn(dim, dim)
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(dim)
    state["model.norm.weight"] = torch.randn(dim)
    state["lm_head.weight"] = torch.randn(10, dim)
    return state


LAYER_BYTES = 4 * 16 * 16 * 4 + 16 * 4


@pytest.mark.parametrize("bucket_bytes", [LAYER_BYTES, LAYER_BYTES + 700, 2 * LAYER_BYTES + 100, 3 * LAYER_BYTES])
def test_buckets_are_bounded_and_never_split_a_layer(bucket_bytes):
    state = layered_state()
    buckets = list(pack_buckets(state.items(), bucket_bytes))
    assert len(buckets) > 1
    assert all(b.nbytes <= bucket_bytes for b in buckets)
    homes = {}
    for index, bucket in enumerate(buckets):
        for name in bucket.names():
            homes.setdefault(layer_of(name), set()).add(index)
    assert all(len(h) == 1 for h in homes.values()), homes  # every layer in exactly one bucket
    assert {f"model.layers.{i}" for i in range(4)} <= set(homes)
    # Buckets are filled greedily: the next unit did not fit into the one before.
    for before, after in zip(buckets, buckets[1:]):
        first_unit = [n for n in after.names() if layer_of(n) == layer_of(after.names()[0])]
        unit_bytes = sum(state[n].numel() * state[n].element_size() for n in first_unit)
        assert before.nbytes + unit_bytes > bucket_bytes
    assert_same(unpack(buckets), state)


def test_a_layer_larger_than_a_bucket_travels_alone():
    state = layered_state(num_layers=3)
    big = {f"model.layers.1.mlp.{p}.weight": torch.randn(64, 64) for p in ("gate_proj", "up_proj", "down_proj")}
    names = list(state)
    at = names.index("model.layers.2.self_attn.q_proj.weight")  # right after layer 1's own tensors
    state = dict([*list(state.items())[:at], *big.items(), *list(state.items())[at:]])
    bucket_bytes = 2 * LAYER_BYTES + 200
    buckets = list(pack_buckets(state.items(), bucket_bytes))
    [oversized] = [b for b in buckets if b.nbytes > bucket_bytes]
    assert {layer_of(n) for n in oversized.names()} == {"model.layers.1"}  # alone, and whole
    assert len(oversized.names()) == 5 + 3
    assert all(b.nbytes <= bucket_bytes for b in buckets if b is not oversized)
    assert_same(unpack(buckets), state)

    # A single tensor larger than a bucket likewise, at the end of the stream too.
    huge = {"model.norm.weight": torch.randn(8), "lm_head.weight": torch.randn(100, 100)}
    buckets = list(pack_buckets(huge.items(), 1000))
    assert [b.names() for b in buckets] == [["model.norm.weight"], ["lm_head.weight"]]
    assert_same(unpack(buckets), huge)


def test_packing_is_lazy_and_checks_its_size():
    seen = []

    def stream():
        for name, tensor in layered_state().items():
            seen.append(name)
            yield name, tensor

    buckets = pack_buckets(stream(), LAYER_BYTES)
    first = next(buckets)
    assert len(seen) < len(layered_state())  # the rest not read yet
    assert first.names() == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        next(pack_buckets(layered_state().items(), 0))


def test_layer_of():
    assert layer_of("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_of("model.language_model.layers.3.self_attn.q_proj.weight") == "model.language_model.layers.3"
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert layer_of("lm_head.weight") == "lm_head.weight"
