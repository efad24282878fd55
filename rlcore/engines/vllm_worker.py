"""The part of a weight update that runs inside vLLM's worker process (``worker_extension_cls``).

vLLM mixes this class into its worker, so ``collective_rpc("load_bucket_file", ...)`` runs it next
to the model: it maps the bucket's shared-memory file (no copy through the RPC), views each tensor
in it, and reloads those weights in place through vLLM's own loader (HF names mapped onto fused
q/k/v and gate/up parameters, cast to the engine's dtype). This module must not import anything
heavy: vLLM imports it in its worker at start-up.
"""

from __future__ import annotations

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
        self.model_runner.reload_weights(weights_iterator=iter(tensors))
        return len(tensors)
