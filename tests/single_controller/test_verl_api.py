"""verl's single-controller and DataProto API as a verl script writes it, on rlcore's own machinery:
@ray.remote worker classes, dict dispatch modes with verl's signatures, raw actor handles,
device_name, and DataProto's reorder / sample_level_repeat / fold / unfold / pad / metrics merging,
each against hand-computed results. The tutorial's online-DPO driver (examples/verl_online_dpo.py)
runs end to end at the bottom."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from rlcore import DataProto as TopLevelDataProto
from rlcore.protocol import (
    DataProto,
    DataProtoConfig,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)
from rlcore.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    DispatchMode,
    LocalWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourceError,
    Worker,
    create_colocated_worker_cls,
    register,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl_online_dpo.py"


def rows(n=6):
    return DataProto.from_dict({"x": torch.arange(n * 2).view(n, 2)}, {"u": list("abcdefgh"[:n])}, {"t": 1.0})


# ----------------------------------------------------------------------------- DataProto
def test_top_level_dataproto_is_the_protocol_class():
    assert TopLevelDataProto is DataProto


def test_reorder_is_in_place_and_moves_every_part():
    data = rows(4)
    assert data.reorder(torch.tensor([2, 0, 3, 1])) is None
    assert data.batch["x"].tolist() == [[4, 5], [0, 1], [6, 7], [2, 3]]
    assert data.non_tensor_batch["u"].tolist() == ["c", "a", "d", "b"]
    assert data.meta_info == {"t": 1.0}
    data.reorder(np.array([1, 1]))  # any index, as in verl: here fewer rows
    assert data.batch["x"].tolist() == [[0, 1], [0, 1]] and len(data) == 2
    with pytest.raises(IndexError, match=r"\[0, 2\)"):
        data.reorder([0, 5])
    with pytest.raises(ValueError, match="integer row indices"):
        data.reorder(torch.tensor([0.5]))


@pytest.mark.parametrize("counts", [[2, 0, 1], (2, 0, 1), torch.tensor([2, 0, 1]), np.array([2, 0, 1])])
def test_sample_level_repeat_repeats_each_row_its_own_count(counts):
    out = rows(3).sample_level_repeat(counts)
    assert out.batch["x"].tolist() == [[0, 1], [0, 1], [4, 5]]
    assert out.non_tensor_batch["u"].tolist() == ["a", "a", "c"]
    assert out.meta_info == {"t": 1.0}


def test_sample_level_repeat_refuses_bad_counts():
    with pytest.raises(ValueError, match=r"one count per row \(3\)"):
        rows(3).sample_level_repeat([1, 2])
    with pytest.raises(ValueError, match="non-negative integers"):
        rows(3).sample_level_repeat([1, -1, 1])


def test_fold_and_unfold_batch_dim():
    data = rows(6)
    folded = fold_batch_dim(data, new_batch_size=2)
    assert len(folded) == 2 and folded.batch["x"].shape == (2, 3, 2)
    assert folded.batch["x"][1].tolist() == [[6, 7], [8, 9], [10, 11]]  # rows 3-5 form group 1
    assert folded.non_tensor_batch["u"].tolist() == [["a", "b", "c"], ["d", "e", "f"]]
    assert data.non_tensor_batch["u"].shape == (6,) and data.batch["x"].shape == (6, 2)  # input untouched
    back = unfold_batch_dim(folded, batch_dims=2)
    assert torch.equal(back.batch["x"], data.batch["x"])
    assert back.non_tensor_batch["u"].tolist() == list("abcdef") and back.meta_info == {"t": 1.0}
    with pytest.raises(ValueError, match="do not fold into 4"):
        fold_batch_dim(data, 4)
    mixed = DataProto.from_dict({"x": torch.zeros(2, 3), "y": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="must agree across keys"):
        unfold_batch_dim(mixed)


def test_pad_dataproto_to_divisor_takes_size_divisor():
    padded, pad = pad_dataproto_to_divisor(rows(5), size_divisor=4)
    assert pad == 3 and len(padded) == 8
    assert padded.non_tensor_batch["u"].tolist() == ["a", "b", "c", "d", "e", "a", "b", "c"]
    assert unpad_dataproto(padded, pad).non_tensor_batch["u"].tolist() == list("abcde")
    assert pad_dataproto_to_divisor(rows(4), size_divisor=2)[1] == 0


def test_length_comes_from_non_tensor_batch_without_tensors():
    data = DataProto(batch=None, non_tensor_batch={"prompt": np.array(["p", "q", "r"], dtype=object)})
    assert len(data) == 3
    parts = data.chunk(3)
    assert [p.non_tensor_batch["prompt"].tolist() for p in parts] == [["p"], ["q"], ["r"]]
    assert len(DataProto.concat(parts)) == 3 and DataProto.concat(parts).batch is None
    assert len(DataProto(non_tensor_batch={"a": [1, 2]})) == 2
    with pytest.raises(ValueError, match="length mismatch"):
        DataProto(batch=None, non_tensor_batch={"a": np.arange(2), "b": np.arange(3)})


def test_concat_merges_per_worker_metrics_into_lists():
    parts = [
        DataProto(meta_info={"metrics": {"loss": 1.0, "acc": 0.5}, "temperature": 1.0}),
        DataProto(meta_info={"metrics": [{"loss": 2.0, "acc": 1.0}, {"loss": 3.0, "acc": 0.0}], "temperature": 1.0}),
        DataProto(meta_info={"metrics": None}),
        DataProto(meta_info={}),
    ]
    merged = DataProto.concat(parts).meta_info
    assert merged["metrics"] == {"loss": [1.0, 2.0, 3.0], "acc": [0.5, 1.0, 0.0]}
    assert merged["temperature"] == 1.0
    assert "metrics" not in DataProto.concat([rows(2), rows(2)]).meta_info
    with pytest.raises(TypeError, match="part 1 must be a dict or a list of dicts"):
        DataProto.concat([DataProto(meta_info={"metrics": {"a": 1}}), DataProto(meta_info={"metrics": 3.0})])


# ----------------------------------------------------------------------------- dict dispatch modes
SEEN = {}


def split_by_rank(worker_group, data, scale=1):
    SEEN["dispatch_group"] = worker_group
    return (data.chunk(worker_group.world_size),), {"scale": [scale * (r + 1) for r in range(worker_group.world_size)]}


def concat_tensors(worker_group, outputs):
    SEEN["collect_group"], SEEN["outputs"] = worker_group, list(outputs)
    return torch.cat(outputs)


def broadcast(worker_group, *args, **kwargs):
    return args, kwargs  # not per-rank lists: every rank gets them as they are (verl's rule)


def dispatch_data(worker_group, data):  # verl's tutorial ("Extend to other RL(HF) algorithms"), as written there
    return data.chunk(worker_group.world_size)


def collect_data(worker_group, data):
    return torch.cat(data)


class VerlStyle(Worker):
    @register(dispatch_mode={"dispatch_fn": split_by_rank, "collect_fn": concat_tensors})
    def scaled(self, data, scale):
        return data.batch["x"][:, 0] * scale

    @register(dispatch_mode={"dispatch_fn": broadcast, "collect_fn": lambda wg, outs: outs})
    def tag(self, word, suffix="!"):
        return f"{self.rank}:{word}{suffix}"

    @register(dispatch_mode={"dispatch_fn": dispatch_data, "collect_fn": collect_data})
    def tutorial_literal(self, data):
        return DataProto.from_dict({"x": data.batch["x"] * 10}, meta_info={"rank": self.rank})

    @register(dispatch_mode={"dispatch_fn": lambda wg, data: data.chunk(wg.world_size)[:1], "collect_fn": lambda wg, o: o})
    def one_chunk_short(self, data):
        return len(data)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def produce(self, data):
        return DataProto.from_dict({"x": data.batch["x"] + 100})


def test_dict_dispatch_mode_uses_verl_signatures():
    wg = LocalWorkerGroup(ClassWithInitArgs(VerlStyle), world_size=2)
    out = wg.scaled(rows(4), scale=10)
    # rows 0-1 to rank 0 (x[:, 0] = 0, 2) times 10, rows 2-3 to rank 1 (4, 6) times 20
    assert out.tolist() == [0, 20, 80, 120]
    assert SEEN["dispatch_group"] is wg and SEEN["collect_group"] is wg
    assert [t.tolist() for t in SEEN["outputs"]] == [[0, 20], [80, 120]]
    assert wg.tag("hi") == ["0:hi!", "1:hi!"] and wg.tag(["a", "b"], suffix=["?", "."]) == ["0:a?", "1:b."]


def test_dict_dispatch_mode_materializes_futures():
    wg = LocalWorkerGroup(ClassWithInitArgs(VerlStyle), world_size=2)
    future = wg.produce.options(blocking=False)(rows(4))
    assert wg.scaled(future).tolist() == [100, 102, 208, 212]  # x[:, 0] + 100 = 100, 102 | 104, 106; scales 1 | 2


def test_the_tutorials_dispatch_and_collect_functions_run_as_written():
    """dispatch_fn returning one chunk per rank, collect_fn calling torch.cat on the DataProtos."""
    wg = LocalWorkerGroup(ClassWithInitArgs(VerlStyle), world_size=2)
    out = wg.tutorial_literal(rows(4))
    assert isinstance(out, DataProto) and out.batch["x"].tolist() == (rows(4).batch["x"] * 10).tolist()
    assert out.meta_info == {"rank": 0}  # a collect keeps the first part's meta_info, as the DP collect does
    with pytest.raises(TypeError, match="not supported|NotImplemented|unsupported"):
        torch.cat([rows(2), rows(2)], dim=0)  # only the plain form stands for concat


def test_dict_dispatch_mode_errors_say_what_to_write():
    wg = LocalWorkerGroup(ClassWithInitArgs(VerlStyle), world_size=2)
    with pytest.raises(TypeError, match=r"one argument per rank \(2\), got list of 1.*return \(data.chunk"):
        wg.one_chunk_short(rows(4))
    with pytest.raises(TypeError, match=r"wrap rlcore's functions in DispatchMode"):
        register(dispatch_mode={"dispatch_fn": lambda ctx, args, kwargs: [], "collect_fn": lambda ctx, o: o})
    rlcore_style = DispatchMode(lambda ctx, args, kwargs: [(args, kwargs)] * ctx.world_size, lambda ctx, o: o)
    assert register(dispatch_mode=rlcore_style)(lambda self: None)  # rlcore's own pairs still go through DispatchMode


def test_verl_only_dispatch_names_point_to_rlcore_equivalents():
    assert {Dispatch.ONE_TO_ALL, Dispatch.ALL_TO_ALL, Dispatch.RANK_ZERO, Dispatch.DP_COMPUTE_PROTO,
            Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, Dispatch.DP_COMPUTE_METRIC, Dispatch.DP_COMPUTE}
    with pytest.raises(AttributeError, match=r"mesh_dispatch\(\"actor\"\)"):
        Dispatch.MEGATRON_COMPUTE_PROTO
    with pytest.raises(AttributeError):
        Dispatch.NO_SUCH_MODE


# ----------------------------------------------------------------------------- verl's auto padding
class AddRank(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def add(self, data):
        return DataProto.from_dict({"a": data.batch["a"] + 10 * self.rank}, meta_info={"rank": self.rank})


def test_auto_padding_lets_a_dp_call_take_a_batch_that_does_not_divide(monkeypatch):
    wg = LocalWorkerGroup(ClassWithInitArgs(AddRank), world_size=2)
    plain = DataProto.from_dict({"a": torch.tensor([1, 2, 3])})
    with pytest.raises(ValueError, match=r"does not divide across 2 ranks.*DataProtoConfig.auto_padding = True"):
        wg.add(plain)
    flagged = DataProto.from_dict({"a": torch.tensor([1, 2, 3])}, auto_padding=True)
    # padded to [1, 2, 3, 1]: rank 0 adds 0 to [1, 2], rank 1 adds 10 to [3, 1]; the padding row's result is dropped
    out = wg.add(flagged)
    assert out.batch["a"].tolist() == [1, 2, 13] and len(flagged) == 3  # the caller's batch is not padded in place
    assert wg.add(data=flagged).batch["a"].tolist() == [1, 2, 13]  # as a keyword too
    monkeypatch.setattr(DataProtoConfig, "_auto_padding", False)
    DataProtoConfig.auto_padding = True  # verl's process-wide switch
    assert wg.add(plain).batch["a"].tolist() == [1, 2, 13]
    assert wg.add(DataProto.from_dict({"a": torch.tensor([5])})).batch["a"].tolist() == [5]  # [5, 5]: one row each


def test_group_collect_keeps_rank_zeros_meta_where_a_plain_concat_refuses():
    wg = LocalWorkerGroup(ClassWithInitArgs(AddRank), world_size=2)
    data = DataProto.from_dict({"a": torch.tensor([1, 2, 3, 4])})
    assert wg.add(data).meta_info == {"rank": 0}
    by_hand = [wg.worker(r).add(part) for r, part in enumerate(data.chunk(2))]
    with pytest.raises(AssertionError, match=r"Conflicting values for meta_info key 'rank'.*0 \(part 0\) vs 1 \(part 1\)"):
        DataProto.concat(by_hand)  # verl's rule for DataProto.concat
    assert DataProto.concat(by_hand, meta_conflicts="first").batch["a"].tolist() == [1, 2, 13, 14]


# ----------------------------------------------------------------------------- @ray.remote classes
class Echo(Worker):
    def __init__(self, offset=0):
        super().__init__()
        self.offset = offset

    @register(Dispatch.ONE_TO_ALL)
    def where(self):
        return self.rank + self.offset

    def cpus(self):  # not registered: reachable through the raw handles only
        return ray.get_runtime_context().get_assigned_resources().get("CPU")


RemoteEcho = ray.remote(Echo)
RemoteEchoCpus = ray.remote(num_cpus=0.5)(Echo)


def test_ray_remote_class_is_unwrapped():
    cwa = RayClassWithInitArgs(RemoteEchoCpus, offset=5)
    assert cwa.cls is Echo and cwa.ray_options == {"num_cpus": 0.5} and cwa.kwargs == {"offset": 5}
    assert LocalWorkerGroup(RayClassWithInitArgs(RemoteEcho, offset=5), world_size=2).where() == [5, 6]
    with pytest.raises(TypeError, match="needs a worker class"):
        ClassWithInitArgs(Echo(), 1)


def test_device_name_and_detached_are_checked():
    with pytest.raises(ValueError, match=r"use_gpu=True\) for cuda workers"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(RemoteEcho), device_name="cuda")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        RayWorkerGroup(RayResourcePool([1]), RayClassWithInitArgs(RemoteEcho), device_name="npu")
    with pytest.raises(ValueError, match="detached=False"):
        RayResourcePool([1], detached=True)


def test_ray_group_of_remote_classes_with_raw_handles(ray_cluster):
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=2, num_cpus_per_process=1,
                           name_prefix="verl_api")
    plain = RayWorkerGroup(pool, RayClassWithInitArgs(RemoteEcho, offset=10), device_name="cpu")
    sized = RayWorkerGroup(pool, RayClassWithInitArgs(RemoteEchoCpus))
    try:
        assert plain.device_name == "cpu" and plain.where() == [10, 11]
        assert ray.get([w.where.remote() for w in plain.workers], timeout=60) == [10, 11]
        assert plain._workers[1].actor is plain.hosts[1]
        # the share of a bundle (1 CPU / max_colocate_count 2) vs the class's own @ray.remote(num_cpus=0.5)
        assert ray.get([w.cpus.remote() for w in plain._workers], timeout=60) == [0.5, 0.5]
        assert ray.get(sized.workers[0].cpus.remote(), timeout=60) == 0.5
    finally:
        plain.shutdown()
        sized.shutdown()
    too_big = RayClassWithInitArgs(ray.remote(num_cpus=0.75)(Echo))
    first = RayWorkerGroup(pool, too_big)
    with pytest.raises(ResourceError, match=r"already on it take 0.75 and this group's workers ask for 0.75"):
        RayWorkerGroup(pool, too_big)
    first.shutdown()
    with pytest.raises(ValueError, match=r"\['max_restarts'\] are not honoured"):
        RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(max_restarts=2)(Echo)))
    pool.shutdown()


def test_colocated_remote_classes_spawn_and_raw_handles(ray_cluster):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="verl_colo")
    class_dict = {"actor": RayClassWithInitArgs(RemoteEcho, offset=0), "ref": RayClassWithInitArgs(RemoteEcho, offset=100)}
    wg_dict = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(class_dict))
    try:
        spawned = wg_dict.spawn(prefix_set=class_dict.keys())
        assert spawned["actor"].where() == [0, 1] and spawned["ref"].where() == [100, 101]
        assert ray.get(wg_dict.workers[1].ref_where.remote(), timeout=60) == 101
        assert ray.get(spawned["ref"].workers[0].where.remote(), timeout=60) == 100
        with pytest.raises(AttributeError, match="name the role first"):
            wg_dict.workers[0].where
    finally:
        wg_dict.shutdown()
        pool.shutdown()


# ----------------------------------------------------------------------------- the tutorial's driver
def load_example():
    """The example as a module that is not in sys.modules, so Ray ships its classes by value."""
    spec = importlib.util.spec_from_file_location("verl_online_dpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_verl_online_dpo_example_trains(ray_cluster, model_dir):
    example = load_example()
    config = example.default_config(model_dir, steps=4)
    result = ray.get(example.main_task.remote(config), timeout=900)
    history, first = result["history"], result["first_batch"]
    assert len(history) == 4 and all(h["ranks_reporting"] == 2 for h in history)  # metrics merged from both ranks
    # step 1: the actor still equals the reference, so every pair's DPO loss is -log sigmoid(0) = log 2
    assert abs(history[0]["dpo/loss"] - math.log(2)) < 1e-5 and abs(history[0]["dpo/reward_margin"]) < 1e-5
    for h in history:  # each update lowers the loss on the pairs it was computed on
        assert h["dpo/loss_after_update"] < h["dpo/loss"] - 1e-4
    # the preference carries over: fresh batches score below log 2 before their own update (measured 0.64,
    # 0.49, 0.62), and step 1's pairs end well below it (0.45) after the later steps
    assert np.mean([h["dpo/loss"] for h in history[1:]]) < math.log(2) - 0.02
    assert result["first_batch_loss_end"] < math.log(2) - 0.05
    # the reference group's log-probs (dict dispatch over 2 ranks) equal this process's own computation
    model = example.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = example.sequence_log_probs(model, first)
    torch.testing.assert_close(first.batch["ref_log_prob"], expected, atol=1e-5, rtol=1e-5)
    # pairs: chosen (even rows) score at least as high as rejected (odd rows), same prompt
    scores = first.non_tensor_batch["score"]
    assert (scores[0::2] >= scores[1::2]).all()
    assert torch.equal(first.batch["prompts"][0::2], first.batch["prompts"][1::2])
