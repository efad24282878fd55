"""FSDP2 building blocks shared by the actor, critic and reward-model workers.

One code path for every scale: a model is built from a local HF directory on every rank, each
decoder layer and then the root are wrapped with ``fully_shard`` over a 1-D mesh of all ranks
(world size 1 included, so a single-process run exercises the same code), and the data-parallel
gradient average comes from FSDP's reduce-scatter. CPU runs use gloo, GPU runs nccl. The keys the
training workers read are the dataclasses of ``rlcore.workers.config`` and ``rlcore.models.config``.
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from rlcore.algos.losses import LossScale
from rlcore.algos.seqlen_balancing import rearrange_micro_batches
from rlcore.engines.layout import crop_padding, pad_back
from rlcore.engines.host_memory import keep_large_blocks, trim_between_layers, trim_heap
from rlcore.engines.seeding import set_deterministic
from rlcore.engines.server import push_buckets
from rlcore.engines.weights import DEFAULT_BUCKET_BYTES, pack_buckets
from rlcore.models.moe import router_modules
from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, Worker, register
from rlcore.workers.config import (
    TrainConfig,
    worker_deterministic,
    worker_device,
    worker_keep_large_blocks,
    worker_release_memory,
    worker_trim_in_update,
)
from rlcore.workers.grad_sync import accumulates_unsynced, drop_unsynced_grads
from rlcore.workers.mismatch import STAND_IN
from rlcore.workers.optim import clip_and_step
from rlcore.workers.checkpoint import (  # noqa: F401 (load_checkpoint: rlcore.trainer.export's)
    load_checkpoint,
    save_checkpoint,
    tied_aliases,
)
from rlcore.workers.moe import router_mp_policy
from rlcore.workers.update_stop import UpdateStop
from rlcore.workers.packing import borrowed_prompt_tokens, group_items, prompt_groups, shares_prompts


def setup_worker(worker: Worker, config: Any, seed: int) -> torch.device:
    """Pick the device (``trainer.device``), join the process group with the matching backend, seed torch
    (and with ``trainer.deterministic``, switch its deterministic algorithms on in this process)."""
    device = worker_device(config)
    worker.release_memory = worker_release_memory(config)  # FSDPTrainWorker.run_updates
    worker.trim_in_update = worker.release_memory and worker_trim_in_update(config)
    if worker_keep_large_blocks(config):  # before the model's weights and the update's blocks are allocated
        keep_large_blocks()
    set_deterministic(worker_deterministic(config), device)
    worker.init_distributed(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # the rank's GPU, set by init_distributed
    torch.manual_seed(seed)  # same on every rank: freshly initialised heads must agree before sharding
    return device


# ----------------------------------------------------------------------------- models
class ScalarHeadModel(nn.Module):
    """A transformer body plus a linear head giving one number per position, shape (B, T).

    One root module (rather than body and head called separately) so that FSDP2 gathers the
    head's and embeddings' parameters in the root's forward hook.
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                **kwargs) -> torch.Tensor:
        """``kwargs``: the attention kernel's own keywords (a pack's row boundaries, rlcore.workers.packing)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        ).last_hidden_state
        return self.head(hidden).squeeze(-1).clone()  # FSDP2 warns about view outputs


def mixed_precision_policy(compute_dtype: str | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for a resolved ``model.mixed_precision`` (``resolve_mixed_precision``):
    compute in it, keep and reduce in float32; None computes in the parameters' own dtype."""
    if compute_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp2(model: nn.Module, device: torch.device,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard every decoder layer (HF's ``_no_split_modules`` names their classes), then the root."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    model.to(device)
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,))
    layer_classes = set()
    for module in model.modules():
        layer_classes |= set(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"found no decoder layers to shard in {type(model).__name__} (classes {sorted(layer_classes)})")
    for router in router_modules(model):  # MoE: each router its own unit, in fp32 (rlcore.workers.moe)
        fully_shard(router, mesh=mesh, mp_policy=router_mp_policy(mp_policy))
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A snapshot of the unsharded parameters as CPU tensors on rank 0 ({} on other ranks). Collective."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_world_size() == 1 and next(model.parameters()).device.type == "cpu":
        state = {k: v.clone() for k, v in state.items()}  # here the "offloaded" tensors are the parameters themselves
    return state


def iter_full_tensors(model: nn.Module):
    """``(name, full CPU tensor)`` for each state-dict entry, one at a time (collective per entry:
    every rank must iterate it to the end, in the same order)."""
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        yield name, full.detach().to("cpu")


def export_hf(model: nn.Module, src_dir: str, out_dir: str, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``model`` as a HF directory that ``from_pretrained`` and vLLM load. Collective.

    Rank 0 saves the full state dict (``state`` when given: rank 0's full weights under the source
    architecture's names, e.g. a LoRA actor's merged ones) through ``save_pretrained`` of a weightless
    (meta) copy of the architecture, then copies the tokenizer and generation files of the source directory.
    """
    state = full_state_dict(model) if state is None else state
    if dist.get_rank() == 0:
        config = AutoConfig.from_pretrained(src_dir)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        aliases = tied_aliases(skeleton)  # a tied head: stored once, re-tied by from_pretrained and vLLM
        skeleton.save_pretrained(out_dir, state_dict={k: v for k, v in state.items() if k not in aliases})
        for name in os.listdir(src_dir):
            weights = name.endswith((".safetensors", ".bin", ".pt", ".safetensors.index.json"))
            if not weights and name != "config.json" and os.path.isfile(os.path.join(src_dir, name)):
                shutil.copy2(os.path.join(src_dir, name), os.path.join(out_dir, name))
    dist.barrier()


# ----------------------------------------------------------------------------- micro-batching
def micro_batch_indices(data: DataProto, micro_batch_size: int, use_dynamic_bsz: bool, max_token_len: int,
                        device: torch.device | None = None, agree: bool = True,
                        share_prompts: bool = False) -> list[np.ndarray]:
    """Row indices of each micro-batch: fixed row counts, or packed to a token budget. Packed, every DP
    rank gets as many micro-batches as the rank that needs most (one all-reduce on ``device``): each
    forward is a round of FSDP collectives, and a rank running fewer would leave the others waiting.
    ``agree=False``: this rank's own packing; the caller makes the counts agree (``trained_micro_batches``).

    ``share_prompts`` (packs that hold a shared prompt once, ``rlcore.workers.packing``): the rows of a
    prompt group go into the same micro-batch where they can (rows in group order; a token budget
    counts the prompt once per micro-batch), so that their prompt is computed once. The order of
    rows within a mini-batch changes no gradient: its micro-batches' losses are summed."""
    groups = prompt_groups(data.batch) if share_prompts and "responses" in data.batch.keys() else None
    if use_dynamic_bsz:
        lengths = data.batch["attention_mask"].sum(-1).tolist()
        items, costs = group_items(data.batch, groups, max_token_len) if groups else (None, lengths)
        count = len(rearrange_micro_batches(costs, max_token_len))
        if agree:
            count = max_over_ranks(count, device)
        if items is None or count > len(items):  # rows, each its own item (also when groups are too few to split)
            return [np.asarray(ix) for ix in rearrange_micro_batches(lengths, max_token_len, count)]
        return [np.concatenate([items[i] for i in ix]) for ix in rearrange_micro_batches(costs, max_token_len, count)]
    if micro_batch_size <= 0:
        raise ValueError(f"micro-batch size must be positive, got {micro_batch_size}")
    order = np.concatenate(groups) if groups else np.arange(len(data))
    return [order[s:s + micro_batch_size] for s in range(0, len(data), micro_batch_size)]


def max_over_ranks(count: int, device: torch.device | None) -> int:
    if dist.is_initialized() and dist.get_world_size() > 1:
        most = torch.tensor(count, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        count = int(most)
    return count


@torch.no_grad()
def forward_micro_batches(module: nn.Module, data: DataProto, indices: list[np.ndarray], device: torch.device,
                          fn: Callable[[DataProto], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Run ``fn`` on each micro-batch without grad; concatenate its outputs back in row order, on CPU.

    Each micro-batch is cropped to its own rows' width first (``load_micro_batch``); ``fn``'s
    per-response-token outputs come back at the batch's width, zeros where the crop dropped padding.

    Then reshard ``module``: FSDP2 leaves the root's parameters gathered after a forward, for the
    backward that usually follows; here none follows, and (with mixed precision, in bf16) the
    gathered copies would otherwise stay in memory until the next call.
    """
    parts = []
    for ix in indices:
        micro, right = load_micro_batch(data, ix, device)
        width = micro.batch["responses"].shape[1] if "responses" in micro.batch.keys() else 0
        parts.append({k: v.cpu() for k, v in pad_back(fn(micro), width, right).items()})
    module.reshard()
    order = np.concatenate(indices)
    inverse = torch.from_numpy(np.argsort(order))
    return {k: torch.cat([p[k] for p in parts])[inverse] for k in parts[0]}


def load_micro_batch(data: DataProto, ix: np.ndarray, device: torch.device) -> tuple[DataProto, int]:
    """Rows ``ix`` on ``device``, without the columns that are padding in all of them
    (``crop_padding``), and how many response columns were dropped on the right. Every forward and
    loss of the workers runs on such a micro-batch: with skewed lengths a micro-batch of short rows
    then costs what its rows need, not the whole batch's padded width."""
    micro, _, right = crop_padding(data[ix].to(device))
    return micro, right


def global_counts(response_mask: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid tokens and non-empty sequences of a mini-batch, summed over all DP ranks."""
    counts = torch.stack([response_mask.bool().sum(), response_mask.bool().any(-1).sum()]).to(device, torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return counts[0], counts[1]


def all_reduce_mean(value: torch.Tensor) -> float:
    value = value.detach().to(torch.float64).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


UNSYNCED_ACCUMULATION = True  # one rank: reduce gradients once per mini-batch (rlcore.workers.grad_sync); tests compare both


class FSDPTrainWorker(Worker):
    """What the actor and critic share: the PPO-style update loop and checkpoints.

    A subclass sets ``self.module``, ``self.optimizer``, ``self.lr_scheduler``, ``self.device`` and
    ``self.train_cfg`` (a ``TrainConfig``) in ``init_model``.
    """

    module: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    device: torch.device
    train_cfg: TrainConfig
    update_calls = 0  # seeds each call's shuffle, saved in checkpoints
    release_memory = False  # trainer.release_memory, set by setup_worker
    trim_in_update = False  # trainer.trim_in_update (with release_memory), set by setup_worker
    _layer_trims = None  # with trim_in_update: the hooks that trim the heap between the update's layers

    @property
    def packs(self) -> bool:
        """Whether forwards run packed micro-batches (``model.use_remove_padding``, rlcore.workers.packing)."""
        return bool(getattr(getattr(self, "model_cfg", None), "use_remove_padding", False))

    @property
    def shares_prompts(self) -> bool:
        """Whether packs hold each shared prompt once (``model.pack_shared_prompts``, rlcore.workers.packing)."""
        model_cfg = getattr(self, "model_cfg", None)
        return model_cfg is not None and shares_prompts(model_cfg, getattr(self, "moe", None))

    def micro_batches(self, data: DataProto, agree: bool = True) -> list[np.ndarray]:
        if self.module is None:
            raise RuntimeError(f"{type(self).__name__}: call init_model() first")
        cfg = self.train_cfg
        return micro_batch_indices(data, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                   cfg.ppo_max_token_len_per_gpu, self.device, agree, self.shares_prompts)

    def trained_micro_batches(self, mini: DataProto, rows_with_grad: Callable[[DataProto], torch.Tensor] | None
                              ) -> list[tuple[np.ndarray, bool]]:
        """The micro-batches of ``mini`` to run, each with whether it counts (False: a stand-in, below).

        ``rows_with_grad(mini)``: a (B,) bool mask of the rows whose loss can have a gradient; the
        others are left out of every forward and backward. The loss's counts come from the whole
        mini-batch (``LossScale``), so leaving out rows whose gradient is exactly zero changes
        nothing but the compute. Every rank must still run as many forward/backward passes as the
        others (each is a round of FSDP collectives), and at least one, so that every parameter
        gets a gradient, zero or not (a missing one would skip AdamW's moment decay and weight
        decay, which a zero one does not): a rank short of passes runs stand-ins, one row whose
        loss is multiplied by 0.
        """
        if rows_with_grad is None:
            return [(ix, True) for ix in self.micro_batches(mini)]
        keep = np.flatnonzero(rows_with_grad(mini).cpu().numpy())
        parts = [keep[ix] for ix in self.micro_batches(mini[keep], agree=False)] if len(keep) else []
        count = max(max_over_ranks(len(parts), self.device), 1)
        return [(ix, True) for ix in parts] + [(np.arange(1), False)] * (count - len(parts))

    def run_updates(self, data: DataProto, loss_fn: Callable[..., tuple[torch.Tensor, dict]], prefix: str,
                    rows_with_grad: Callable[[DataProto], torch.Tensor] | None = None) -> dict[str, float]:
        """``ppo_epochs`` passes over this rank's rows in mini-batches, one optimizer step each.

        ``loss_fn(micro, scale)`` (``scale`` a ``LossScale``) returns this micro-batch's
        contribution to the global mini-batch loss (``agg_loss``'s contract): backward of the plain
        sum over micro-batches, with FSDP averaging over ranks, gives the gradient of the global
        mean whatever the split. The reported ``loss`` is that global value. Each micro-batch is
        cropped to its rows' own width (``load_micro_batch``); ``scale`` keeps the mini-batch's
        counts and response width, so the loss does not depend on the crop. ``rows_with_grad``:
        rows outside it are not run at all (``trained_micro_batches``); the per-micro-batch
        metrics then describe the rows trained, and ``{prefix}/trained_rows_frac`` says how many.
        ``{prefix}/pad_frac_batch``: the share of padding in the mini-batches as handed over;
        ``{prefix}/pad_frac_computed``: the share of the positions the forwards computed that were
        padding (cropped micro-batches; 0 packed); ``{prefix}/shared_prompt_frac``: the share of the
        valid tokens that packs holding shared prompts once did not compute (``model.pack_shared_prompts``).
        A stopping run may give the update up between micro-batches before its first optimizer step
        (``UpdateStop``: ``AbandonedCallError``, the gradients dropped, nothing else changed).
        """
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__} has no optimizer (role {getattr(self, 'role', '?')!r}, "
                               f"or init_model() was not called)")
        cfg, ws = self.train_cfg, self.world_size
        global_rows = cfg.ppo_mini_batch_size or len(data) * ws
        if global_rows % ws or len(data) % (global_rows // ws):
            raise ValueError(f"ppo_mini_batch_size={global_rows} must split evenly over {ws} ranks and divide "
                             f"each rank's {len(data)} rows")
        self.module.train()
        if self.trim_in_update and self._layer_trims is None:  # the update's freed temporaries handed back
            self._layer_trims = trim_between_layers([m for m in self.module.modules()
                                                     if isinstance(m, FSDPModule) and m is not self.module])
        elif not self.trim_in_update and self._layer_trims:  # switched off since (benchmarks/update.py's A/B)
            for handle in self._layer_trims:
                handle.remove()
            self._layer_trims = None
        metrics: dict[str, list[float]] = defaultdict(list)
        seed = cfg.seed + self.update_calls
        stop = UpdateStop(self.module, self.device)  # a stopping run gives the update up before its first step
        unsynced = UNSYNCED_ACCUMULATION and accumulates_unsynced(self.module, ws)
        for mini in data.make_iterator(global_rows // ws, cfg.ppo_epochs, seed=seed, shuffle=cfg.shuffle):
            tokens, seqs = global_counts(mini.batch["response_mask"], self.device)
            # norm_len: the mini-batch's response width, whatever width each cropped micro-batch has
            width = mini.batch["responses"].shape[1] if "responses" in mini.batch.keys() else None
            scale = LossScale(global_tokens=tokens, global_seqs=seqs, dp_size=ws, norm_len=width)
            total = torch.zeros((), device=self.device)
            trained = 0
            valid = int(mini.batch["attention_mask"].sum())
            metrics["pad_frac_batch"].append(1 - valid / max(mini.batch["attention_mask"].numel(), 1))
            computed = valid_computed = borrowed = 0
            micro_batches = self.trained_micro_batches(mini, rows_with_grad)
            try:
                for i, (ix, counts) in enumerate(micro_batches):
                    stop.check()
                    if unsynced:  # one rank: FSDP2 reduces the gradients after the last backward only (grad_sync)
                        self.module.set_requires_gradient_sync(i == len(micro_batches) - 1)
                    micro = load_micro_batch(mini, ix, self.device)[0]
                    micro.meta_info = {**micro.meta_info, STAND_IN: not counts}  # a stand-in's statistics count nowhere
                    valid_computed += int(micro.batch["attention_mask"].sum())  # packed: every position computed is valid
                    computed += micro.batch["attention_mask"].numel()
                    if self.shares_prompts and "responses" in micro.batch.keys():
                        borrowed += borrowed_prompt_tokens(micro.batch)
                    loss, micro_metrics = loss_fn(micro, scale)
                    if not counts:
                        loss = loss * 0.0  # a stand-in pass: the same collectives, no gradient
                    if self.trim_in_update:  # what the forward freed between the activations it keeps: handed back
                        trim_heap()
                    loss.backward()
                    if counts:
                        total += loss.detach()
                        trained += len(ix)
                        for k, v in micro_metrics.items():
                            metrics[k].append(v)
            except BaseException:
                if unsynced:  # given up (or failed) mid mini-batch: what it accumulated unsharded goes too
                    drop_unsynced_grads(self.module)
                raise
            finally:
                if unsynced:
                    self.module.set_requires_gradient_sync(True)
            if rows_with_grad is not None:
                metrics["trained_rows_frac"].append(trained / len(mini))
            metrics["pad_frac_computed"].append(0.0 if self.packs else 1 - valid_computed / max(computed, 1))
            if self.shares_prompts:
                metrics["shared_prompt_frac"].append(borrowed / max(valid_computed, 1))
            stop.check()
            grad_norm, lr = clip_and_step(self.module, self.optimizer, self.lr_scheduler, cfg.grad_clip)
            stop.stepped()
            metrics["loss"].append(all_reduce_mean(total))
            metrics["grad_norm"].append(grad_norm)
            metrics["lr"].append(lr)
        self.update_calls += 1
        if self.release_memory:  # the activations and gradients just freed: back to the machine, not kept in the heap
            trim_heap()
        return {f"{prefix}/{k}": float(np.mean(v)) for k, v in metrics.items()}

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded model, optimizer, LR schedule, RNG and update counter into directory ``path``."""
        extra = {"update_calls": self.update_calls}
        if self.lr_scheduler is not None:
            extra["lr_scheduler"] = self.lr_scheduler.state_dict()
        save_checkpoint(path, self.module, self.optimizer, extra)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        extra = load_checkpoint(path, self.module, self.optimizer)
        self.update_calls = extra["update_calls"]
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])

    def engine_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """What engines and HF exports load, from the module's own (full) state-dict entries: the same
        entries here; a LoRA actor merges its adapters in (``rlcore.workers.lora``)."""
        return named

    @register(Dispatch.COLLECTIVE_RANK_ZERO)
    def get_full_state_dict(self) -> dict[str, torch.Tensor]:
        """{HF name: full CPU tensor} from rank 0 (every rank takes part in the gather)."""
        return dict(self.engine_weights(full_state_dict(self.module).items()))

    def full_weights_uncopied(self) -> dict[str, torch.Tensor]:
        """``get_full_state_dict`` for a reader done with it before the next optimizer step (the hybrid
        engine's sync, which copies the weights into the engine at once; an HF export, which writes
        them): with one CPU rank, the module's own tensors rather than a snapshot of them (a second
        full fp32 copy, 0.54 GB at SmolLM2, held for the length of every sync and export). Collective
        like ``get_full_state_dict`` where there are several ranks."""
        if self.world_size > 1 or self.device.type != "cpu":
            return self.get_full_state_dict()
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return dict(self.engine_weights(state.items()))

    @register(Dispatch.COLLECTIVE_RANK_ZERO)
    def push_weights(self, engines: list, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     in_flight: bool = False, timeout_s: float = 600.0) -> dict[str, float]:
        """Stream the weights to engine servers (``RemoteEngine``s) as ``version``, in buckets, straight
        from the FSDP shards: every rank takes part in gathering one parameter at a time; rank 0 packs
        them into buckets of ``bucket_bytes`` and sends each to every engine, so no rank ever holds the
        whole model. Returns rank 0's timing and size metrics."""
        tensors = iter_full_tensors(self.module)
        if self.rank != 0:
            for _ in tensors:  # the same gathers in the same order as rank 0
                pass
            return {}
        return push_buckets(engines, pack_buckets(self.engine_weights(tensors), bucket_bytes), version, in_flight,
                            timeout_s)
