"""The consistency check's read-back of a vLLM engine's weights, under the trainer's HF names.

Runs inside vLLM's worker (``collective_rpc``), next to the model, and returns only numbers:
``{HF name: (dtype name, elements, hash of the bytes)}`` (``rlcore.algos.consistency.tensor_fingerprint``), and
``None`` for a name whose weight the engine does not keep. Why the split: on vLLM's CPU build a
packed matmul layer keeps no weight tensor, only a oneDNN handle packed from it, and there is no
reading it back; such a name is *unreadable*, which the check counts and leaves out of the
comparison, instead of calling it missing. A layer on its plain weight (``rollout.cpu_weight_layout``
plain, or where ``auto`` put it; every linear layer on a GPU build) is read like any other tensor.

Fused layers (``packed_modules_mapping``: q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``) are
split into their HF parts at the offsets of the layer's ``output_sizes``, the same offsets the
in-place loader copies them to (``rlcore.engines.vllm_worker.InPlacePlan``); a padded vocabulary
is read over its real rows only. A model this cannot map (MoE experts, tensor-parallel shards)
gives ``None`` for the whole engine: the check then stays off, as before.

Imported in vLLM's worker at start-up (through ``vllm_worker``): nothing heavy at import time.
"""

from __future__ import annotations

import torch

from rlcore.algos.consistency import Fingerprint, tensor_fingerprint

EngineChecksums = dict[str, Fingerprint | None]


def _entry(tensor: torch.Tensor) -> Fingerprint:
    return tensor_fingerprint(tensor)


@torch.no_grad()
def engine_checksums(model: torch.nn.Module) -> EngineChecksums | None:
    """Fingerprints of ``model``'s weights by HF name (``None`` for an unreadable one), or ``None`` when
    the model's layout is one this does not map (see the module docstring)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    fused = getattr(model, "packed_modules_mapping", None) or {}
    out: EngineChecksums = {}
    done: set[str] = set()  # parameter names handled through their module
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        if hasattr(module, "w13_weight") or getattr(module, "tp_size", 1) != 1:
            return None  # MoE experts or sharded layers: their HF names are not mapped here
        if isinstance(module, LinearBase):
            parent, _, short = module_name.rpartition(".")
            parts = [f"{parent}.{p}" if parent else p for p in fused.get(short, [short])]
            sizes = list(getattr(module, "output_sizes", None) or [module.output_size])
            if len(sizes) != len(parts):
                return None
            for leaf in ("weight", "bias"):
                tensor = getattr(module, leaf, None)
                if not isinstance(tensor, torch.Tensor):
                    continue
                done.add(prefix + leaf)
                readable = tensor.shape[:1] == (sum(sizes),) and tensor.numel() > 0
                offset = 0
                for part, size in zip(parts, sizes):
                    out[f"{part}.{leaf}"] = _entry(tensor[offset: offset + size]) if readable else None
                    offset += size
        elif isinstance(module, VocabParallelEmbedding):
            done.add(prefix + "weight")
            out[prefix + "weight"] = _entry(module.weight[: module.org_vocab_size])
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in done:  # norms and the like, under the checkpoint's own names
            out[name] = _entry(param)
    return out
